"""One pydantic model per DeepSpeed config section, with DeepSpeed's key names and defaults.

These are typed containers; `tachyon.config.load_config` is the entry point that checks keys
(did-you-mean, unsupported features) before validating into them. Keys DeepSpeed defines but
tachyon refuses or ignores are listed in `tachyon.config.keys`, not here.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, PlainValidator, model_validator

from .errors import ConfigError
from .quantize_training import MoQConfig
from .types import (
    BucketSize,
    DType,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Section,
    ZeroStage,
    _integral_float,
    problem,
)


class FP16Config(Section):
    """``"fp16"``: fp16 mixed precision with loss scaling.

    ``loss_scale == 0`` selects dynamic loss scaling starting at ``2**initial_scale_power``:
    overflowing steps are skipped; the scale halves (never below ``min_loss_scale``) once
    ``hysteresis`` overflows are counted (only consecutive ones with ``consecutive_hysteresis``)
    and doubles after ``loss_scale_window`` steps without overflow. Any other ``loss_scale`` is
    a static scale.
    """

    enabled: bool = False
    auto_cast: bool = False  # true is refused (see keys.UNSUPPORTED_KEYS)
    loss_scale: NonNegativeFloat = 0.0
    initial_scale_power: Annotated[int, Field(ge=0, le=64)] = 16
    loss_scale_window: PositiveInt = 1000
    hysteresis: PositiveInt = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: PositiveFloat = 1.0

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0


class BF16Config(Section):
    """``"bf16"`` (DeepSpeed's older spelling ``"bfloat16"`` is accepted): bf16 weights and
    activations with fp32 master weights; no loss scaling is needed.

    ``check_grad_overflow`` (DeepSpeed's key; default on here, off in DeepSpeed): a step whose
    gradients hold an inf or nan on any rank is skipped on every rank and counted in
    ``skipped_steps`` (`tachyon.engine.nonfinite`). Cost: one all-reduce of a flag per optimizer
    step (shared with ``preemption``) and a device-to-host read of it; the check reads the global
    gradient norm the engine computes anyway, so no extra pass over the gradients."""

    enabled: bool = False
    check_grad_overflow: bool = True


def _none_means_false(value: Any) -> Any:
    return False if value is None else value


def _offload_device(section: str):
    def check(value: Any) -> Any:
        if isinstance(value, str):
            lowered = value.lower()
            if lowered == "nvme":
                raise problem(
                    f'`zero_optimization.{section}.device: "nvme"` (ZeRO-Infinity\'s NVMe offload) is not supported '
                    'by tachyon; offload to "cpu" (host memory) or use "none"'
                )
            return lowered
        return value

    return check


class OffloadOptimizerConfig(Section):
    """``"zero_optimization.offload_optimizer"`` (ZeRO-Offload): ``device: "cpu"`` keeps the fp32
    master weights and optimizer states in host memory and runs the optimizer step there (a
    fused CPU Adam for Adam / AdamW); gradients are moved to the host as they are reduced.
    Stages 1, 2 and 3. ``pin_memory``: page-locked host buffers (faster, asynchronous copies; on
    CUDA only). ``"nvme"`` is refused by name. DeepSpeed's NVMe / pipelining knobs are accepted
    and ignored (docs/zero.md)."""

    device: Annotated[Literal["none", "cpu"], BeforeValidator(_offload_device("offload_optimizer"))] = "none"
    pin_memory: bool = False
    ratio: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Fraction of the optimizer work offloaded (DeepSpeed's partial offload): only 1.0 is supported."""

    @model_validator(mode="after")
    def _whole(self) -> OffloadOptimizerConfig:
        if self.ratio != 1.0:
            raise problem(f"`zero_optimization.offload_optimizer.ratio: {self.ratio}` (partial optimizer offload) is not supported; tachyon offloads "
                          "the whole optimizer (ratio 1.0)")
        return self


class OffloadParamConfig(Section):
    """``"zero_optimization.offload_param"`` (stage 3 only): ``device: "cpu"`` keeps the sharded
    fp32 parameters and their gradients in host memory (FSDP2's CPU offload policy); each
    block's shards are copied to the device when it is gathered, and the optimizer steps on the
    host. ``"nvme"`` is refused by name."""

    device: Annotated[Literal["none", "cpu"], BeforeValidator(_offload_device("offload_param"))] = "none"
    pin_memory: bool = False


class ZeroConfig(Section):
    """``"zero_optimization"``: ZeRO stage 0 (plain data parallel), 1 (optimizer states
    partitioned), 2 (optimizer states and gradients partitioned) or 3 (parameters too, on
    torch's FSDP2: docs/zero.md). Bucket sizes count elements.

    ``overlap_comm: null`` means DeepSpeed's dynamic default, which is false below stage 3.
    ``stage3_prefetch_bucket_size``: at stage 3, non-zero makes each sharded block's forward
    prefetch the next block's all-gather (FSDP2's explicit forward prefetch; the size itself is
    not used: FSDP2 gathers whole blocks), 0 turns that off. ``shard_module_classes``
    (tachyon's): class names of the modules stage 3 shards as one unit each, besides the ones it
    finds itself (tachyon's transformer layers and an HF model's ``_no_split_modules``).
    """

    stage: ZeroStage = 0
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: BucketSize = 500_000_000
    allgather_bucket_size: BucketSize = 500_000_000
    overlap_comm: Annotated[bool, BeforeValidator(_none_means_false)] = False
    round_robin_gradients: bool = False
    stage3_prefetch_bucket_size: Annotated[int, BeforeValidator(_integral_float), Field(ge=0)] = 50_000_000
    prefetch_bucket_size: Annotated[int, BeforeValidator(_integral_float), Field(ge=0)] | None = Field(None, exclude=True)
    """DeepSpeed's other spelling of ``stage3_prefetch_bucket_size`` (read as that key)."""
    shard_module_classes: list[str] | None = None
    offload_optimizer: OffloadOptimizerConfig | None = None
    offload_param: OffloadParamConfig | None = None

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_optimizer is not None and self.offload_optimizer.device == "cpu"

    @property
    def offloads_params(self) -> bool:
        return self.offload_param is not None and self.offload_param.device == "cpu"

    @model_validator(mode="before")
    @classmethod
    def _one_prefetch_key(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("prefetch_bucket_size") is None:
            return data
        data = dict(data)
        other = data.pop("prefetch_bucket_size")
        if "stage3_prefetch_bucket_size" in data and data["stage3_prefetch_bucket_size"] != other:
            raise problem(
                f"`zero_optimization.prefetch_bucket_size` ({other}) and `zero_optimization."
                f"stage3_prefetch_bucket_size` ({data['stage3_prefetch_bucket_size']}) name the same setting with "
                "different values; keep one"
            )
        data["stage3_prefetch_bucket_size"] = other
        return data


class DataTypesConfig(Section):
    """``"data_types"``: ``grad_accum_dtype`` is the dtype gradients accumulate in across
    micro-batches (None: DeepSpeed's choice, the training precision or fp32 with ZeRO)."""

    grad_accum_dtype: DType | None = None


_TAG_VALIDATION = {"warn": "Warn", "ignore": "Ignore", "fail": "Fail"}


def _tag_validation(value: Any) -> Any:
    if isinstance(value, str):
        return _TAG_VALIDATION.get(value.lower(), value)
    return value


class CheckpointConfig(Section):
    """``"checkpoint"``: ``tag_validation`` checks that every rank saves/loads the same tag
    (Warn logs a mismatch, Fail raises, Ignore skips the check; case-insensitive)."""

    tag_validation: Annotated[
        Literal["Warn", "Ignore", "Fail"], BeforeValidator(_tag_validation)
    ] = "Warn"
    load_universal: bool = False  # true is refused (see keys.UNSUPPORTED_KEYS)
    use_node_local_storage: bool = False
    allow_nonfinite: bool = False
    """Save a model or optimizer state holding an inf or nan (default: refused with a
    CheckpointError before anything is written, so ``latest`` keeps naming a usable checkpoint)."""


def _false_means_none(value: Any) -> Any:
    # DeepSpeed templates in the wild write "number_checkpoints": false for "not set".
    return None if value is False else value


class NonFiniteGradientsConfig(Section):
    """``"nonfinite_gradients"`` (tachyon's): a step whose gradients hold an inf or nan is skipped
    on every rank (`tachyon.engine.nonfinite`); after ``max_consecutive_skips`` such steps in a row
    training stops with `tachyon.engine.nonfinite.NonFiniteGradientsError` (0: never stops).
    fp16 overflows while the dynamic loss scale can still be lowered are its calibration and do
    not count."""

    max_consecutive_skips: NonNegativeInt = 10


_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")


class PreemptionConfig(Section):
    """``"preemption"`` (tachyon's; off by default): save a checkpoint and stop when the process
    gets one of ``signals`` (SIGTERM: ``kill``, ``docker stop``, Kubernetes; SIGUSR1: SLURM's
    ``--signal``). Every rank finishes the optimizer step it is in, the ranks agree at the next
    step boundary (one all-reduce of a flag per step, shared with the non-finite check), the
    engine saves into ``save_dir`` (tag ``global_step<N>``) and raises
    `tachyon.engine.preemption.Preempted`, a SystemExit with ``exit_code`` (75, sysexits'
    EX_TEMPFAIL: try again later). No handler is installed while ``enabled`` is false."""

    enabled: bool = False
    save_dir: str | None = None
    signals: list[Literal[_SIGNALS]] = Field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])  # type: ignore[valid-type]
    exit_code: Annotated[int, Field(ge=1, le=255)] = 75

    @model_validator(mode="after")
    def _needs_save_dir(self) -> PreemptionConfig:
        if self.enabled and not self.save_dir:
            raise ValueError("preemption.enabled needs preemption.save_dir (where the checkpoint is saved on a signal)")
        if not self.signals and self.enabled:
            raise ValueError("preemption.signals is empty; name at least one of " + ", ".join(_SIGNALS))
        return self


class CudaGraphConfig(Section):
    """``"cuda_graph"`` (tachyon's; off by default): capture the model's forward and backward as
    CUDA graphs at the first training micro-batch and replay them for every later one
    (`tachyon.make_graphed_callables`, docs/cuda_graphs.md): the host time between kernels
    disappears. Inputs must keep the first micro-batch's shapes and dtypes (pad to a fixed length).
    ``num_warmup_iters`` forward + backward runs precede the capture (Triton compiles and
    autotunes); they change no weight, gradient, buffer or RNG state. Needs a CUDA device; refused
    with progressive layer drop (a host-side draw), a PipelineModule, the flops profiler (hooks), and
    CPU activation checkpointing / synchronized checkpoint boundaries (host work inside a capture)."""

    enabled: bool = False
    num_warmup_iters: Annotated[int, Field(ge=1)] = 3


class ActivationCheckpointingConfig(Section):
    """``"activation_checkpointing"``: how checkpointed activations are stored.
    ``cpu_checkpointing`` needs ``partition_activations`` (as in DeepSpeed)."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: Annotated[PositiveInt | None, BeforeValidator(_false_means_none)] = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    @model_validator(mode="after")
    def _cpu_needs_partition(self) -> ActivationCheckpointingConfig:
        if self.cpu_checkpointing and not self.partition_activations:
            raise problem(
                "`activation_checkpointing.cpu_checkpointing: true` needs "
                "`activation_checkpointing.partition_activations: true` (CPU checkpointing "
                "moves the partitioned activations)"
            )
        return self


class MonitorConfig(Section):
    """``"tensorboard"`` and ``"csv_monitor"``: scalars written to ``output_path/job_name``."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class ProgressiveLayerDropConfig(Section):
    """``"progressive_layer_drop"``: drop whole transformer layers at random during training, more
    often as training goes on and deeper in the stack (Zhang & He, 2020; see
    docs/progressive_layer_drop.md and `tachyon.engine.pld`).

    The global keep ratio follows ``theta(t) = (1 - theta) * exp(-gamma * t) + theta`` over
    optimizer steps t: 1 at the start, decaying to ``theta`` (the lowest keep ratio, in (0, 1])
    at rate ``gamma`` (>= 0; 0 keeps every layer). Defaults are those of DeepSpeed's
    ``ProgressiveLayerDrop`` and its tutorial (theta 0.5, gamma 0.001).
    """

    enabled: bool = False
    theta: Annotated[float, Field(gt=0, le=1)] = 0.5
    gamma: NonNegativeFloat = 0.001


class FlopsProfilerConfig(Section):
    """``"flops_profiler"``: profile one training step (`tachyon.profiling.FlopsProfiler`).

    At optimizer step ``profile_step`` (0-based: the step that starts when ``global_steps ==
    profile_step``; DeepSpeed's default 1 skips the first, warm-up step) global rank 0 counts
    the forward and backward FLOPs of every micro-batch of the step, times each module's
    forward, and after the step writes the profile to ``output_file`` (None: standard
    output). Training goes on unchanged. ``module_depth`` (-1: all), ``top_modules`` and
    ``detailed`` shape the printed report as in ``FlopsProfiler.print_model_profile``.
    ``recompute_fwd_factor`` is DeepSpeed's estimate of activation recomputation (a fraction of
    the forward) used only where the backward was not measured; the engine measures it.
    """

    enabled: bool = False
    recompute_fwd_factor: NonNegativeFloat = 0.0
    profile_step: NonNegativeInt = 1
    module_depth: Annotated[int, Field(ge=-1)] = -1
    top_modules: PositiveInt = 1
    detailed: bool = True
    output_file: str | None = None


class QuantizeBitsConfig(Section):
    """``"quantize_training.quantize_bits"``: the grid starts at ``start_bits`` and loses one bit
    per switch until ``target_bits`` (both in [2, 16], start >= target)."""

    start_bits: Annotated[int, Field(ge=2, le=16)] = 16
    target_bits: Annotated[int, Field(ge=2, le=16)] = 8


class QuantizeScheduleConfig(Section):
    """``"quantize_training.quantize_schedule"``: snapping starts after ``schedule_offset``
    optimizer steps; bits drop at ``quantize_period`` steps past it, then 2x, 4x, ... that."""

    quantize_period: PositiveInt = 100
    schedule_offset: NonNegativeInt = 0


class QuantizeAlgoConfig(Section):
    """``"quantize_training.quantize-algo"``: symmetric grids, round to nearest (DeepSpeed's
    asymmetric and stochastic variants are not implemented)."""

    q_type: Literal["symmetric"] = "symmetric"
    rounding: Literal["nearest"] = "nearest"


class MixedQuantizeConfig(Section):
    """``"quantize_training.fp16_mixed_quantize"``: weights are ``r * w + (1 - r) * Q(w)``, r
    starting at 1 after each bit switch and falling by ``quantize_change_ratio`` per step."""

    enabled: bool = False
    quantize_change_ratio: Annotated[float, Field(gt=0, le=1)] = 0.001


class QuantizeTrainingConfig(Section):
    """``"quantize_training"``: MoQ quantization-aware training (`tachyon.engine.moq`; the
    schedule and grid: `tachyon.inference.moq`). DeepSpeed's keys and its default (off).

    ``quantize_groups`` is DeepSpeed's number of flat groups per weight (1, its default, means one
    scale per output channel here, which is finer); ``group_size`` (tachyon's) groups that many
    input columns per scale; give one of them. ``quantizer_kernel`` is accepted and ignored;
    ``eigenvalue`` is refused unless disabled. `MoQConfig.from_dict` checks the rules across keys,
    so the section is refused here exactly as the standalone ``MoQ`` would refuse it.
    """

    enabled: bool = False
    quantize_bits: QuantizeBitsConfig = Field(default_factory=QuantizeBitsConfig)
    quantize_schedule: QuantizeScheduleConfig = Field(default_factory=QuantizeScheduleConfig)
    quantize_groups: PositiveInt | None = None
    group_size: PositiveInt | None = None
    quantize_algo: QuantizeAlgoConfig = Field(default_factory=QuantizeAlgoConfig, alias="quantize-algo")
    fp16_mixed_quantize: MixedQuantizeConfig = Field(default_factory=MixedQuantizeConfig)
    quantize_verbose: bool = False

    @model_validator(mode="after")
    def _moq_rules(self) -> QuantizeTrainingConfig:
        try:
            self.moq_config()
        except ConfigError as error:
            raise problem("; ".join(error.problems)) from None
        return self

    def moq_config(self) -> MoQConfig:
        """The section as the frozen `MoQConfig` the schedule runs on."""
        return MoQConfig.from_dict(self.model_dump(by_alias=True, exclude_none=True))


def _zero_means_one(value: Any) -> Any:
    # DeepSpeed's AutoTP writes "autotp_size": 0 for "off"
    return 1 if type(value) is int and value == 0 else value


class TensorParallelConfig(Section):
    """``"tensor_parallel"``: Megatron-style tensor parallelism applied by `tachyon.initialize`
    (`tachyon.parallel.tensor.parallelize`) over ``tp_size`` adjacent ranks.

    ``tp_size`` and DeepSpeed's AutoTP name ``autotp_size`` are the same setting (0 for
    ``autotp_size`` means off, i.e. 1; both given must agree). ``sequence_parallel`` splits the
    hidden states between transformer layers along the sequence (Korthikanti et al. 2022). The
    data-parallel size is ``world / (pipeline.stages * tp_size)``; see docs/parallelism.md.
    """

    tp_size: PositiveInt | None = None
    autotp_size: Annotated[PositiveInt | None, BeforeValidator(_zero_means_one)] = None
    sequence_parallel: bool = False

    @model_validator(mode="after")
    def _one_size(self) -> TensorParallelConfig:
        if self.tp_size is not None and self.autotp_size is not None and self.tp_size != self.autotp_size:
            raise problem(
                f"`tensor_parallel.tp_size` ({self.tp_size}) and `tensor_parallel.autotp_size` "
                f"({self.autotp_size}) name the same setting with different values; keep one"
            )
        return self

    @property
    def size(self) -> int:
        """The tensor-parallel size (1 when neither key is given)."""
        return self.tp_size or self.autotp_size or 1


PIPELINE_SCHEDULES = ("GPipe", "1F1B", "interleaved_1F1B")


def _schedule_name(value: Any) -> Any:
    if isinstance(value, str):
        key = value.lower().replace("-", "_")
        return {s.lower(): s for s in PIPELINE_SCHEDULES}.get(key, value)
    return value


def _partition_method(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    if value == "best":  # DeepSpeed's config default: its engine balances parameters
        return "parameters"
    if value in ("parameters", "uniform"):
        return value
    if value.startswith("type:") and len(value) > len("type:"):
        try:
            re.compile(value[len("type:"):])
        except re.error as error:
            raise problem(f"`pipeline.partition`: {json.dumps(value)} is not a valid regex ({error})") from None
        return value
    raise problem(
        f"`pipeline.partition` should be \"parameters\" (DeepSpeed's \"best\"), \"uniform\" or "
        f"\"type:<regex>\"; got {json.dumps(value)}"
    )


def _stages(value: Any) -> int | str:
    if value == "auto" or (type(value) is int and value >= 1):
        return value
    raise problem(f'`pipeline.stages` should be "auto" or an int >= 1; got {json.dumps(value)}')


class PipelineConfig(Section):
    """``"pipeline"``: DeepSpeed's pipeline section, plus ``schedule``.

    ``stages``: pipeline stages (``"auto"``, DeepSpeed's default: the PipelineModule's own
    ``num_stages``). ``schedule``: ``"1F1B"`` (default), ``"GPipe"`` or ``"interleaved_1F1B"``;
    its micro-batches are the ``gradient_accumulation_steps``. ``partition`` (``"best"`` =
    ``"parameters"``), ``seed_layers`` and ``activation_checkpoint_interval`` are the
    PipelineModule's constructor arguments of the same meaning: ``tachyon train --pp`` builds
    its PipelineModule with them; a PipelineModule given to `tachyon.initialize` must agree
    with the first two when the config sets them, and a positive
    ``activation_checkpoint_interval`` is applied to it (DeepSpeed's PipelineEngine).
    ``use_reentrant: false`` sets its ``activation_checkpoint_func`` to
    ``checkpointing.non_reentrant_checkpoint``; true / unset (DeepSpeed's default) keeps the
    module's function (tachyon's checkpointing is non-reentrant either way). ``pipe_partitioned`` / ``grad_partitioned`` (DeepSpeed's
    splitting of the activations sent between stages over tensor-parallel ranks) are accepted
    and have no effect (`tachyon.config.ACCEPTED_IGNORED_KEYS`).
    """

    stages: Annotated[int | str, PlainValidator(_stages)] = "auto"
    schedule: Annotated[Literal["GPipe", "1F1B", "interleaved_1F1B"], BeforeValidator(_schedule_name)] = "1F1B"
    partition: Annotated[str, BeforeValidator(_partition_method)] = "parameters"
    seed_layers: bool = False
    activation_checkpoint_interval: NonNegativeInt = 0
    use_reentrant: bool | None = None

    @property
    def num_stages(self) -> int | None:
        """The configured stage count, None for ``"auto"``."""
        return None if self.stages == "auto" else self.stages


class OptimizerConfig(Section):
    """``"optimizer"``: ``type`` is the canonical name; ``params`` holds every parameter of that
    type with DeepSpeed's defaults filled in (see `tachyon.config.optim`)."""

    type: Literal["Adam", "AdamW", "Lamb", "SGD", "OneBitAdam", "OneBitLamb", "ZeroOneAdam"]
    params: dict[str, Any] = Field(default_factory=dict)


class SchedulerConfig(Section):
    """``"scheduler"``: ``type`` is the canonical name; ``params`` holds every parameter of that
    type with DeepSpeed's defaults filled in (see `tachyon.config.optim`)."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]
    params: dict[str, Any] = Field(default_factory=dict)

"""TachyonConfig, the validated top-level config, and `load_config`, the only way to build one.

`load_config` takes a DeepSpeed-style JSON file or dict and, in this order: checks every key
(unknown keys get a did-you-mean, unimplemented DeepSpeed features are refused, accepted no-op
keys are recorded), validates types strictly, checks cross-section rules (fp16 vs bf16,
grad_accum_dtype) and resolves the three batch sizes for ``world_size`` data-parallel ranks. It
reports every problem it finds in one ConfigError. It is a pure function: no global state, no
torch.distributed calls.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationError

from . import hjson
from .batch import check_world_size, resolve_batch_sizes
from .errors import ConfigError, not_supported, render, validation_problems
from .keys import UNSUPPORTED_KEYS, walk
from .optim import check_typed_section
from .sections import (
    ActivationCheckpointingConfig,
    BF16Config,
    CheckpointConfig,
    CudaGraphConfig,
    DataTypesConfig,
    FlopsProfilerConfig,
    FP16Config,
    MonitorConfig,
    NonFiniteGradientsConfig,
    OptimizerConfig,
    PipelineConfig,
    PreemptionConfig,
    ProgressiveLayerDropConfig,
    QuantizeTrainingConfig,
    SchedulerConfig,
    TensorParallelConfig,
    ZeroConfig,
)
from .types import DType, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Section

class TachyonConfig(Section):
    """A validated DeepSpeed-style config. Build it with `load_config`.

    After `load_config` the three batch sizes are always set. Sections are pydantic models
    (``config.fp16.enabled``, ``config.zero_optimization.stage``); ``optimizer`` and
    ``scheduler`` are None when absent, and their ``params`` dicts hold every parameter with
    DeepSpeed's defaults filled in.
    """

    train_batch_size: PositiveInt | None = None
    train_micro_batch_size_per_gpu: PositiveInt | None = None
    gradient_accumulation_steps: PositiveInt | None = None

    gradient_clipping: NonNegativeFloat = 0.0
    """Clip the global gradient norm to this value; 0 turns clipping off."""
    steps_per_print: PositiveInt = 10
    wall_clock_breakdown: bool = False
    seed: NonNegativeInt | None = None
    prescale_gradients: bool = False
    """Divide gradients by world_size before the all-reduce instead of after it."""
    gradient_predivide_factor: PositiveFloat = 1.0
    """Without prescaling: divide by this before the all-reduce and by world_size / factor
    after it (balances fp16 overflow against underflow)."""
    communication_data_type: DType | None = None
    """dtype gradients are all-reduced in; None: the training precision."""
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    dataloader_drop_last: bool = False
    """The engine-built DataLoader (``training_data=``, ``engine.deepspeed_io``) drops a last
    incomplete micro-batch."""

    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    tensorboard: MonitorConfig = Field(default_factory=MonitorConfig)
    csv_monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    progressive_layer_drop: ProgressiveLayerDropConfig = Field(default_factory=ProgressiveLayerDropConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    quantize_training: QuantizeTrainingConfig = Field(default_factory=QuantizeTrainingConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    nonfinite_gradients: NonFiniteGradientsConfig = Field(default_factory=NonFiniteGradientsConfig)
    preemption: PreemptionConfig = Field(default_factory=PreemptionConfig)
    cuda_graph: CudaGraphConfig = Field(default_factory=CudaGraphConfig)

    _ignored: dict[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def precision(self) -> Literal["fp32", "fp16", "bf16"]:
        """The training precision: ``"fp16"``, ``"bf16"`` or ``"fp32"``."""
        if self.fp16.enabled:
            return "fp16"
        if self.bf16.enabled:
            return "bf16"
        return "fp32"

    @property
    def zero_stage(self) -> int:
        return self.zero_optimization.stage

    @property
    def model_parallel_size(self) -> int:
        """pipeline stages x tensor-parallel size as configured (``stages: "auto"`` counts 1:
        the model decides, see `tachyon.initialize`)."""
        return (self.pipeline.num_stages or 1) * self.tensor_parallel.size

    @property
    def ignored_keys(self) -> tuple[str, ...]:
        """Dotted paths of keys that were present and accepted with no effect
        (`tachyon.config.ACCEPTED_IGNORED_KEYS`, or unsupported features switched off)."""
        return tuple(self._ignored)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready DeepSpeed-style dict; ``load_config(c.to_dict(), world_size) == c`` for
        the world_size ``c`` was loaded with. Ignored keys are written back as given."""
        out = self.model_dump(mode="json", exclude_none=True, by_alias=True)
        for path, value in self._ignored.items():
            node = out
            *parents, leaf = path.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = copy.deepcopy(value)
        return out


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"duplicate key '{key}' in the config file")
        out[key] = value
    return out


def read_config_file(path: Path) -> Any:
    """The file as JSON, or else as Hjson (comments, trailing commas, unquoted keys: the JSON
    superset DeepSpeed reads config files as): through the hjson package when it is installed (the
    reader DeepSpeed uses), else through tachyon's own reader (`tachyon.config.hjson`)."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {str(path)!r} (expected a JSON file or a dict)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason}); save the JSON as UTF-8") from None
    try:
        return json.loads(text, object_pairs_hook=_reject_duplicates)
    except json.JSONDecodeError:
        pass
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
    try:
        package = importlib.import_module("hjson")
    except ImportError:
        package = None
    try:
        if package is not None:
            return package.loads(text, object_pairs_hook=_reject_duplicates)
        return hjson.loads(text)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
    except ValueError as error:  # hjson.HjsonDecodeError / tachyon's HjsonError
        where = f"{getattr(error, 'lineno', '?')}:{getattr(error, 'colno', '?')}"
        reader = "the hjson package" if package is not None else "tachyon's Hjson reader"
        raise ConfigError(
            f"{path}:{where}: invalid JSON (and invalid Hjson, which DeepSpeed also reads; read by {reader}): "
            f"{getattr(error, 'msg', error)}"
        ) from None


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, TachyonConfig):
        return config.to_dict()
    if isinstance(config, (str, os.PathLike)):
        config = read_config_file(Path(config))
    elif isinstance(config, Mapping):
        config = copy.deepcopy(dict(config))
    else:
        raise ConfigError(
            "config should be a path to a JSON file, a dict or a TachyonConfig; "
            f"got {type(config).__name__}"
        )
    if not isinstance(config, dict):
        raise ConfigError(f"the config should be a JSON object; got {type(config).__name__}")
    return config


def _cross_section_problems(config: TachyonConfig) -> list[str]:
    problems = []
    if config.fp16.enabled and config.bf16.enabled:
        problems.append(
            "`fp16.enabled` and `bf16.enabled` are both true; choose one training precision"
        )
    accum = config.data_types.grad_accum_dtype
    if accum is not None and not problems and accum not in ("fp32", config.precision) and config.zero_stage == 0:
        problems.append(
            f'`data_types.grad_accum_dtype: "{accum}"` with "{config.precision}" training and no ZeRO: gradients '
            f'accumulate in "{config.precision}" or "fp32" (DeepSpeed refuses this mix without ZeRO too); use one of '
            "those, or a ZeRO stage (which accumulates in the model dtype)"
        )
    stages = config.pipeline.num_stages or 1
    if stages > 1 and config.zero_stage >= 2:
        problems.append(
            f"`zero_optimization.stage: {config.zero_stage}` with `pipeline.stages: {stages}`: ZeRO stages 2 and 3 "
            "partition gradients during every micro-batch's backward, which a pipeline schedule interleaves "
            "across micro-batches (DeepSpeed refuses it too); use zero_optimization.stage 0 or 1 with pipelines"
        )
    if config.optimizer is not None and config.optimizer.type == "ZeroOneAdam" and config.zero_stage != 0:
        problems.append(
            f'`optimizer.type: "ZeroOneAdam"` with `zero_optimization.stage: {config.zero_stage}`: 0/1 Adam averages '
            "each rank's whole gradient and momentum itself, and ZeRO partitions them (DeepSpeed does not combine "
            "them either); use stage 0, or OneBitAdam with ZeRO stages 1-2"
        )
    problems.extend(stage3_problems(config))
    problems.extend(offload_problems(config))
    if config.tensor_parallel.sequence_parallel and config.activation_checkpointing.partition_activations:
        problems.append(
            "`activation_checkpointing.partition_activations: true` with `tensor_parallel.sequence_parallel: true`: "
            "partitioning keeps 1/tp of each checkpointed input and all-gathers it back, which assumes the input is "
            "the same on every tensor-parallel rank; sequence parallelism already splits those inputs along the "
            "sequence (each rank holds a different slice). Turn one of them off"
        )
    tp = config.tensor_parallel.size
    if config.quantize_training.enabled and tp > 1:
        problems.append(
            f"`quantize_training.enabled: true` with `tensor_parallel.tp_size: {tp}`: MoQ scales each output channel "
            "by its largest weight, and a row-parallel shard holds only part of each row, so the shards would not "
            "share one grid; use tensor_parallel.tp_size 1 with quantize_training"
        )
    return problems


def stage3_problems(config: TachyonConfig) -> list[str]:
    """What ZeRO stage 3 (FSDP2, `tachyon.engine.zero.fsdp`) cannot combine with, by name."""
    if config.zero_stage != 3:
        return []
    problems = []
    kind = config.optimizer.type if config.optimizer is not None else None
    if kind in ("OneBitAdam", "OneBitLamb"):
        problems.append(
            f'`optimizer.type: "{kind}"` with `zero_optimization.stage: 3`: the 1-bit optimizers average compressed '
            "gradients themselves, from every rank's whole gradient; stage 3 reduce-scatters each block's gradients "
            "inside the backward (DeepSpeed does not combine them either); use stage 0 with 1-bit optimizers"
        )
    if kind == "Lamb":
        problems.append(
            '`optimizer.type: "Lamb"` with `zero_optimization.stage: 3`: LAMB\'s trust ratio needs the norm of every '
            "whole parameter, and stage 3 steps per-parameter shards; use stage 1 or 2 with Lamb, or Adam / AdamW"
        )
    if config.quantize_training.enabled:
        problems.append(
            "`quantize_training.enabled: true` with `zero_optimization.stage: 3`: MoQ snaps the model's whole linear "
            "weights onto a grid after every step, and stage 3 holds only shards of them; use stage 0, 1 or 2"
        )
    if config.cuda_graph.enabled:
        problems.append(
            "`cuda_graph.enabled: true` with `zero_optimization.stage: 3`: FSDP2 gathers and frees each block's "
            "parameters in module hooks that decide on the host and synchronize streams, which a captured graph "
            "cannot replay; use stage 0, 1 or 2 with cuda_graph"
        )
    return problems


def offload_problems(config: TachyonConfig) -> list[str]:
    """What ZeRO-Offload (`tachyon.engine.zero.offload`) cannot combine with, by name."""
    zero, problems = config.zero_optimization, []
    if zero.offloads_params and zero.stage != 3:
        problems.append(
            f'`zero_optimization.offload_param: {{"device": "cpu"}}` with `zero_optimization.stage: {zero.stage}`: '
            "parameters are offloaded only where they are sharded, at stage 3 (DeepSpeed requires stage 3 too)"
        )
    if zero.offloads_optimizer and zero.stage == 0:
        problems.append(
            '`zero_optimization.offload_optimizer: {"device": "cpu"}` with `zero_optimization.stage: 0`: ZeRO-Offload '
            "moves each rank's partition of the optimizer states to the host; use stage 1, 2 or 3"
        )
    kind = config.optimizer.type if config.optimizer is not None else None
    if (zero.offloads_optimizer or zero.offloads_params) and kind in ("OneBitAdam", "OneBitLamb"):
        problems.append(
            f'`optimizer.type: "{kind}"` with ZeRO-Offload: the 1-bit optimizers compress and exchange gradients on '
            "the training device; turn offload off"
        )
    if (zero.offloads_optimizer or zero.offloads_params) and config.quantize_training.enabled:
        problems.append(
            "`quantize_training.enabled: true` with ZeRO-Offload: MoQ snaps the model's weights from full-precision "
            "values kept beside the device weights, which offload moves to the host; turn one of them off"
        )
    return problems


def _data_parallel_size(config: TachyonConfig, world_size: int) -> int:
    """world_size / (pipeline stages x tensor-parallel size), or ConfigError naming the keys."""
    stages, tp = config.pipeline.num_stages or 1, config.tensor_parallel.size
    if world_size % (stages * tp):
        what = {(True, False): f"`pipeline.stages` ({stages})", (False, True): f"`tensor_parallel.tp_size` ({tp})"}.get(
            (stages > 1, tp > 1), f"`pipeline.stages` ({stages}) x `tensor_parallel.tp_size` ({tp}) = {stages * tp}")
        raise ConfigError(
            f"{what} does not divide the world size ({world_size}); the data-parallel size world / (stages x "
            f"tp_size) must be a whole number: choose sizes whose product divides {world_size}"
        )
    return world_size // (stages * tp)


_DEPRECATED_OFFLOAD = (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param"))


def _deprecated_offload_keys(raw: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """DeepSpeed's older ZeRO-Offload spellings, read as DeepSpeed reads them: ``cpu_offload: true``
    is ``offload_optimizer: {"device": "cpu"}``, ``cpu_offload_param: true`` is ``offload_param:
    {"device": "cpu"}``, ``cpu_offload_use_pin_memory`` their ``pin_memory``; false and null
    values are dropped. Given beside the new spelling, the config is refused (which one was meant is unclear)."""
    zero = raw.get("zero_optimization")
    if not isinstance(zero, dict) or not any(old in zero for old, _ in _DEPRECATED_OFFLOAD) \
            and "cpu_offload_use_pin_memory" not in zero:
        return raw
    zero = dict(zero)
    pin = zero.pop("cpu_offload_use_pin_memory", False)
    pin = False if pin is None else pin
    if not isinstance(pin, bool):
        problems.append(f"`zero_optimization.cpu_offload_use_pin_memory` must be true or false; got {pin!r}")
        pin = False
    for old, new in _DEPRECATED_OFFLOAD:
        if old not in zero:
            continue
        value = zero.pop(old)
        if value is None:  # DeepSpeed's default: off
            continue
        if not isinstance(value, bool):
            problems.append(f"`zero_optimization.{old}` must be true or false; got {value!r}")
        elif value and new in zero:
            problems.append(f"`zero_optimization.{old}: true` (the older spelling of `{new}`) beside `{new}`; "
                            f"keep `{new}` only")
        elif value:
            zero[new] = {"device": "cpu", "pin_memory": pin}
    return {**raw, "zero_optimization": zero}


def _gradient_allreduce_op(raw: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """``gradient_allreduce_op`` as DeepSpeed reads it: "mean" or "sum" in any case, anything else
    invalid. "mean" (tachyon's reduction) goes on to the key walk, which accepts it; "sum" is
    refused by feature, adding DeepSpeed's own refusal where it has one (ZeRO stage 3, ZenFlow,
    DeepCompile)."""
    if "gradient_allreduce_op" not in raw:
        return raw
    value = raw["gradient_allreduce_op"]
    op = value.lower() if isinstance(value, str) else None
    if op == "mean":
        return raw
    if op != "sum":
        problems.append(f'Invalid gradient_allreduce_op {render(value)}: DeepSpeed\'s operations are "mean" (the '
                        'default, tachyon\'s) and "sum" (which tachyon does not support yet)')
    else:
        message = not_supported("gradient_allreduce_op", UNSUPPORTED_KEYS["gradient_allreduce_op"], value, '"mean"')
        zero = raw.get("zero_optimization") if isinstance(raw.get("zero_optimization"), dict) else {}
        compile_ = raw.get("compile") if isinstance(raw.get("compile"), dict) else {}
        also = [what for what, applies in (("ZeRO stage 3", zero.get("stage") == 3),
                                           ("ZenFlow", zero.get("zenflow") is not None),
                                           ("DeepCompile", bool(compile_.get("deepcompile")))) if applies]
        if also:
            message += f"; DeepSpeed refuses it too: 'sum' is not supported with {' or '.join(also)}"
        problems.append(message)
    return {key: item for key, item in raw.items() if key != "gradient_allreduce_op"}


def parse_config(config: Any) -> TachyonConfig:
    """Validate a DeepSpeed-style config without resolving its batch sizes (they stay as given):
    every key, type and cross-section rule of `load_config`, nothing that needs the number of
    ranks. `tachyon.initialize` reads the parallel layout from it before the data-parallel size
    is known."""
    raw = _as_dict(config)
    problems: list[str] = []
    ignored: dict[str, Any] = {}

    if "bfloat16" in raw:  # DeepSpeed's older name for the bf16 section
        if "bf16" in raw:
            problems.append("both `bf16` and its older name `bfloat16` are given; keep `bf16`")
            raw.pop("bfloat16")
        else:
            raw = {("bf16" if k == "bfloat16" else k): v for k, v in raw.items()}

    raw = _deprecated_offload_keys(raw, problems)
    raw = _gradient_allreduce_op(raw, problems)
    cleaned = walk(raw, TachyonConfig, "", ignored, problems)
    for section in ("optimizer", "scheduler"):
        if isinstance(cleaned.get(section), dict):
            checked, section_problems = check_typed_section(section, cleaned[section])
            problems.extend(section_problems)
            if checked is None:
                cleaned.pop(section)
            else:
                cleaned[section] = checked

    try:
        result = TachyonConfig.model_validate(cleaned)
    except ValidationError as error:
        raise ConfigError(problems + validation_problems(error)) from None
    problems.extend(_cross_section_problems(result))
    if problems:
        raise ConfigError(problems)
    _ignore_what_deepspeed_ignores(raw, result, ignored)
    result._ignored = ignored
    return result


def _ignore_what_deepspeed_ignores(raw: dict[str, Any], config: TachyonConfig, ignored: dict[str, Any]) -> None:
    """Values DeepSpeed accepts and then does not use, accepted the same way and reported in
    ``ignored_keys`` (IGNORED_VALUES says why)."""
    accum = config.data_types.grad_accum_dtype
    if accum is not None and (accum not in ("fp32", config.precision) or config.zero_stage == 3) \
            and config.zero_stage > 0 and accum != "fp32":
        ignored["data_types.grad_accum_dtype"] = accum
        config.data_types.grad_accum_dtype = None
    zero = raw.get("zero_optimization") if isinstance(raw.get("zero_optimization"), dict) else {}
    if config.zero_stage == 3:
        for key in STAGE3_IGNORED:
            if key in zero:
                ignored[f"zero_optimization.{key}"] = zero[key]
    if config.fp16.enabled and config.zero_stage == 0 and config.fp16.hysteresis != 1:
        # DeepSpeed's fp16 optimizer without ZeRO halves the scale at every overflow (its ZeRO
        # optimizers' scaler is the one that spends hysteresis first)
        fp16 = raw.get("fp16") if isinstance(raw.get("fp16"), dict) else {}
        if "hysteresis" in fp16:
            ignored["fp16.hysteresis"] = fp16["hysteresis"]
        config.fp16.hysteresis = 1
    optimizer = raw.get("optimizer")
    if config.optimizer is not None and config.optimizer.type == "AdamW" and isinstance(optimizer, dict) \
            and isinstance(optimizer.get("params"), dict) and optimizer["params"].get("adam_w_mode") is False:
        ignored["optimizer.params.adam_w_mode"] = False


IGNORED_VALUES: dict[str, str] = {
    "fp16.hysteresis": "without ZeRO (stage 0): DeepSpeed's fp16 optimizer halves the loss scale at every overflow, "
                       "and so does tachyon; the hysteresis counts at ZeRO stages 1 and 2",
    "data_types.grad_accum_dtype": "a dtype other than fp32 or the model's under ZeRO stage 1/2: DeepSpeed's ZeRO "
                                   "optimizer accumulates in the model dtype then, and so does tachyon; at stage 3 "
                                   "gradients accumulate in the sharded fp32 master gradient (FSDP2) whatever it says",
    **{f"zero_optimization.{key}": f"at stage 3: {why}" for key, why in {
        "reduce_bucket_size": "FSDP2 reduce-scatters each sharded block's gradients in one collective (the bucket is "
                              "the block)",
        "allgather_bucket_size": "FSDP2 all-gathers each sharded block's parameters in one collective",
        "overlap_comm": "FSDP2 overlaps its collectives with compute on its own streams (on GPUs) whatever it says",
        "contiguous_gradients": "FSDP2 reduce-scatters into one contiguous buffer per block",
        "reduce_scatter": "stage 3 always reduce-scatters",
        "round_robin_gradients": "a stage 1/2 gradient-copy schedule",
    }.items()},
    "optimizer.params.adam_w_mode": 'false with type "AdamW": DeepSpeed applies decoupled weight decay for AdamW '
                                    "whatever adam_w_mode says, and so does tachyon",
}
"""Keys whose value is accepted and ignored in some combinations (`TachyonConfig.ignored_keys`)."""
STAGE3_IGNORED = ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
                  "reduce_scatter", "round_robin_gradients")
"""zero_optimization keys of stages 1/2 that a stage-3 config may carry (reported, no effect)."""


def load_config(config: Any, world_size: int = 1, *, data_parallel_size: int | None = None) -> TachyonConfig:
    """Validate a DeepSpeed-style config and resolve its batch sizes.

    Args:
        config: path (str or PathLike) to a JSON file, a dict, or a TachyonConfig (re-checked
            against ``world_size``). The input is not modified.
        world_size: number of ranks of the job.
        data_parallel_size: ranks holding different data, over which the batch sizes are
            resolved (``train_batch_size = micro * gas * data_parallel_size``). Default:
            ``world_size / (pipeline.stages * tensor_parallel.tp_size)`` (``stages: "auto"``
            counts 1); `tachyon.initialize` passes it when a PipelineModule or an mpu decides
            the layout.

    Returns a TachyonConfig with all three batch sizes set. Raises ConfigError listing every
    problem found (each names its full key path and what is allowed).
    """
    check_world_size(world_size)
    result = parse_config(config)
    ignored = result._ignored
    if data_parallel_size is None:
        data_parallel_size = _data_parallel_size(result, world_size)
    else:
        check_world_size(data_parallel_size)
        if world_size % data_parallel_size:
            raise ConfigError(f"data_parallel_size={data_parallel_size} does not divide the world size {world_size}")
    tbs, micro, gas = resolve_batch_sizes(
        result.train_batch_size,
        result.train_micro_batch_size_per_gpu,
        result.gradient_accumulation_steps,
        data_parallel_size,
    )
    result = result.model_copy(
        update={
            "train_batch_size": tbs,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": gas,
        }
    )
    result._ignored = ignored
    return result

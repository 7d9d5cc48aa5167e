"""The settings of ``tachyon train``: a JSON file with the job's own keys plus a DeepSpeed-style
``engine`` section passed to :func:`tachyon.initialize` as it is (after two fill-ins, below).

    {
      "model": "bert",                  "bert" (masked LM, fused kernel layers) or "gpt" (causal LM)
      "tokenizer": "bpe",               "bpe" (shipped, 2048 ids), "byte" or a tokenizer.json path
      "hidden_size": 128, "num_layers": 2, "num_heads": 4, "seq_len": 32, "mask_prob": 0.3,
      "steps": 500,                     optimizer steps of the whole run (resume continues to it)
      "checkpoint_interval": 250,       save every K steps (and at the end); 0: only at the end
      "eval_interval": 50,              validation loss every K steps (and at the end)
      "output_dir": null,               null: runs/<model>-<timestamp>
      "nproc": 2,                       processes on a CPU machine (a GPU machine uses all GPUs)
      "precision": "auto",              "auto": bf16 where the machine computes it natively (helpers.native_bf16)
      "engine": {"train_micro_batch_size_per_gpu": 64, "zero_optimization": {"stage": 2}, ...}
    }

Tensor and pipeline parallelism (model "gpt" only) are the engine's own sections too:
``"engine": {..., "tensor_parallel": {"tp_size": 2}, "pipeline": {"stages": 2, "schedule":
"1F1B"}}``; the command's ``--tp N`` / ``--pp M`` (``load_train_config(tp=, pp=)``) set
``tensor_parallel.tp_size`` and ``pipeline.stages``. ``--pp`` above 1 also turns a ZeRO stage 2
of the engine section into stage 1 (a pipeline accumulates the gradients of its micro-batches
inside the schedule, which stage 2's partitioned gradients cannot follow; the engine refuses
stage 2 with a pipeline given in the config itself), and, when the section sets no
``train_batch_size``, raises ``gradient_accumulation_steps`` (the pipeline's micro-batches) to
the stage count if it is lower (1F1B needs a micro-batch per stage), dividing the micro-batch
by as much when it divides, so each data-parallel rank still takes as many samples per step.
The data-parallel size is then ``processes / (tp * pp)``.

ZeRO is the engine's ``zero_optimization`` section; the command's ``--zero N`` and
``--offload`` (``load_train_config(zero=, offload=)``) set its ``stage`` and its
``offload_optimizer`` to ``{"device": "cpu", "pin_memory": true}`` (optimizer states, fp32
masters and the step on the host; stage 1, 2 or 3), keeping the section's other keys;
``--no-offload`` removes ``offload_optimizer`` and ``offload_param``. Stage 3 shards the
parameters too (FSDP2, one unit per transformer layer); ``--pp`` above 1 with stage 3 is refused
by the engine.

Progressive layer drop is the engine's own section, as in DeepSpeed: ``"engine":
{..., "progressive_layer_drop": {"enabled": true, "theta": 0.5, "gamma": 0.001}}``; the
command's ``--pld`` / ``--no-pld`` (``load_train_config(pld=...)``) set its ``enabled`` and keep
the rest (the engine's defaults: DeepSpeed's theta 0.5, gamma 0.001).

Fill-ins into ``engine`` (only where the key is absent): ``bf16``/``fp16`` from ``precision``
(an explicit ``bf16`` or ``fp16`` section in ``engine`` must agree with a non-"auto" precision),
``scheduler.params.total_num_steps`` = ``steps`` for the decaying schedules, and ``seed``.
Unknown keys, wrong types and out-of-range values raise :class:`tachyon.config.ConfigError`
naming the key (the engine section is checked later by :func:`tachyon.config.load_config`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from tachyon.config import ConfigError
from tachyon.config.errors import did_you_mean, unknown_key, validation_problems
from tachyon.config.types import NonNegativeInt, PositiveInt, Section

__all__ = ["BUILT_IN_JOBS", "DEFAULT_ENGINE", "TrainConfig", "load_train_config", "resolve_precision"]

Ratio = Annotated[float, Field(ge=0.0, lt=1.0)]

DEFAULT_ENGINE: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 64,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "steps_per_print": 50,
    "optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 5e-3, "warmup_num_steps": 30,
                             "warmup_type": "linear"}},
    "zero_optimization": {"stage": 2},
}
"""The engine section used when a config has none: AdamW, linear warmup + decay, ZeRO-2."""

GPT_JOB: dict[str, Any] = {
    "model": "gpt", "position": "rope", "num_layers": 4, "seq_len": 128, "steps": 300, "examples": 3,
    "engine": {
        "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "steps_per_print": 50,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"warmup_num_steps": 30, "warmup_type": "linear", "cos_min_ratio": 0.1}},
        "zero_optimization": {"stage": 2},
    },
}
"""`tachyon train --model gpt` without a config (= examples/train_gpt_cpu.json): what differs from
the BERT defaults (RoPE, GPT-style AdamW betas and weight decay, a cosine schedule)."""

BUILT_IN_JOBS: dict[str, dict[str, Any]] = {"bert": {}, "gpt": GPT_JOB}
"""The job ``tachyon train [--model M]`` runs without a config: TrainConfig's defaults, updated by these."""

_TOTAL_STEPS_SCHEDULERS = ("WarmupDecayLR", "WarmupCosineLR")


class TrainConfig(Section):
    """The validated settings of one training run (see the module docstring for the JSON)."""

    model: Literal["bert", "gpt"] = "bert"
    tokenizer: str = "bpe"
    """"bpe" (the shipped 2048-id tokenizer.json), "byte" (262 ids) or a tokenizer.json path."""
    hidden_size: PositiveInt = 128
    num_layers: PositiveInt = 2
    num_heads: PositiveInt = 4
    intermediate_size: PositiveInt | None = None
    """FFN width; null: 4 * hidden_size."""
    seq_len: Annotated[int, Field(ge=8)] = 32
    hidden_dropout: Ratio = 0.0
    attention_dropout: Ratio = 0.0
    tie_embeddings: bool = True
    position: Literal["learned", "rope"] = "learned"
    """GPT only: learned position table or rotary embeddings."""
    mask_prob: Annotated[float, Field(gt=0.0, le=1.0)] = 0.3
    """BERT only: share of the training tokens selected for prediction (validation always scores 15 %)."""
    kernel_flags: dict[str, bool] = Field(default_factory=dict)
    """BERT only: TransformerKernelConfig memory flags (normalize_invertible, gelu_checkpoint,
    attn_dropout_checkpoint, stochastic_mode)."""

    steps: PositiveInt = 500
    checkpoint_interval: NonNegativeInt = 250
    eval_interval: NonNegativeInt = 50
    """Score the validation split every K steps (and always at the last step); 0: only at the end."""
    eval_batches: PositiveInt | None = None
    """Validation micro-batches per data-parallel rank that one evaluation scores (with a
    pipeline: batches of one step's micro-batches); null: the whole split."""
    examples: NonNegativeInt = 5
    """Fill-mask predictions (BERT) or generated passages (GPT) in summary.txt; 0: none."""
    output_dir: str | None = None
    nproc: PositiveInt = 2
    """Processes on a machine without CUDA (with CUDA: one per GPU); --nproc overrides both."""
    threads_per_process: PositiveInt | None = None
    """torch intra-op threads per process on CPU; null: the machine's cores / nproc."""
    seed: NonNegativeInt = 0
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    fp8: Literal["delayed", "current", "block"] | None = None
    """GPT only: run the TransformerLayers' GEMMs in FP8 under this recipe (tachyon.autocast around
    each training and validation forward): "delayed" (DelayedScaling(amax_history_len=16,
    amax_compute_algo="max"), amaxes all-reduced over every rank), "current" (Float8CurrentScaling())
    or "block" (Float8BlockScaling()); null: no FP8."""
    engine: dict[str, Any] = Field(default_factory=lambda: copy.deepcopy(DEFAULT_ENGINE))

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        allowed_flags = ("normalize_invertible", "gelu_checkpoint", "attn_dropout_checkpoint", "stochastic_mode")
        for key in self.kernel_flags:
            if key not in allowed_flags:
                guess = did_you_mean(key, allowed_flags)
                hint = f"; did you mean '{guess}'?" if guess else ""
                raise ValueError(f"kernel_flags: unknown flag {key!r}{hint} (allowed: {', '.join(allowed_flags)})")
        if self.kernel_flags and self.model != "bert":
            raise ValueError("kernel_flags apply to model 'bert' only")
        if self.tokenizer not in ("bpe", "byte") and not Path(self.tokenizer).is_file():
            raise ValueError(f"tokenizer must be \"bpe\", \"byte\" or the path of a tokenizer.json file; "
                             f"got {self.tokenizer!r}, which is neither")
        if self.position != "learned" and self.model != "gpt":
            raise ValueError("position 'rope' applies to model 'gpt' only (BERT uses learned positions)")
        if self.model != "gpt" and (self.tensor_parallel_size > 1 or self.pipeline_stages > 1):
            raise ValueError(
                f"tensor parallelism (tp {self.tensor_parallel_size}) and pipeline parallelism (pp "
                f"{self.pipeline_stages}) apply to model 'gpt' only: the BERT job's fused kernel layer has no "
                "tensor-parallel form and no pipeline layer list; use --model gpt")
        if self.fp8 is not None and (self.model != "gpt" or self.pipeline_stages > 1 or self.seq_len % 16):
            raise ValueError(f"fp8 {self.fp8!r} applies to model 'gpt' without pipeline stages and with a seq_len that "
                             f"is a multiple of 16 (FP8 GEMM dimensions; got model {self.model!r}, pp "
                             f"{self.pipeline_stages}, seq_len {self.seq_len}): the BERT job's fused kernel layer has "
                             "no FP8 GEMMs, and a pipeline runs its backward inside the forward's schedule")
        pld = self.engine.get("progressive_layer_drop")
        if self.pipeline_stages > 1 and isinstance(pld, dict) and pld.get("enabled") is True:
            raise ValueError(f"progressive layer drop with pipeline parallelism (pp {self.pipeline_stages}) is not "
                             "supported: a pipeline stage passes only the hidden states from layer to layer, not the "
                             "keep ratio; use --no-pld or pp 1")
        return self

    @property
    def tensor_parallel_size(self) -> int:
        """``engine.tensor_parallel.tp_size`` (or ``autotp_size``), 1 when absent."""
        section = self.engine.get("tensor_parallel")
        if not isinstance(section, dict):
            return 1
        size = section.get("tp_size") or section.get("autotp_size") or 1
        return size if isinstance(size, int) else 1  # a bad value is the engine config check's to name

    @property
    def pipeline_stages(self) -> int:
        """``engine.pipeline.stages``, 1 when absent or "auto" (the job's PipelineModule is built
        with this many stages)."""
        section = self.engine.get("pipeline")
        stages = section.get("stages", 1) if isinstance(section, dict) else 1
        return stages if isinstance(stages, int) and not isinstance(stages, bool) else 1

    @property
    def objective(self) -> str:
        return "masked" if self.model == "bert" else "causal"

    def engine_config(self, precision: str) -> dict[str, Any]:
        """The ``engine`` dict with the fill-ins (precision, total_num_steps, seed) applied.

        ``precision`` is the resolved training precision ("bf16", "fp16" or "fp32")."""
        engine = copy.deepcopy(self.engine)
        explicit = self._engine_precision()
        if explicit is not None:
            if self.precision not in ("auto", explicit):
                raise ConfigError(f"`precision` is \"{self.precision}\" but `engine.{explicit}.enabled` is true; "
                                  "keep one of them")
        elif precision in ("bf16", "fp16"):
            engine[precision] = {**engine.get(precision, {}), "enabled": True}
        scheduler = engine.get("scheduler")
        if isinstance(scheduler, dict) and scheduler.get("type") in _TOTAL_STEPS_SCHEDULERS:
            params = scheduler.setdefault("params", {})
            if isinstance(params, dict):
                params.setdefault("total_num_steps", self.steps)
        engine.setdefault("seed", self.seed)
        return engine

    def training_precision(self, bf16_available: bool) -> str:
        """The precision this run trains in (``precision`` resolved, or the engine's own section)."""
        return self._engine_precision() or resolve_precision(self.precision, bf16_available)

    def _engine_precision(self) -> str | None:
        """"bf16" or "fp16" when the ``engine`` section enables it itself (bf16 first), else None."""
        for name in ("bf16", "fp16"):
            section = self.engine.get(name)
            if isinstance(section, dict) and section.get("enabled", False):
                return name
        return None


def resolve_precision(precision: str, bf16_available: bool) -> str:
    """"auto" -> "bf16" when this machine computes bf16 natively (a GPU with bf16, a CPU with
    oneDNN's bf16 kernels: ``helpers.native_bf16``), else "fp32"; anything else unchanged."""
    if precision == "auto":
        return "bf16" if bf16_available else "fp32"
    return precision


def load_train_config(source: str | Path | dict[str, Any] | None = None, *, model: str | None = None,
                      pld: bool | None = None, tp: int | None = None, pp: int | None = None,
                      zero: int | None = None, offload: bool | None = None, **overrides: Any) -> TrainConfig:
    """A TrainConfig from a JSON path, a dict or None (the built-in job of ``model``, default
    "bert"), with ``model`` and ``overrides`` applied on top (keys of TrainConfig; None values are
    skipped). ``pld`` (None: as the config says) sets ``engine.progressive_layer_drop.enabled``;
    ``tp`` / ``pp`` (None: as the config says) set ``engine.tensor_parallel.tp_size`` and
    ``engine.pipeline.stages``; ``zero`` / ``offload`` set ``engine.zero_optimization.stage`` and
    its ``offload_optimizer`` (module docstring). Raises ConfigError naming the key."""
    if model is not None and model not in BUILT_IN_JOBS:
        raise ConfigError(f"model must be one of {', '.join(BUILT_IN_JOBS)}; got {model!r}")
    if source is None:
        raw: dict[str, Any] = copy.deepcopy(BUILT_IN_JOBS[model or "bert"])
    elif isinstance(source, dict):
        raw = copy.deepcopy(source)
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file not found: {str(path)!r}")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}: not valid JSON ({error})") from None
        except UnicodeDecodeError as error:
            raise ConfigError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason}); save the JSON as "
                              "UTF-8") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a JSON object, got {type(raw).__name__}")
    raw.update({k: v for k, v in {"model": model, **overrides}.items() if v is not None})
    if pld is not None:
        _set_pld(raw, pld)
    if tp is not None or pp is not None:
        _set_layout(raw, tp, pp)
    if zero is not None or offload is not None:
        _set_zero(raw, zero, offload)
    known = TrainConfig.model_fields
    problems = [unknown_key(str(key), "", known) for key in raw if key not in known]
    if problems:
        raise ConfigError(problems)
    try:
        return TrainConfig.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(validation_problems(error)) from None


def _set_pld(raw: dict[str, Any], enabled: bool) -> None:
    """``raw["engine"]["progressive_layer_drop"]["enabled"] = enabled`` (the engine section is
    the default one when the config has none), keeping the section's theta and gamma."""
    if not isinstance(enabled, bool):
        raise ConfigError(f"pld must be True, False or None; got {enabled!r}")
    engine = raw.get("engine", copy.deepcopy(DEFAULT_ENGINE))
    if not isinstance(engine, dict):
        raise ConfigError(f"`engine` must be a JSON object (the DeepSpeed-style config); got {type(engine).__name__}")
    section = engine.get("progressive_layer_drop", {})
    if not isinstance(section, dict):
        raise ConfigError("`engine.progressive_layer_drop` must be a JSON object like {\"enabled\": true, "
                          f"\"theta\": 0.5, \"gamma\": 0.001}}; got {type(section).__name__}")
    raw["engine"] = {**engine, "progressive_layer_drop": {**section, "enabled": enabled}}


def _engine_section(raw: dict[str, Any]) -> dict[str, Any]:
    engine = raw.get("engine", copy.deepcopy(DEFAULT_ENGINE))
    if not isinstance(engine, dict):
        raise ConfigError(f"`engine` must be a JSON object (the DeepSpeed-style config); got {type(engine).__name__}")
    return copy.deepcopy(engine)


def _set_layout(raw: dict[str, Any], tp: int | None, pp: int | None) -> None:
    """``--tp`` / ``--pp``: ``engine.tensor_parallel.tp_size`` and ``engine.pipeline.stages``,
    with pp > 1's adjustments of the ZeRO stage and the micro-batch count (module docstring)."""
    for name, value in (("tp", tp), ("pp", pp)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"--{name} must be an int >= 1; got {value!r}")
    engine = _engine_section(raw)
    for key, value, field in (("tensor_parallel", tp, "tp_size"), ("pipeline", pp, "stages")):
        if value is None:
            continue
        section = engine.get(key, {})
        if not isinstance(section, dict):
            raise ConfigError(f"`engine.{key}` must be a JSON object; got {type(section).__name__}")
        section = {k: v for k, v in section.items() if not (key == "tensor_parallel" and k == "autotp_size")}
        engine[key] = {**section, field: value}
    if pp is not None and pp > 1:
        zero = engine.get("zero_optimization")
        if isinstance(zero, dict) and zero.get("stage") == 2:
            engine["zero_optimization"] = {**zero, "stage": 1}
        gas, micro = engine.get("gradient_accumulation_steps", 1), engine.get("train_micro_batch_size_per_gpu")
        if isinstance(gas, int) and not isinstance(gas, bool) and gas < pp and "train_batch_size" not in engine:
            if isinstance(micro, int) and not isinstance(micro, bool) and (micro * gas) % pp == 0:
                engine["train_micro_batch_size_per_gpu"] = micro * gas // pp  # the same samples per rank and step
            engine["gradient_accumulation_steps"] = pp
    raw["engine"] = engine


def _set_zero(raw: dict[str, Any], stage: int | None, offload: bool | None) -> None:
    """``--zero N`` / ``--offload``: ``engine.zero_optimization.stage`` and its
    ``offload_optimizer`` (``{"device": "cpu", "pin_memory": true}``; ``--no-offload`` removes
    both offload sections), keeping the section's other keys (module docstring)."""
    if stage is not None and (isinstance(stage, bool) or stage not in (0, 1, 2, 3)):
        raise ConfigError(f"--zero must be 0, 1, 2 or 3; got {stage!r}")
    engine = _engine_section(raw)
    zero = engine.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"`engine.zero_optimization` must be a JSON object; got {type(zero).__name__}")
    zero = dict(zero)
    if stage is not None:
        zero["stage"] = stage
    if offload:
        if zero.get("stage", 0) not in (1, 2, 3):
            raise ConfigError(f"--offload moves the optimizer to the CPU at ZeRO stage 1, 2 or 3; the job's stage is "
                              f"{zero.get('stage', 0)} (add --zero 1, 2 or 3)")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    elif offload is False:
        zero.pop("offload_optimizer", None)
        zero.pop("offload_param", None)
    engine["zero_optimization"] = zero
    raw["engine"] = engine

"""A training layout (how a job is split over GPUs) and the checks that refuse impossible ones.

Ranks are laid out as Megatron and torchtitan do: tensor-parallel ranks innermost (consecutive,
inside one node: they exchange activations every layer), then data-parallel, then pipeline stages
outermost. So a tp group crosses nodes only when tp > GPUs per node, a dp group when tp * dp does,
and a pp group when tp * dp * pp does.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from tachyon.plan.activations import CHECKPOINTING
from tachyon.plan.model import ModelSpec, PlanError

DTYPES = ("bf16", "fp16", "fp32", "fp8")
SCHEDULES = ("1f1b", "gpipe")
OPTIMIZERS = {"adam": 8, "adamw": 8, "lamb": 8, "sgd": 4}
"""Optimizer state bytes per trained element (fp32 exp_avg + exp_avg_sq; SGD: momentum)."""
STEP_TENSOR_BYTES = {"adam": 4, "adamw": 4, "lamb": 4, "sgd": 0}
"""Per param group: Adam and LAMB keep a float32 ``step`` tensor (torch.optim.AdamW's layout)."""


@dataclasses.dataclass(frozen=True)
class Precision:
    """Bytes per element of each model state for a training dtype, as tachyon's engine sets them:
    asked from the engine's own precision objects (`tachyon.engine.precision.build_precision`
    over a DeepSpeed-style config), so the plan follows the engine's defaults (which dtype
    gradients accumulate in, whether fp32 masters exist). FP8 trains bf16 weights (FP8 is in the
    GEMMs only). Gradients are communicated in the model dtype (DeepSpeed's default
    ``communication_data_type``)."""

    dtype: str
    param_bytes: int
    grad_accum_bytes: int
    fp32_master: bool

    @property
    def comm_bytes(self) -> int:
        return self.param_bytes

    @classmethod
    def of(cls, dtype: str, grad_accum_dtype: str | None = None) -> Precision:
        return _precision(cls, dtype, grad_accum_dtype)


@functools.lru_cache(maxsize=None)
def _precision(cls: type[Precision], dtype: str, grad_accum_dtype: str | None) -> Precision:
    """One engine lookup per (dtype, accumulation dtype)."""
    if dtype not in DTYPES:
        raise PlanError(f"dtype must be one of {DTYPES}; got {dtype!r}")
    if grad_accum_dtype is not None and grad_accum_dtype not in ("fp32", "bf16", "fp16"):
        raise PlanError(f"grad_accum_dtype must be one of fp32, bf16, fp16; got {grad_accum_dtype!r}")
    from tachyon.config import load_config
    from tachyon.engine.precision import build_precision

    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
    if dtype in ("bf16", "fp8"):
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        config["fp16"] = {"enabled": True}
    if grad_accum_dtype is not None:
        config["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    engine = build_precision(load_config(config, 1))
    return cls(dtype=dtype, param_bytes=engine.model_dtype.itemsize,
               grad_accum_bytes=engine.grad_accum_dtype.itemsize, fp32_master=engine.needs_master_weights)


@dataclasses.dataclass(frozen=True)
class Layout:
    """tp * pp * dp GPUs; ``micro_batch`` sequences per GPU per forward; ``grad_accum``
    micro-batches per optimizer step (the pipeline's micro-batches when pp > 1)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    micro_batch: int = 1
    grad_accum: int = 1
    checkpointing: str = "none"
    dtype: str = "bf16"
    schedule: str = "1f1b"
    offload: bool = False
    """ZeRO-Offload: optimizer states, fp32 masters and gradient accumulator in host memory."""

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    def stage_layers(self, layers: int) -> list[int]:
        """Layers of each pipeline stage: as even as possible, the earlier stages taking the extra."""
        base, extra = divmod(layers, self.pp)
        return [base + (1 if i < extra else 0) for i in range(self.pp)]

    def in_flight(self, stage: int) -> int:
        """Micro-batches whose activations stage ``stage`` holds at once: 1F1B holds at most
        pp - stage (the first stage pp), GPipe all of them."""
        if self.schedule == "gpipe":
            return self.grad_accum
        return min(self.pp - stage, self.grad_accum)

    def to_dict(self) -> dict[str, Any]:
        return dict(dataclasses.asdict(self), gpus=self.gpus, global_batch=self.global_batch)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_layout(spec: ModelSpec | None, layout: Layout, gpus: int, gpus_per_node: int) -> None:
    """Refuse a layout that cannot run, naming the problem and what would be allowed."""
    for key in ("tp", "pp", "dp", "micro_batch", "grad_accum"):
        value = getattr(layout, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{key} must be an integer >= 1; got {value!r}")
    if layout.zero not in (0, 1, 2, 3):
        raise PlanError(f"zero (the ZeRO stage) must be 0, 1, 2 or 3; got {layout.zero!r}")
    if layout.offload and layout.zero == 0:
        raise PlanError("offload (ZeRO-Offload of the optimizer) needs ZeRO stage 1, 2 or 3")
    if layout.dtype not in DTYPES:
        raise PlanError(f"dtype must be one of {DTYPES}; got {layout.dtype!r}")
    if layout.checkpointing not in CHECKPOINTING:
        raise PlanError(f"checkpointing must be one of {CHECKPOINTING}; got {layout.checkpointing!r}")
    if layout.schedule not in SCHEDULES:
        raise PlanError(f"schedule must be one of {SCHEDULES}; got {layout.schedule!r}")
    if layout.tp * layout.pp > gpus or gpus % (layout.tp * layout.pp):
        raise PlanError(f"tp * pp = {layout.tp} * {layout.pp} = {layout.tp * layout.pp} must divide the "
                        f"{gpus} GPUs; divisors of {gpus}: {_divisors(gpus)}")
    if layout.gpus != gpus:
        raise PlanError(f"tp * pp * dp = {layout.gpus} but there are {gpus} GPUs")
    if layout.zero == 3 and layout.pp > 1:
        raise PlanError("ZeRO stage 3 does not combine with pipeline parallelism (the engine refuses it, as "
                        "DeepSpeed does); use zero 0 or 1 with pp > 1")
    if layout.zero == 2 and layout.pp > 1:
        raise PlanError("ZeRO stage 2 does not combine with pipeline parallelism (gradients are reduced "
                        "per micro-batch while the pipeline accumulates them); use zero 0 or 1 with pp > 1")
    if layout.tp > gpus_per_node and layout.tp % gpus_per_node:
        raise PlanError(f"tp = {layout.tp} must be at most the {gpus_per_node} GPUs of a node, or a multiple of it")
    if spec is None:
        return
    if layout.pp > spec.layers:
        raise PlanError(f"pp = {layout.pp} pipeline stages but the model has {spec.layers} layers; "
                        f"pp must be at most {spec.layers}")
    tp = layout.tp
    if spec.heads % tp:
        raise PlanError(f"tp = {tp} must divide the {spec.heads} attention heads; allowed tp: "
                        f"{[d for d in _divisors(spec.heads) if gpus % d == 0]}")
    if spec.num_kv_heads % tp:
        raise PlanError(f"tp = {tp} must divide the {spec.num_kv_heads} key/value heads; allowed tp: "
                        f"{[d for d in _divisors(spec.num_kv_heads) if gpus % d == 0]}")
    if spec.ffn_size % tp:
        raise PlanError(f"tp = {tp} must divide the FFN size {spec.ffn_size}")
    if spec.seq % tp:
        raise PlanError(f"tp = {tp} must divide the sequence length {spec.seq} (sequence parallelism splits it)")
    if layout.dtype == "fp8" and spec.family == "bert":
        raise PlanError("dtype fp8 needs the gpt or llama family (TransformerLayer); the bert family's "
                        "TransformerKernelLayer runs fp16, bf16 or fp32")
    if layout.dtype == "fp8" and (spec.hidden % 16 or spec.ffn_size % (16 * tp) or spec.qkv_width % (16 * tp)):
        raise PlanError(f"dtype fp8 needs every GEMM dimension to be a multiple of 16 (per tp rank): hidden "
                        f"{spec.hidden}, ffn {spec.ffn_size}, QKV {spec.qkv_width}")


__all__ = ["DTYPES", "OPTIMIZERS", "SCHEDULES", "STEP_TENSOR_BYTES", "Layout", "Precision", "check_layout"]

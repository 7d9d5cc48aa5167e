"""Training precisions as small objects the Engine calls (no precision branches in the engine).

Every precision answers the same questions:

- ``model_dtype``: the dtype of the model's parameters and activations;
- ``grad_accum_dtype``: the dtype gradients accumulate in across micro-batches (they are
  reduced in ``communication_data_type``, by default the model dtype, as in DeepSpeed);
- ``needs_master_weights``: whether the optimizer steps fp32 copies of the weights (always
  true below fp32; the ZeRO strategy allocates them, flat and partitioned);
- ``scale_loss(loss)`` before backward; ``checks_nonfinite``: whether a non-finite gradient
  skips the step (`tachyon.engine.nonfinite` decides it from the global gradient norm, the same
  on every rank); ``unscale_(grads, norm)`` divides the fp32 master gradients and their norm by
  the loss scale once the step is known to be finite; ``update(overflow)`` after the step, taken
  or skipped; ``at_min_scale``: whether an overflow now is more than loss-scale calibration;
- ``state_dict()`` / ``load_state_dict()`` for checkpoints.

fp32: no scaling; a non-finite gradient skips the step. bf16: bf16 weights, fp32 masters, bf16
gradient accumulation by default (DeepSpeed's default, ``data_types.grad_accum_dtype`` unset);
bf16 has fp32's exponent range, so no loss scaling; ``bf16.check_grad_overflow`` (on by
default) skips a step whose gradients hold an inf or nan. fp16: fp16 weights, fp32 masters, fp16
gradient accumulation by default, and a static or dynamic loss scale; an inf/nan anywhere skips
the step.

Why bf16 accumulation is the bf16 default: with ZeRO 1/2 an fp32 accumulator is the one model
state that a bf16 one halves (4*Psi/N instead of 2*Psi/N per rank; the optimizer step needs the
fp32 master gradient either way), and measured per rank it put tachyon above DeepSpeed 0.19.8
at stages 0, 1 and 2 (benchmarks/results/2026-11-25-cpu-zero-memory-default-config.md).
``"data_types": {"grad_accum_dtype": "fp32"}`` keeps fp32 accumulation (more accurate with many
micro-batches); at stages 1/2 it then reduces every micro-step, so no full-size fp32 gradient
exists.
"""

from __future__ import annotations

from typing import Any

import torch

from .loss_scaler import DynamicLossScaler, StaticLossScaler

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Precision:
    """fp32 training, and the interface of the others."""

    name = "fp32"
    model_dtype = torch.float32

    def __init__(self, grad_accum_dtype: torch.dtype | None = None):
        self.grad_accum_dtype = grad_accum_dtype or self.default_grad_accum_dtype()

    def default_grad_accum_dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def needs_master_weights(self) -> bool:
        return self.model_dtype != torch.float32

    @property
    def loss_scale(self) -> float:
        return 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: times the loss scale, in fp32 (a large fp16 loss times
        the scale would overflow before backward even starts)."""
        scale = self.loss_scale
        return loss if scale == 1.0 else loss.float() * scale

    checks_nonfinite = True
    """Whether a step whose gradients hold an inf or nan is skipped (`tachyon.engine.nonfinite`)."""

    @property
    def at_min_scale(self) -> bool:
        """Whether the loss scale cannot be lowered any more: an overflow now is a real non-finite
        gradient, not the dynamic scaler's calibration (always true without loss scaling)."""
        return True

    def unscale_(self, grads: list[torch.Tensor], norm: torch.Tensor) -> torch.Tensor:
        """Divide the fp32 master gradients by the loss scale in place; returns ``norm`` (their
        global norm, computed on the scaled gradients) divided likewise."""
        scale = self.loss_scale
        if scale == 1.0:
            return norm
        inv = 1.0 / scale
        for g in grads:
            g.mul_(inv)
        return norm * inv

    def unscale_and_check(self, grads: list[torch.Tensor], comm) -> bool:
        """Divide the fp32 master gradients by the loss scale in place unless one is inf or nan on
        any rank of ``comm`` (a `DataParallelComm`); returns whether one is. (The engine decides
        from the gradient norm instead: `tachyon.engine.nonfinite`.)"""
        if not self.checks_nonfinite:
            return False
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else torch.tensor(True)
        overflow = comm.any_true((~finite).to(torch.float32))
        if not overflow:
            self.unscale_(grads, torch.zeros(()))
        return overflow

    def update(self, overflow: bool) -> None:
        """After a boundary step (taken or skipped)."""
        del overflow

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"checkpoint precision {state.get('name')!r} does not match {self.name!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(grad_accum_dtype={self.grad_accum_dtype})"


class FP32Precision(Precision):
    pass


class BF16Precision(Precision):
    """bf16 weights, fp32 masters; gradients accumulate in bf16 unless told otherwise.
    ``check_grad_overflow`` (DeepSpeed's ``bf16.check_grad_overflow``): skip a step whose
    gradients hold an inf or nan (default on; off lets them reach the weights, as DeepSpeed's
    default does)."""

    name = "bf16"
    model_dtype = torch.bfloat16

    def __init__(self, grad_accum_dtype: torch.dtype | None = None, check_grad_overflow: bool = True):
        super().__init__(grad_accum_dtype)
        self.checks_nonfinite = bool(check_grad_overflow)

    def default_grad_accum_dtype(self) -> torch.dtype:
        return torch.bfloat16


class FP16Precision(Precision):
    """fp16 weights, fp32 masters, loss scaling (`StaticLossScaler` or `DynamicLossScaler`)."""

    name = "fp16"
    model_dtype = torch.float16

    def __init__(self, scaler: StaticLossScaler | DynamicLossScaler, grad_accum_dtype: torch.dtype | None = None):
        super().__init__(grad_accum_dtype)
        self.scaler = scaler

    def default_grad_accum_dtype(self) -> torch.dtype:
        return torch.float16

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def at_min_scale(self) -> bool:
        if not getattr(self.scaler, "dynamic", False):
            return True
        return self.scaler.scale <= getattr(self.scaler, "min_scale", 0.0)

    def update(self, overflow: bool) -> None:
        self.scaler.update(overflow)

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.scaler.load_state_dict(state["scaler"])


def build_precision(config) -> Precision:
    """The precision object for a `tachyon.config.TachyonConfig`."""
    accum = config.data_types.grad_accum_dtype
    accum_dtype = DTYPES[accum] if accum is not None else None
    if config.precision == "fp16":
        fp16 = config.fp16
        if fp16.dynamic_loss_scale:
            scaler = DynamicLossScaler(
                init_scale=2.0**fp16.initial_scale_power,
                window=fp16.loss_scale_window,
                min_scale=fp16.min_loss_scale,
                hysteresis=fp16.hysteresis,
                consecutive_hysteresis=fp16.consecutive_hysteresis,
            )
        else:
            scaler = StaticLossScaler(fp16.loss_scale)
        return FP16Precision(scaler, accum_dtype)
    if config.precision == "bf16":
        return BF16Precision(accum_dtype, check_grad_overflow=config.bf16.check_grad_overflow)
    return FP32Precision(accum_dtype)

"""``deepspeed.ops.adam``: ``FusedAdam`` with DeepSpeed's constructor over `tachyon.engine.optim.FusedAdam`.

The class *is* tachyon's fused Adam (a subclass that only maps DeepSpeed's arguments, and whose
instances include every tachyon FusedAdam: their order
differs, ``set_grad_none`` is accepted -- torch optimizers set gradients to None by default -- and
``amsgrad=True`` is refused). ``DeepSpeedCPUAdam`` is tachyon's CPUAdam (ZeRO-Offload's host
Adam, torch's fused CPU kernel), which the engine builds from a config Adam / AdamW under
``offload_optimizer``; 1-bit Adam and 0/1 Adam come from tachyon's optimizers (config
``"type": "OneBitAdam"`` / ``"ZeroOneAdam"`` is the usual way).
"""

from __future__ import annotations

from typing import Any

import torch
from tachyon.compat._names import Target, module_getattr
from tachyon.engine.optim import CPUAdam as _TachyonCPUAdam
from tachyon.engine.optim import FusedAdam as _TachyonFusedAdam



class _SameClassAs(type):
    """Metaclass: ``isinstance(x, Compat)`` is ``isinstance(x, Compat.tachyon_class)``, so the
    optimizer the engine builds from the config (tachyon's own class) is DeepSpeed's class too."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls.tachyon_class)


class FusedAdam(_TachyonFusedAdam, metaclass=_SameClassAs):
    """DeepSpeed's ``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay,
    amsgrad, set_grad_none)`` as tachyon's FusedAdam (same update, fp32 states). Any tachyon
    FusedAdam is an instance of it (``isinstance(engine.optimizer, FusedAdam)`` after a config
    ``"type": "Adam"``, as in DeepSpeed)."""

    tachyon_class = _TachyonFusedAdam

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        if amsgrad:
            raise NotImplementedError("deepspeed.ops.adam.FusedAdam(amsgrad=True): tachyon's FusedAdam has no "
                                      "AMSGrad (neither has DeepSpeed's); use torch.optim.AdamW(amsgrad=True)")
        del set_grad_none
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=adam_w_mode,
                         bias_correction=bias_correction)


class DeepSpeedCPUAdam(_TachyonCPUAdam, metaclass=_SameClassAs):
    """DeepSpeed's ``DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay,
    amsgrad, adamw_mode, fp32_optimizer_states)`` as tachyon's CPUAdam: the parameters must be on
    the CPU (ZeRO-Offload's masters), the states are fp32. Any tachyon CPUAdam is an instance of
    it (``isinstance(engine.optimizer, DeepSpeedCPUAdam)`` after a config Adam / AdamW with
    ``offload_optimizer``, as in DeepSpeed)."""

    tachyon_class = _TachyonCPUAdam
    optimizer_id = 0

    def __init__(self, model_params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        if amsgrad:
            raise NotImplementedError("deepspeed.ops.adam.DeepSpeedCPUAdam(amsgrad=True): AMSGrad is not supported "
                                      "(nor by DeepSpeed's CPU Adam); use torch.optim.AdamW(amsgrad=True)")
        super().__init__(model_params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         adam_w_mode=adamw_mode, bias_correction=bias_correction)
        if not fp32_optimizer_states and any(p.dtype != torch.float32 for g in self.param_groups for p in g["params"]):
            raise NotImplementedError(
                "deepspeed.ops.adam.DeepSpeedCPUAdam(fp32_optimizer_states=False) with non-fp32 parameters: tachyon "
                "keeps Adam's states in fp32 always; leave fp32_optimizer_states at True")
        self.adam_w_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states
        self.opt_id = DeepSpeedCPUAdam.optimizer_id
        DeepSpeedCPUAdam.optimizer_id += 1


_TABLE = {
    "OnebitAdam": Target((("tachyon.engine.optim", "OneBitAdam"),)),
    "ZeroOneAdam": Target((("tachyon.engine.optim", "ZeroOneAdam"),)),
}
__getattr__ = module_getattr(__name__, "deepspeed.ops.adam", _TABLE, lambda: ["DeepSpeedCPUAdam", "FusedAdam"])
__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

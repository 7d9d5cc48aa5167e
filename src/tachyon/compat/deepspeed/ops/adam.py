"""``deepspeed.ops.adam``: ``FusedAdam`` with DeepSpeed's constructor over `tachyon.engine.optim.FusedAdam`.

The class *is* tachyon's fused Adam (a subclass that only maps DeepSpeed's arguments, and whose
instances include every tachyon FusedAdam: their order
differs, ``set_grad_none`` is accepted -- torch optimizers set gradients to None by default -- and
``amsgrad=True`` is refused). ``DeepSpeedCPUAdam`` (ZeRO-Offload) is not implemented; 1-bit Adam
comes from tachyon's optimizers when they exist (config ``"type": "OneBitAdam"`` is the usual way).
"""

from __future__ import annotations

from typing import Any

from tachyon.compat._names import Target, module_getattr, unsupported
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


_TABLE = {
    "DeepSpeedCPUAdam": unsupported("ZeRO-Offload's CPU Adam is not implemented by tachyon (optimizer states "
                                    "stay on the GPU, sharded by ZeRO stages 1-2); use FusedAdam"),
    "OnebitAdam": Target((("tachyon.engine.optim", "OneBitAdam"),)),
    "ZeroOneAdam": unsupported("0/1 Adam is not implemented by tachyon; use FusedAdam"),
}
__getattr__ = module_getattr(__name__, "deepspeed.ops.adam", _TABLE, lambda: ["FusedAdam"])
__all__ = ["FusedAdam"]

"""``deepspeed.ops.lamb``: ``FusedLamb`` with DeepSpeed's constructor over `tachyon.engine.optim.Lamb`.

A subclass that only maps DeepSpeed's arguments (tachyon's Lamb implements FusedLamb's update).
``eps_inside_sqrt=True``, ``amsgrad=True`` and a nonzero ``max_grad_norm`` are refused (clip with
the config's ``gradient_clipping``). 1-bit LAMB comes from tachyon's optimizers when they exist.
"""

from __future__ import annotations

from typing import Any

from tachyon.compat._names import Target, module_getattr
from tachyon.compat.deepspeed.ops.adam import _SameClassAs
from tachyon.engine.optim import Lamb as _TachyonLamb


class FusedLamb(_TachyonLamb, metaclass=_SameClassAs):
    """DeepSpeed's ``FusedLamb(params, lr, bias_correction, betas, eps, eps_inside_sqrt, weight_decay,
    max_grad_norm, max_coeff, min_coeff, amsgrad)`` as tachyon's Lamb; every tachyon Lamb is an
    instance of it."""

    tachyon_class = _TachyonLamb

    def __init__(self, params: Any, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False):
        for name, value, instead in (("eps_inside_sqrt", eps_inside_sqrt, "eps is added outside the square root"),
                                     ("amsgrad", amsgrad, "LAMB has no AMSGrad variant")):
            if value:
                raise NotImplementedError(f"deepspeed.ops.lamb.FusedLamb({name}=True) is not supported: {instead}")
        if max_grad_norm:
            raise NotImplementedError("deepspeed.ops.lamb.FusedLamb(max_grad_norm=...) is not supported: clip with "
                                      "the config's \"gradient_clipping\"")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_coeff=max_coeff,
                         min_coeff=min_coeff, bias_correction=bias_correction)


_TABLE = {
    "OnebitLamb": Target((("tachyon.engine.optim", "OneBitLamb"), ("tachyon.engine.optim", "OnebitLamb")),
                         "1-bit LAMB is not in this version of tachyon; use FusedLamb (or the config's "
                         "\"optimizer\": {\"type\": \"Lamb\"})"),
}
__getattr__ = module_getattr(__name__, "deepspeed.ops.lamb", _TABLE, lambda: ["FusedLamb"])
__all__ = ["FusedLamb"]

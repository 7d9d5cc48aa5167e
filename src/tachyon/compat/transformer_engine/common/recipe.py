"""``transformer_engine.common.recipe``: ``Format`` and ``DelayedScaling`` are `tachyon.fp8`'s.

tachyon implements delayed scaling (per-tensor scales from an amax history) with the E4M3 and
HYBRID formats; Transformer Engine's newer recipes (current scaling, MXFP8 and block scaling,
NVFP4) are not implemented and raise NotImplementedError naming DelayedScaling.
"""

from __future__ import annotations

from tachyon.compat._names import Target, module_getattr, unsupported

_DELAYED_ONLY = "tachyon implements delayed scaling only; use DelayedScaling(fp8_format=Format.HYBRID)"
_TABLE = {
    "Format": Target((("tachyon.fp8.recipe", "Format"),)),
    "DelayedScaling": Target((("tachyon.fp8.recipe", "DelayedScaling"),)),
    "Float8CurrentScaling": unsupported(_DELAYED_ONLY),
    "MXFP8BlockScaling": unsupported(_DELAYED_ONLY),
    "Float8BlockScaling": unsupported(_DELAYED_ONLY),
    "NVFP4BlockScaling": unsupported(_DELAYED_ONLY),
}
__getattr__ = module_getattr(__name__, "transformer_engine.common.recipe", _TABLE)
__all__ = [*_TABLE]

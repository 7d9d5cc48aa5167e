"""``transformer_engine.common.recipe``: the FP8 recipes are `tachyon.fp8`'s.

``Format``, ``DelayedScaling``, ``Float8CurrentScaling``, ``Float8BlockScaling``,
``MXFP8BlockScaling`` (Transformer Engine 2.x's fields and defaults; MXFP8 runs only on compute
capability 10.x), ``QParams``, ``MMParams`` and ``Recipe``. NVFP4 and custom recipes are not
implemented and raise NotImplementedError naming the recipes that are.
"""

from __future__ import annotations

from tachyon.compat._names import Target, module_getattr, unsupported

_FP8_RECIPES = ("use DelayedScaling, Float8CurrentScaling, Float8BlockScaling or MXFP8BlockScaling (FP8)")
_TABLE = {name: Target((("tachyon.fp8.recipe", name),))
          for name in ("Format", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling",
                       "QParams", "MMParams", "Recipe")}
_TABLE.update({
    "NVFP4BlockScaling": unsupported("NVFP4 (4-bit) training is not implemented by tachyon; " + _FP8_RECIPES),
    "CustomRecipe": unsupported("custom quantizer recipes are not implemented by tachyon; " + _FP8_RECIPES),
})
__getattr__ = module_getattr(__name__, "transformer_engine.common.recipe", _TABLE)
__all__ = [*_TABLE]

"""``transformer_engine.pytorch.attention``: DotProductAttention, MultiheadAttention,
RotaryPositionEmbedding from `tachyon.nn`."""

from __future__ import annotations

from tachyon.compat._names import Target, module_getattr

_TABLE = {name: Target((("tachyon.nn", name),))
          for name in ("DotProductAttention", "MultiheadAttention", "RotaryPositionEmbedding")}
__getattr__ = module_getattr(__name__, "transformer_engine.pytorch.attention", _TABLE)
__all__ = [*_TABLE]

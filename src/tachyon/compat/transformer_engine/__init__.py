"""``transformer_engine`` on tachyon: ``.pytorch`` (the modules, fp8_autocast, checkpoint) and
``.common.recipe`` (Format, DelayedScaling).

    import tachyon.compat.transformer_engine.pytorch as te
    from tachyon.compat.transformer_engine.common.recipe import Format, DelayedScaling
"""

from __future__ import annotations

import importlib

_SUBMODULES = ("common", "pytorch")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"transformer_engine.{name} is not mapped by tachyon; it maps: {', '.join(_SUBMODULES)}")


__all__ = list(_SUBMODULES)

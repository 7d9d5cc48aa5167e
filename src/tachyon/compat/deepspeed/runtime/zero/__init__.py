"""``deepspeed.runtime.zero``: the ZeRO config section class (``runtime.zero.config``). ZeRO itself
is tachyon's (`tachyon.engine.zero`); the ``deepspeed.zero`` helpers are ``tachyon.compat.deepspeed.zero``."""

from __future__ import annotations

import importlib

_SUBMODULES = ("config",)


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"deepspeed.runtime.zero has no {name!r} in tachyon's compat layer (it maps: "
                         f"{', '.join(_SUBMODULES)}); ZeRO is tachyon.engine.zero")


__all__ = list(_SUBMODULES)

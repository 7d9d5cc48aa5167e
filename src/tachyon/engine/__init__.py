"""The training engine: initialize(), the Engine, precision, ZeRO, optimizers, schedules.

``initialize`` and ``Engine`` load on first use, so importing a submodule
(``tachyon.engine.optim``, ``tachyon.engine.lr_schedules``, ...) stays cheap.
"""

from __future__ import annotations

import importlib

# initialize() lives in engine/start.py: a submodule named "initialize" would replace the
# function as this package's attribute once anything imported the module by its path.
_LAZY = {"initialize": "tachyon.engine.start", "Engine": "tachyon.engine.engine"}

__all__ = ["Engine", "initialize"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tachyon.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

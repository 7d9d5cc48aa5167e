"""``deepspeed.runtime.fp16``: DeepSpeed's fp16 / bf16 optimizer wrappers, which tachyon does not
have: the engine keeps precision (loss scaling, fp32 masters) outside the optimizer, and
``engine.optimizer`` is the torch optimizer itself (docs/compat.md). The names import; any use,
``isinstance`` included, raises NotImplementedError saying so."""

from __future__ import annotations

import importlib

from tachyon.compat._names import module_getattr

_SUBMODULES = ("fused_optimizer", "onebit", "unfused_optimizer")
_lookup = module_getattr(__name__, "deepspeed.runtime.fp16", {}, lambda: list(_SUBMODULES))


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    return _lookup(name)


__all__ = list(_SUBMODULES)

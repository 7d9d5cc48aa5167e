"""``deepspeed.runtime``: the parts of DeepSpeed's runtime package scripts import directly
(``runtime.activation_checkpointing.checkpointing``, ``runtime.utils``, ...)."""

from __future__ import annotations

import importlib

from tachyon.compat._names import module_getattr

_SUBMODULES = ("activation_checkpointing", "comm", "config", "config_utils", "fp16", "lr_schedules", "pipe", "precision_config",
               "progressive_layer_drop", "utils", "zero")
_lookup = module_getattr(__name__, "deepspeed.runtime", {}, lambda: list(_SUBMODULES))


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    return _lookup(name)


__all__ = list(_SUBMODULES)

"""``deepspeed.runtime``: the parts of DeepSpeed's runtime package scripts import directly
(``runtime.activation_checkpointing.checkpointing``, ``runtime.utils``, ...)."""

from __future__ import annotations

from tachyon.compat._names import module_getattr

_SUBMODULES = ("activation_checkpointing", "comm", "config", "config_utils", "fp16", "lr_schedules", "pipe", "precision_config",
               "progressive_layer_drop", "utils", "zero")
__getattr__ = module_getattr(__name__, "deepspeed.runtime", {}, submodules=_SUBMODULES)


__all__ = list(_SUBMODULES)

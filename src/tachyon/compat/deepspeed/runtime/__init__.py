"""``deepspeed.runtime``: the parts of DeepSpeed's runtime package scripts import directly
(``runtime.activation_checkpointing.checkpointing``)."""

from __future__ import annotations

import importlib

from tachyon.compat._names import module_getattr

_lookup = module_getattr(__name__, "deepspeed.runtime", {}, lambda: ["activation_checkpointing"])


def __getattr__(name: str):
    if name == "activation_checkpointing":
        return importlib.import_module(f"{__name__}.activation_checkpointing")
    return _lookup(name)


__all__ = ["activation_checkpointing"]

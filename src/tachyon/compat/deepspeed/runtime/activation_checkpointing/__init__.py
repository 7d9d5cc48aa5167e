"""``deepspeed.runtime.activation_checkpointing``: holds ``checkpointing`` (tachyon.checkpointing)."""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    if name == "checkpointing":
        return importlib.import_module(f"{__name__}.checkpointing")
    raise AttributeError(f"deepspeed.runtime.activation_checkpointing.{name} is not mapped by tachyon; "
                         "it maps: checkpointing")


__all__ = ["checkpointing"]

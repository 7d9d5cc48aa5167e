"""``transformer_engine.common``: ``recipe`` (FP8 recipes)."""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    if name == "recipe":
        return importlib.import_module(f"{__name__}.recipe")
    raise AttributeError(f"transformer_engine.common.{name} is not mapped by tachyon; it maps: recipe")


__all__ = ["recipe"]

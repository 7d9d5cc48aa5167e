"""``deepspeed.profiling``: the flops profiler (``profiling.flops_profiler``) from tachyon.profiling."""

from __future__ import annotations

import importlib

from tachyon.compat._names import module_getattr

_lookup = module_getattr(__name__, "deepspeed.profiling", {}, lambda: ["flops_profiler"])


def __getattr__(name: str):
    if name == "flops_profiler":
        return importlib.import_module(f"{__name__}.flops_profiler")
    return _lookup(name)


__all__ = ["flops_profiler"]

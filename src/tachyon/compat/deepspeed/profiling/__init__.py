"""``deepspeed.profiling``: the flops profiler (``profiling.flops_profiler``) from tachyon.profiling."""

from __future__ import annotations

from tachyon.compat._names import module_getattr

__getattr__ = module_getattr(__name__, "deepspeed.profiling", {}, submodules=("flops_profiler",))


__all__ = ["flops_profiler"]

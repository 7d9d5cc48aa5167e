"""``deepspeed.profiling.flops_profiler``: ``FlopsProfiler`` and ``get_model_profile`` from tachyon.profiling.

Resolved from `tachyon.profiling.flops` each time, so they work as soon as tachyon's flops
profiler is there; until then using them raises NotImplementedError.
"""

from __future__ import annotations

from tachyon.compat._names import Target, module_getattr

_MISSING = ("the flops profiler is not in this version of tachyon (it will be tachyon.profiling.FlopsProfiler); "
            "count FLOPs with torch.utils.flop_counter.FlopCounterMode meanwhile")
_TABLE = {name: Target((("tachyon.profiling.flops", name), ("tachyon.profiling", name)), _MISSING)
          for name in ("FlopsProfiler", "get_model_profile")}
__getattr__ = module_getattr(__name__, "deepspeed.profiling.flops_profiler", _TABLE)
__all__ = [*_TABLE]

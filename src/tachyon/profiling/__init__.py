"""Counting what a model costs: FLOPs and latency per module (`flops`, DeepSpeed's flops profiler)
and bytes moved and kernel launches per op and module (`traffic`).

Names load lazily, so ``import tachyon.profiling`` stays cheap.
"""

from __future__ import annotations

import importlib

# public name -> module that defines it
_LAZY = {
    "FlopsProfiler": "tachyon.profiling.flops",
    "get_model_profile": "tachyon.profiling.flops",
    "TrafficCounter": "tachyon.profiling.traffic",
    "count_traffic": "tachyon.profiling.traffic",
    "bert_layer_minimum": "tachyon.profiling.traffic_minimum",
    "transformer_layer_minimum": "tachyon.profiling.traffic_minimum",
    "adam_minimum": "tachyon.profiling.traffic_minimum",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'tachyon.profiling' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value

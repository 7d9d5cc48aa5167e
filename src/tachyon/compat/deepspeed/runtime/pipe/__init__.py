"""``deepspeed.runtime.pipe``: ``topology`` (DeepSpeed's process topologies), ``schedule``
(DeepSpeed's instruction-list schedules), ``module`` and the pipeline module names (``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``), as ``deepspeed.pipe``."""

from __future__ import annotations

import importlib

from tachyon.compat._names import Target, module_getattr

_TABLE = {name: Target((("tachyon.compat.deepspeed.pipe", name),))
          for name in ("PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology")}
_SUBMODULES = ("module", "schedule", "topology")
_lookup = module_getattr(__name__, "deepspeed.runtime.pipe", _TABLE, lambda: list(_SUBMODULES))


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    return _lookup(name)


__all__ = [*_SUBMODULES, *_TABLE]

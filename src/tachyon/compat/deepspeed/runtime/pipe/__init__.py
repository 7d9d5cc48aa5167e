"""``deepspeed.runtime.pipe``: ``topology`` (DeepSpeed's process topologies), ``schedule``
(DeepSpeed's instruction-list schedules), ``module`` and the pipeline module names (``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``), as ``deepspeed.pipe``."""

from __future__ import annotations

from tachyon.compat._names import Target, module_getattr

_TABLE = {name: Target((("tachyon.compat.deepspeed.pipe", name),))
          for name in ("PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology")}
_SUBMODULES = ("module", "schedule", "topology")
__getattr__ = module_getattr(__name__, "deepspeed.runtime.pipe", _TABLE, submodules=_SUBMODULES)


__all__ = [*_SUBMODULES, *_TABLE]

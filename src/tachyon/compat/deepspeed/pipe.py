"""``deepspeed.pipe``: pipeline-parallel model description, from tachyon.parallel.pipeline when it exists."""

from __future__ import annotations

from tachyon.compat._names import module_getattr
from tachyon.compat.deepspeed import pipeline_target

_TABLE = {name: pipeline_target(name) for name in
          ("PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology", "PipeDataParallelTopology",
           "PipeModelDataParallelTopology")}
__getattr__ = module_getattr(__name__, "deepspeed.pipe", _TABLE)
__all__ = [*_TABLE]

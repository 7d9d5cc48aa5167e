"""``deepspeed.runtime.pipe.module``: ``PipelineModule`` (DeepSpeed's optional ``loss_fn`` and
ProcessTopology ``topology``), ``LayerSpec`` and ``TiedLayerSpec``, as ``deepspeed.pipe``."""

from tachyon.compat.deepspeed.pipe import PipelineModule  # noqa: F401
from tachyon.parallel.pipeline import LayerSpec, TiedLayerSpec  # noqa: F401

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]

"""``deepspeed.pipe``: pipeline-parallel model description on `tachyon.parallel.pipeline`.

``LayerSpec`` / ``TiedLayerSpec`` are tachyon's. ``PipelineModule`` is tachyon's with
DeepSpeed's two conveniences: ``loss_fn`` may be left out (the last layer's output is then the
loss, as in DeepSpeed: ``train_batch`` averages it), and ``topology=`` may be a DeepSpeed
`ProcessTopology` (`tachyon.compat.deepspeed.topology`), turned into the tachyon Mesh of the same
rank layout. The topologies are `tachyon.compat.deepspeed.topology`'s.
"""

from __future__ import annotations

from typing import Any

from tachyon.compat._names import Target, module_getattr
from tachyon.compat.deepspeed.topology import (  # noqa: F401 (re-exported)
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    topology_to_mesh,
)
from tachyon.parallel.pipeline import PipelineModule as _TachyonPipelineModule


def output_is_loss(outputs: Any, labels: Any = None) -> Any:
    """DeepSpeed's behaviour without a ``loss_fn``: the last layer's output is the loss."""
    del labels
    return outputs


class PipelineModule(_TachyonPipelineModule):
    """`tachyon.parallel.pipeline.PipelineModule` with DeepSpeed's optional ``loss_fn`` and
    ProcessTopology ``topology`` (see the module docstring)."""

    def __init__(self, layers: Any, num_stages: int | None = None, topology: Any = None, loss_fn: Any = None,
                 *args: Any, **kwargs: Any):
        if isinstance(topology, ProcessTopology):
            topology = topology_to_mesh(topology)
        super().__init__(layers, num_stages, topology, output_is_loss if loss_fn is None else loss_fn, *args, **kwargs)


_TABLE = {name: Target((("tachyon.parallel.pipeline", name),)) for name in ("LayerSpec", "TiedLayerSpec")}
_OWN = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineModule", "ProcessTopology"]
__getattr__ = module_getattr(__name__, "deepspeed.pipe", _TABLE, lambda: _OWN)
__all__ = [*_OWN, *_TABLE]

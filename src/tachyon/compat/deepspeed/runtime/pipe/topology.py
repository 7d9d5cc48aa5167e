"""``deepspeed.runtime.pipe.topology``: `tachyon.compat.deepspeed.topology`'s process topologies
and ``PipelineParallelGrid``."""

from tachyon.compat.deepspeed.topology import (  # noqa: F401
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
    _prime_factors,
)

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid", "ProcessTopology"]

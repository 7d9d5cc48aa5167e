"""``deepspeed.runtime.pipe.topology``: `tachyon.compat.deepspeed.topology`'s process topologies."""

from tachyon.compat.deepspeed.topology import (  # noqa: F401
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology"]

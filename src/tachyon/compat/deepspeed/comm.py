"""``deepspeed.comm``: DeepSpeed's communication module, on torch.distributed.

Start-up and groups are tachyon's (`tachyon.parallel.distributed`: ``init_distributed`` reads
torchrun, OpenMPI and SLURM environments; ``new_group`` passes the stored timeout; ``get_rank`` /
``get_world_size`` / ``get_local_rank`` answer 0 / 1 / 0 before any process group exists); the
collectives are torch.distributed's own functions, which DeepSpeed's wrap with the same
arguments.
"""

from __future__ import annotations

from tachyon.compat._names import Target, module_getattr

_TACHYON = ("init_distributed", "new_group", "get_rank", "get_world_size", "get_local_rank")
_TORCH = (
    "is_initialized", "is_available", "get_backend", "barrier", "monitored_barrier", "all_reduce", "reduce",
    "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "gather", "scatter",
    "get_global_rank", "destroy_process_group", "ReduceOp",
)
_TABLE = {name: Target((("tachyon.parallel.distributed", name),)) for name in _TACHYON}
_TABLE.update({name: Target((("torch.distributed", name),)) for name in _TORCH})
__getattr__ = module_getattr(__name__, "deepspeed.comm", _TABLE)
__all__ = [*_TABLE]

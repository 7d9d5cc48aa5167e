"""``deepspeed.comm``: DeepSpeed's communication module, on torch.distributed.

Start-up and groups are tachyon's (`tachyon.parallel.distributed`: ``get_rank`` /
``get_world_size`` / ``get_local_rank`` answer 0 / 1 / 0 before any process group exists;
``new_group`` passes the stored timeout); ``init_distributed`` takes DeepSpeed's arguments
(`init_distributed` below). The collectives are torch.distributed's own functions, which
DeepSpeed's wrap with the same arguments, plus DeepSpeed's few extras: ``inference_all_reduce``
(an all-reduce), ``all_reduce_coalesced``, ``allgather_fn`` / ``reduce_scatter_fn``,
``get_world_group``, ``get_all_ranks_from_group`` and the ``has_*`` capability probes. The
communication logger (``configure``, ``log_summary``) is not provided: ``configure`` with
``comms_logger`` enabled raises, ``log_summary`` prints nothing.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch.distributed as dist

from tachyon.compat._names import Target, module_getattr

DEFAULT_PORT = 29500


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = DEFAULT_PORT, verbose: bool = True,
                     timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """DeepSpeed's ``init_distributed`` (its argument order) on `tachyon.init_distributed`.

    ``dist_init_required=False`` starts nothing: it requires the process group the script made
    and, as DeepSpeed, raises when there is none; ``distributed_port`` becomes MASTER_PORT when the environment has none (DeepSpeed uses
    it when it discovers an MPI launch); ``config`` only configures DeepSpeed's communication
    logger and is ignored unless that logger is enabled (refused: not provided)."""
    from tachyon.parallel.distributed import DEFAULT_TIMEOUT
    from tachyon.parallel.distributed import init_distributed as tachyon_init

    _refuse_comms_logger(config)
    if dist_init_required is False:
        if not dist.is_initialized():
            raise RuntimeError("init_distributed(dist_init_required=False) uses the process group the script started, "
                               "and torch.distributed is not initialized; call torch.distributed.init_process_group "
                               "first, or pass dist_init_required=None (or True) to start one here")
        return
    if distributed_port != DEFAULT_PORT and "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(distributed_port)
    tachyon_init(dist_backend=dist_backend, init_method=init_method, timeout=timeout or DEFAULT_TIMEOUT, rank=rank,
                 world_size=world_size, auto_mpi_discovery=auto_mpi_discovery, verbose=verbose)


def _refuse_comms_logger(config: Any) -> None:
    logger = config.get("comms_logger") if isinstance(config, dict) else None
    if isinstance(logger, dict) and logger.get("enabled"):
        raise NotImplementedError("deepspeed.comm: the communication logger (comms_logger) is not provided by tachyon; "
                                  "use torch.profiler to see the collectives")


def configure(deepspeed_config: Any = None, enabled: bool | None = None, **kwargs: Any) -> None:
    """DeepSpeed's comms-logger setup: nothing to do unless it is enabled, which is refused."""
    if enabled:
        raise NotImplementedError("deepspeed.comm.configure(enabled=True): the communication logger is not provided "
                                  "by tachyon; use torch.profiler")
    _refuse_comms_logger(getattr(deepspeed_config, "_param_dict", deepspeed_config))


def log_summary(*args: Any, **kwargs: Any) -> None:
    """The comms logger's summary: tachyon keeps no log, so there is nothing to print."""


def inference_all_reduce(tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None) -> Any:
    """DeepSpeed's all-reduce for inference (a faster kernel there): torch's all_reduce here."""
    return dist.all_reduce(tensor, op=op, group=group)


def all_reduce_coalesced(tensors: list, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    """All-reduce each tensor of ``tensors`` (in order)."""
    works = [dist.all_reduce(t, op=op, group=group, async_op=async_op) for t in tensors]
    return works if async_op else None


def allgather_fn(output_tensor: Any, input_tensor: Any, group: Any = None, async_op: bool = False,
                 debug: Any = None) -> Any:
    return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: Any, tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None,
                      async_op: bool = False, prof: bool = False, debug: Any = None) -> Any:
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def get_world_group() -> Any:
    return dist.group.WORLD


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    return True


def has_coalescing_manager() -> bool:
    return False


_TACHYON = ("new_group", "get_rank", "get_world_size", "get_local_rank")
_TORCH = (
    "is_initialized", "is_available", "get_backend", "barrier", "monitored_barrier", "all_reduce", "reduce",
    "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "gather", "scatter",
    "get_global_rank", "destroy_process_group", "ReduceOp", "all_gather_object", "broadcast_object_list",
)
_OWN = ["all_reduce_coalesced", "allgather_fn", "configure", "get_all_ranks_from_group", "get_world_group",
        "has_all_gather_into_tensor", "has_all_reduce_coalesced", "has_coalescing_manager",
        "has_reduce_scatter_tensor", "inference_all_reduce", "init_distributed", "log_summary", "reduce_scatter_fn"]
_TABLE = {name: Target((("tachyon.parallel.distributed", name),)) for name in _TACHYON}
_TABLE.update({name: Target((("torch.distributed", name),)) for name in _TORCH})
__getattr__ = module_getattr(__name__, "deepspeed.comm", _TABLE, lambda: _OWN)
__all__ = [*_OWN, *_TABLE]

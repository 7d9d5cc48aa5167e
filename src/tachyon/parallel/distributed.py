"""Starting torch.distributed: one call that works under torchrun, SLURM, OpenMPI or plain python.

    import tachyon
    tachyon.init_distributed()           # nccl on GPUs, gloo on CPU
    tachyon.parallel.distributed.get_rank(), get_world_size(), get_local_rank()

Where the ranks come from, first match wins:

1. torchrun (``torch.distributed.run``, also what ``tachyon launch`` runs): RANK, WORLD_SIZE,
   LOCAL_RANK, MASTER_ADDR, MASTER_PORT are already set.
2. OpenMPI (``mpirun``): OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK. MASTER_ADDR is taken from the
   environment, else from SLURM_NODELIST when inside a SLURM job, else 127.0.0.1 when all ranks
   are on this node (OMPI_COMM_WORLD_LOCAL_SIZE == OMPI_COMM_WORLD_SIZE); across nodes without
   either, set MASTER_ADDR yourself. OpenMPI comes before SLURM because ``mpirun`` inside an
   ``sbatch`` script inherits the batch step's SLURM_PROCID (0 on every rank).
3. SLURM (``srun``): SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; MASTER_ADDR = first host of
   SLURM_JOB_NODELIST (or SLURM_NODELIST), expanded here from SLURM's compressed form
   ("node[01-04,07],gpu3") without calling scontrol.
4. Nothing: a single process (rank 0 of 1) on 127.0.0.1.

MASTER_PORT defaults to 29500 when a launcher does not set it. Steps 2-3 only run with
``auto_mpi_discovery=True`` (DeepSpeed's flag name). `discover_environment` is the pure part
(environment mapping in, `DistEnv` out), so every flavour is tested without starting anything.

Timeouts: the ``timeout`` given to `init_distributed` is the process group's timeout (a collective
waiting on a stuck peer raises after it instead of hanging forever). It is stored and every group
tachyon creates goes through `new_group`, which passes it on.

Teardown: `shutdown_distributed` waits until every rank has reached it (a barrier), then destroys
every group `new_group` made (newest first) and the default group. `init_distributed` registers it
to run at interpreter exit, so a script that simply returns tears down cleanly: a process group
left to the interpreter's own finalization can abort the process after its work is done (torch
2.13 with gloo: "terminate called without an active exception" in about one exit in three). After
an uncaught exception the exit handler skips the barrier, so a failing rank exits at once with
its own error. Processes started by ``multiprocessing`` skip atexit handlers: call
`shutdown_distributed` yourself there.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
DEFAULT_MASTER_PORT = 29500
ALLOWED_BACKENDS = ("nccl", "gloo", "mpi", "xccl", "cpu:gloo,cuda:nccl")

_timeout: datetime.timedelta = DEFAULT_TIMEOUT
_groups: list[Any] = []  # every group new_group made and nobody destroyed yet, oldest first
_exit_handler_registered = False
_SETTLE_S = 0.05  # see shutdown_distributed

Source = Literal["torchrun", "mpi", "slurm", "single"]


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as found in the environment.

    ``master_port`` is None when nothing set it and the job is a single process (then any free
    port works); ``source`` names the launcher the values came from.
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int | None
    source: Source

    def as_environ(self) -> dict[str, str]:
        """The environment variables torch's ``env://`` rendezvous reads (MASTER_PORT only when known)."""
        out = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_ADDR": self.master_addr,
        }
        if self.master_port is not None:
            out["MASTER_PORT"] = str(self.master_port)
        return out


# --------------------------------------------------------------------------- SLURM node lists


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: "a[1,2],b" -> ["a[1,2]", "b"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"SLURM nodelist {text!r}: nested brackets are not valid")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"SLURM nodelist {text!r}: ']' without a matching '['")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"SLURM nodelist {text!r}: '[' without a matching ']'")
    parts.append(text[start:])
    return parts


def _expand_range_list(spec: str, nodelist: str) -> list[str]:
    """"01-03,07" -> ["01", "02", "03", "07"]; zero padding follows the lower bound's width."""
    out = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if match is None:
            raise ValueError(
                f"SLURM nodelist {nodelist!r}: bad range {item!r} in [{spec}] (allowed: N or N-M, comma separated)"
            )
        lo_text, hi_text = match.group(1), match.group(2)
        if hi_text is None:
            out.append(lo_text)
            continue
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise ValueError(f"SLURM nodelist {nodelist!r}: range {item!r} goes backwards")
        width = len(lo_text)
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list, in order.

    "node[01-04,07],gpu3" -> node01 node02 node03 node04 node07 gpu3; several bracket groups in
    one name expand as a product ("r[1-2]-n[1-2]" -> r1-n1 r1-n2 r2-n1 r2-n2). ValueError on
    malformed input.
    """
    text = nodelist.strip()
    if not text:
        raise ValueError("SLURM nodelist is empty")
    hosts: list[str] = []
    for part in _split_top_level(text):
        part = part.strip()
        if not part:
            raise ValueError(f"SLURM nodelist {nodelist!r}: empty host name between commas")
        names, pos = [""], 0
        for group in re.finditer(r"\[([^\]]*)\]", part):
            literal = part[pos : group.start()]
            values = _expand_range_list(group.group(1), nodelist)
            names = [name + literal + value for name in names for value in values]
            pos = group.end()
        names = [name + part[pos:] for name in names]
        hosts.extend(names)
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a SLURM nodelist, without expanding the whole list."""
    first = _split_top_level(nodelist.strip())[0]
    return expand_nodelist(first)[0]


# --------------------------------------------------------------------------- discovery


def _int_var(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} should be an integer") from None


def _port(env: Mapping[str, str], default: int | None) -> int | None:
    if "MASTER_PORT" not in env:
        return default
    port = _int_var(env, "MASTER_PORT")
    if not 1 <= port <= 65535:
        raise ValueError(f"environment variable MASTER_PORT={port} should be between 1 and 65535")
    return port


def _slurm_nodelist(env: Mapping[str, str]) -> str | None:
    return env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")


def discover_environment(env: Mapping[str, str], auto_mpi_discovery: bool = True) -> DistEnv:
    """Read rank, world size, local rank and the rendezvous address from ``env`` (pure).

    See the module docstring for the order (torchrun, OpenMPI, SLURM, single process).
    Raises ValueError for malformed or inconsistent values.
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        found = DistEnv(
            rank=_int_var(env, "RANK"),
            world_size=_int_var(env, "WORLD_SIZE"),
            local_rank=_int_var(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_port(env, DEFAULT_MASTER_PORT),
            source="torchrun",
        )
    elif auto_mpi_discovery and "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        world_size = _int_var(env, "OMPI_COMM_WORLD_SIZE")
        local_size = _int_var(env, "OMPI_COMM_WORLD_LOCAL_SIZE") if "OMPI_COMM_WORLD_LOCAL_SIZE" in env else None
        nodelist = _slurm_nodelist(env)
        if "MASTER_ADDR" in env:
            addr = env["MASTER_ADDR"]
        elif nodelist:
            addr = first_host(nodelist)
        elif local_size == world_size or world_size == 1:
            addr = "127.0.0.1"
        else:
            raise ValueError(
                "OpenMPI job across several nodes: set MASTER_ADDR to rank 0's host (e.g. `mpirun -x "
                "MASTER_ADDR=$(hostname) ...`); tachyon does not use mpi4py to find it"
            )
        found = DistEnv(
            rank=_int_var(env, "OMPI_COMM_WORLD_RANK"),
            world_size=world_size,
            local_rank=_int_var(env, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in env else 0,
            master_addr=addr,
            master_port=_port(env, DEFAULT_MASTER_PORT),
            source="mpi",
        )
    elif auto_mpi_discovery and "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = _slurm_nodelist(env)
        if "MASTER_ADDR" in env:
            addr = env["MASTER_ADDR"]
        elif nodelist:
            addr = first_host(nodelist)
        else:
            raise ValueError("SLURM job without SLURM_JOB_NODELIST/SLURM_NODELIST: set MASTER_ADDR")
        found = DistEnv(
            rank=_int_var(env, "SLURM_PROCID"),
            world_size=_int_var(env, "SLURM_NTASKS"),
            local_rank=_int_var(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            master_addr=addr,
            master_port=_port(env, DEFAULT_MASTER_PORT),
            source="slurm",
        )
    else:
        found = DistEnv(0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"), _port(env, None), "single")
    _check_ranks(found.rank, found.world_size, found.local_rank, found.source)
    return found


def _check_ranks(rank: int, world_size: int, local_rank: int, source: str) -> None:
    if world_size < 1:
        raise ValueError(f"world size from {source} must be >= 1; got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank from {source} must be in [0, {world_size}); got {rank}")
    if local_rank < 0:
        raise ValueError(f"local rank from {source} must be >= 0; got {local_rank}")


# --------------------------------------------------------------------------- init


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    dist_backend: str | None = None,
    init_method: str | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    rank: int = -1,
    world_size: int = -1,
    auto_mpi_discovery: bool = True,
    verbose: bool = True,
) -> None:
    """Initialize torch.distributed's default process group (DeepSpeed's signature).

    Args:
        dist_backend: "nccl", "gloo", "mpi", "xccl" or "cpu:gloo,cuda:nccl"; None picks nccl when
            CUDA is available, else gloo.
        init_method: a torch init URL ("tcp://host:port", "file://..."); None means ``env://``
            with the variables found by `discover_environment` (and written to os.environ).
        timeout: the process group's timeout for collectives; stored for `get_timeout` and
            `new_group` (also when the group already exists).
        rank, world_size: override the discovered values when both are >= 0.
        auto_mpi_discovery: also read OpenMPI and SLURM variables when torchrun's are absent.
        verbose: log what was found at INFO.

    Idempotent: when the default group already exists this only records ``timeout``. On CUDA it
    sets the current device to LOCAL_RANK (modulo the device count).
    """
    global _timeout
    if not isinstance(timeout, datetime.timedelta):
        raise ValueError(f"timeout must be a datetime.timedelta; got {type(timeout).__name__}")
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive; got {timeout}")
    backend = dist_backend if dist_backend is not None else _default_backend()
    if backend not in ALLOWED_BACKENDS:
        raise ValueError(f"dist_backend must be one of {list(ALLOWED_BACKENDS)} or None (auto); got {backend!r}")
    if (rank >= 0) != (world_size >= 0):
        raise ValueError(f"give both rank and world_size or neither; got rank={rank}, world_size={world_size}")
    _timeout = timeout
    _register_exit_handler()
    if dist.is_initialized():
        if verbose:
            logger.info("torch.distributed is already initialized; recorded timeout %s", timeout)
        return

    found = discover_environment(os.environ, auto_mpi_discovery=auto_mpi_discovery)
    if rank >= 0:
        _check_ranks(rank, world_size, found.local_rank, "the rank/world_size arguments")
        found = replace(found, rank=rank, world_size=world_size)
    if found.master_port is None:  # nothing set MASTER_PORT: any free port for one process
        found = replace(found, master_port=_free_port() if found.world_size == 1 else DEFAULT_MASTER_PORT)
    os.environ.update(found.as_environ())

    if torch.cuda.is_available():
        torch.cuda.set_device(found.local_rank % torch.cuda.device_count())
    if verbose:
        logger.info(
            "init_distributed: backend=%s rank=%d world_size=%d local_rank=%d master=%s:%s (from %s), timeout %s",
            backend, found.rank, found.world_size, found.local_rank, found.master_addr, found.master_port,
            found.source, timeout,
        )
    _groups.clear()  # groups of an earlier default group (destroyed without shutdown_distributed) are gone
    dist.init_process_group(
        backend=backend, init_method=init_method or "env://", timeout=timeout,
        rank=found.rank, world_size=found.world_size,
    )


def get_timeout() -> datetime.timedelta:
    """The timeout given to the last `init_distributed` call (30 minutes before any)."""
    return _timeout


def new_group(ranks: Sequence[int] | None = None, backend: str | None = None, **kwargs: Any) -> Any:
    """``torch.distributed.new_group`` with tachyon's timeout (`get_timeout`) always passed.

    Every process group tachyon creates goes through here. ``timeout`` may not be given:
    change it with ``init_distributed(timeout=...)``. Other keyword arguments
    (``pg_options``, ``use_local_synchronization``, ...) pass through.
    """
    if "timeout" in kwargs:
        raise ValueError("new_group takes the timeout from init_distributed(timeout=...); do not pass timeout")
    if not dist.is_initialized():
        raise RuntimeError("new_group needs torch.distributed initialized; call tachyon.init_distributed() first")
    group = dist.new_group(ranks=None if ranks is None else list(ranks), timeout=_timeout, backend=backend, **kwargs)
    _groups.append(group)
    return group


def destroy_group(group: Any) -> None:
    """Destroy one group made by `new_group` (an engine's data-parallel group at the end of its
    life); no-op for None, WORLD, a group already destroyed, or no torch.distributed."""
    if group in _groups:
        _groups.remove(group)
    if group is None or not (dist.is_available() and dist.is_initialized()) or group is dist.group.WORLD:
        return
    try:
        dist.destroy_process_group(group)
    except (ValueError, RuntimeError):  # destroyed already (torch raises "Invalid process group")
        pass


def _barrier() -> None:
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def shutdown_distributed(barrier: bool = True) -> None:
    """Tear torch.distributed down: every group `new_group` made (newest first), then the default
    group. Safe to call more than once, and when nothing is initialized.

    barrier: first wait until every rank reaches this point (the ranks agree they are done; the
    wait is bounded by the group timeout). A barrier that fails because a peer has already exited
    or failed is logged, and the teardown goes on.
    """
    if not (dist.is_available() and dist.is_initialized()):
        _groups.clear()
        return
    if barrier and dist.get_world_size() > 1:
        try:
            _barrier()
        except Exception as error:  # noqa: BLE001 (a peer is gone: nothing left to agree with)
            logger.warning("shutdown_distributed: rank %d: the exit barrier failed (%s: %s); tearing down anyway",
                           dist.get_rank(), type(error).__name__, str(error).strip().splitlines()[0] if str(error).strip() else "")
    # Let gloo's worker threads finish releasing the collectives they ran. A worker releases a
    # finished collective's tensors right after completing it, which needs the GIL; if that
    # happens while the interpreter finalizes, Python ends the thread in the middle of a C++
    # destructor and the process aborts ("terminate called without an active exception", seen
    # with torch 2.13). destroy_process_group cannot be relied on to join those threads: the
    # process group object outlives it (torch keeps references to it from every collective).
    # Sleeping hands the GIL and the CPU to any such thread; a few ms suffice, 50 ms is margin.
    time.sleep(_SETTLE_S)
    while _groups:
        destroy_group(_groups[-1])
    dist.destroy_process_group()


def _exit_handler() -> None:
    # sys.last_value is set when an uncaught exception ended the program: then skip the barrier
    # (the other ranks may never reach it) and leave at once with that error.
    failed = getattr(sys, "last_value", None) is not None
    try:
        shutdown_distributed(barrier=not failed)
    except Exception as error:  # noqa: BLE001 (never turn a clean exit into a traceback at exit)
        logger.warning("tachyon: tearing torch.distributed down at exit failed: %s: %s", type(error).__name__, error)


def _register_exit_handler() -> None:
    global _exit_handler_registered
    if not _exit_handler_registered:
        atexit.register(_exit_handler)
        _exit_handler_registered = True


def get_rank() -> int:
    """This process's global rank; 0 when torch.distributed is not initialized."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """Number of processes in the default group; 1 when torch.distributed is not initialized."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def get_local_rank() -> int:
    """Rank within this node (LOCAL_RANK, as set by the launcher or `init_distributed`); 0 without one."""
    value = os.environ.get("LOCAL_RANK")
    if value is None:
        return 0
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable LOCAL_RANK={value!r} should be an integer") from None

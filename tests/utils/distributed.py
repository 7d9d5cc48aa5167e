"""Run a function on N gloo ranks on this machine, report every failing rank, never hang.

    results = run_distributed(fn, 4, arg1, arg2, timeout=120)

Each rank is a fresh process with MASTER_ADDR/MASTER_PORT (a free port), RANK,
WORLD_SIZE, LOCAL_RANK set and, unless ``init=False``, a gloo process group initialized; it
calls ``fn(*args)`` (a module-level function, so it pickles) and sends back the return value
(pickled by value, so tensors are safe to return).
If a rank raises, its traceback is collected; the other ranks get a short grace period to
finish or fail, then are killed, and a RankFailure lists each failing rank's traceback. If no
rank fails but some do not finish within ``timeout`` seconds, they are killed and a
RankTimeout names them. Each rank runs torch with one thread (the CI machine has two cores).
Ranks are forked from a multiprocessing forkserver that has already imported torch and tachyon
(`PRELOAD`), so a rank starts in a fraction of a second instead of importing them again; each
rank still begins with the launching process's environment, working directory and sys.path.
Each rank starts through ``tachyon.init_distributed`` and ends through
``tachyon.shutdown_distributed``, as a tachyon program does; a rank that reports its result but
then exits non-zero (an abort at teardown) or does not exit is a RankFailure too.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

GRACE_AFTER_FAILURE_S = 5.0
EXIT_TIMEOUT_S = 30.0  # after every rank reported: the time to tear down and exit


class RankFailure(AssertionError):
    """One or more ranks raised (or died); the message holds each one's traceback."""


class RankTimeout(AssertionError):
    """Some ranks did not finish within the timeout and were killed."""


PRELOAD = ("torch", "torch.distributed", "pytest", "tachyon", "tests.utils")
"""What the forkserver imports once, before it forks any rank."""


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the forkserver starts (its first use)
    return ctx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, results, init, pg_timeout_s, env) -> None:
    # the forkserver's environment is the launcher's when the forkserver started: use today's
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    from tachyon.parallel.distributed import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    ok = False
    try:
        if init:
            init_distributed("gloo", timeout=datetime.timedelta(seconds=pg_timeout_s), verbose=False)
        # pickled here by value: tensors sent through a torch-aware queue would be shared through
        # file descriptors that vanish when this process exits
        value = pickle.dumps(fn(*args))
        results.put((rank, True, value))
        ok = True
    except BaseException:  # report everything, SystemExit included
        results.put((rank, False, traceback.format_exc()))
    finally:
        # deliver the report first, then tear down the way a tachyon program does at exit
        # (multiprocessing children skip atexit handlers, so it is called here): a teardown that
        # aborts the process shows as a non-zero exit code, which run_distributed reports
        results.close()
        results.join_thread()
        if dist.is_initialized():
            shutdown_distributed(barrier=ok)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    init: bool = True,
    pg_timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; returns the per-rank results in rank order.

    ``pg_timeout`` is the process group's own timeout (default: ``timeout``); ``env`` adds
    environment variables in every rank.
    """
    if not 1 <= world_size <= 8:
        raise ValueError(f"world_size must be between 1 and 8; got {world_size}")
    ctx = _context()
    env = {**os.environ, **(env or {})}
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, args, results, init, pg_timeout or timeout, env),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    died_at: dict[int, float] = {}
    try:
        while len(values) + len(failures) < world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                rank, ok, payload = results.get(timeout=min(0.2, deadline - now))
            except queue_mod.Empty:
                pass
            else:
                if ok:
                    values[rank] = pickle.loads(payload)
                else:
                    failures[rank] = payload
                    deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
                continue
            for rank, p in enumerate(procs):  # a rank killed by a signal never reports
                if rank in values or rank in failures or p.is_alive():
                    continue
                first_seen = died_at.setdefault(rank, time.monotonic())
                if time.monotonic() - first_seen > 1.0:  # its last message would have arrived by now
                    failures[rank] = f"rank {rank} exited with code {p.exitcode} without reporting a result"
                    deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
        if len(values) == world_size:  # every rank reported: each must now also exit cleanly
            exit_deadline = time.monotonic() + EXIT_TIMEOUT_S
            for rank, p in enumerate(procs):
                p.join(timeout=max(0.0, exit_deadline - time.monotonic()))
                if p.is_alive():
                    failures[rank] = f"rank {rank} reported its result but did not exit within {EXIT_TIMEOUT_S:g}s"
                elif p.exitcode != 0:
                    failures[rank] = (f"rank {rank} reported its result but exited with code {p.exitcode}"
                                      f"{' (killed by a signal: an abort while tearing down?)' if p.exitcode < 0 else ''}")
    finally:
        stuck = [rank for rank, p in enumerate(procs) if p.is_alive() and rank not in values and rank not in failures]
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        results.close()
    if failures:
        parts = [f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(failures.items())]
        if stuck:
            parts.append(f"ranks {stuck} were still running after the failure and were killed")
        raise RankFailure(f"{len(failures)} of {world_size} ranks failed:\n" + "\n".join(parts))
    if stuck:
        raise RankTimeout(f"ranks {stuck} of {world_size} did not finish within {timeout:g}s and were killed")
    return [values[rank] for rank in range(world_size)]

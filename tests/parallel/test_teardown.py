"""Teardown of what tachyon starts: shutdown_distributed (subgroups first, then the default group),
the exit handler init_distributed registers (a failing rank leaves at once), Engine.destroy, and
the multi-rank test runner reporting a rank that aborts while tearing down."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tachyon
from tachyon.parallel import distributed as tdist
from tests.utils import RankFailure, run_distributed

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def single_process_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                 "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tdist, "_timeout", tdist.DEFAULT_TIMEOUT)  # init_distributed(timeout=) sets it: restored after
    saved = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def test_shutdown_destroys_every_group_newest_first_then_the_default(single_process_env, monkeypatch):
    tdist.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=20), verbose=False)
    first, second = tdist.new_group([0]), tdist.new_group([0])
    destroyed = []
    real = dist.destroy_process_group
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: destroyed.append(group) or real(group))
    tachyon.shutdown_distributed()
    assert destroyed == [second, first, None], "subgroups newest first, then the default group"
    assert not dist.is_initialized()
    tachyon.shutdown_distributed()  # again: nothing to do
    assert destroyed == [second, first, None]


def test_shutdown_skips_groups_destroyed_already_and_does_nothing_uninitialized(single_process_env):
    tachyon.shutdown_distributed()  # never initialized: no error
    tdist.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=20), verbose=False)
    group = tdist.new_group([0])
    tdist.destroy_group(group)
    tdist.destroy_group(group)  # twice: no error
    tdist.destroy_group(None)
    tachyon.shutdown_distributed()
    assert not dist.is_initialized()


def test_init_distributed_registers_one_exit_handler(single_process_env, monkeypatch):
    registered = []
    monkeypatch.setattr(tdist.atexit, "register", registered.append)
    monkeypatch.setattr(tdist, "_exit_handler_registered", False)
    tdist.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=20), verbose=False)
    tdist.init_distributed(timeout=datetime.timedelta(seconds=20), verbose=False)
    assert registered == [tdist._exit_handler]
    tdist._exit_handler()  # what the interpreter runs at exit
    assert not dist.is_initialized()


@pytest.mark.distributed
def test_a_rank_that_raises_exits_at_once_with_its_error_and_the_other_does_not_wait():
    """Group timeout 300 s: if the exit handler of either rank waited on a barrier for the failed
    peer, the job would take minutes."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tachyon.parallel.launch", "--nproc-per-node", "2",
         str(REPO / "tests" / "parallel" / "_teardown_script.py"), "rank1-raises"],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "RuntimeError: rank 1 fails on purpose after its first collective" in proc.stderr, proc.stderr
    assert "rank 0 done sum=2" in proc.stdout, proc.stdout
    assert "terminate called" not in proc.stderr, proc.stderr
    assert elapsed < 60, f"the job took {elapsed:.0f} s: a rank waited for its failed peer"


def _abort_while_tearing_down():
    import os

    dist.destroy_process_group = lambda group=None: os.abort()  # what an abort at teardown looks like
    return dist.get_rank()


@pytest.mark.distributed
def test_runner_reports_a_rank_that_aborts_after_reporting_its_result():
    with pytest.raises(RankFailure, match=r"reported its result but exited with code -6"):
        run_distributed(_abort_while_tearing_down, 2, timeout=60)


def _engine_destroy():
    from tests.engine.zero_cases import MICRO, Case, make_model

    engine, _, _, _ = tachyon.initialize(model=make_model(), config=Case(stage=2).config(dist.get_world_size()),
                                         optimizer=lambda g: torch.optim.AdamW(g, lr=1e-2))
    x = torch.randn(MICRO, engine.module[0].in_features)
    engine.backward(engine(x).sum())
    engine.step()
    group = engine.data_parallel_group
    assert group is not None and group is not dist.group.WORLD
    engine.destroy()
    engine.destroy()  # again: nothing
    out = {}
    try:
        engine(x)
    except RuntimeError as error:
        out["forward"] = str(error)
    try:  # a destroyed group is no longer registered with torch.distributed
        dist.get_process_group_ranks(group)
        out["group"] = "still registered"
    except (ValueError, RuntimeError, KeyError) as error:
        out["group"] = type(error).__name__
    t = torch.ones(1)
    dist.all_reduce(t)  # the default group is the caller's to end
    out["world_sum"] = t.item()
    return out


@pytest.mark.distributed
def test_engine_destroy_ends_its_data_parallel_group_and_the_engine():
    for out in run_distributed(_engine_destroy, 2, timeout=90):
        assert "was destroyed" in out["forward"]
        assert out["group"] != "still registered"
        assert out["world_sum"] == 2.0

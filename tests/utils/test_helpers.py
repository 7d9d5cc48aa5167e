"""The test helpers themselves: explaining asserts and the multi-rank runner."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.utils import RankFailure, RankTimeout, assert_close, assert_close_to_reference, run_distributed, tolerance


def test_assert_close_reports_count_worst_index_and_errors():
    expected = torch.zeros(3, 4)
    actual = expected.clone()
    actual[1, 2] = 0.5
    actual[2, 3] = 0.25
    with pytest.raises(AssertionError) as info:
        assert_close(actual, expected, name="out")
    msg = str(info.value)
    assert "out: 2 of 12 elements differ" in msg
    assert "worst at index (1, 2)" in msg
    assert "max abs error 0.5" in msg


def test_assert_close_reports_nan_and_inf_disagreements():
    expected = torch.tensor([1.0, 2.0, 3.0])
    actual = torch.tensor([float("nan"), float("inf"), 3.0])
    with pytest.raises(AssertionError) as info:
        assert_close(actual, expected)
    assert "NaN disagreements: 1" in str(info.value)
    assert "inf disagreements: 1" in str(info.value)


def test_assert_close_passes_within_the_dtype_tolerance():
    rtol, atol = tolerance(torch.float16)
    x = torch.randn(100)
    assert_close(x * (1 + rtol / 2), x, dtype=torch.float16)


def test_two_x_rule_rejects_a_kernel_much_worse_than_torch():
    oracle = torch.randn(64, dtype=torch.float64)
    lowp = oracle.to(torch.bfloat16)
    assert_close_to_reference(lowp, lowp, oracle)
    with pytest.raises(AssertionError, match="more than 2x PyTorch"):
        assert_close_to_reference(lowp + 0.5, lowp, oracle)


def _all_reduce_rank():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_on_n_ranks(world_size):
    results = run_distributed(_all_reduce_rank, world_size, timeout=120)
    expected = world_size * (world_size + 1) / 2
    assert results == [(rank, world_size, expected) for rank in range(world_size)]


def _rank_one_raises():
    if dist.get_rank() == 1:
        raise ValueError("rank one is broken on purpose")
    dist.barrier()  # the other ranks wait here forever unless killed


@pytest.mark.distributed
def test_a_failing_rank_reports_its_traceback_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_distributed(_rank_one_raises, 2, timeout=60, pg_timeout=600)
    msg = str(info.value)
    assert "--- rank 1 ---" in msg
    assert "ValueError: rank one is broken on purpose" in msg
    assert "_rank_one_raises" in msg  # the traceback, not just the message
    assert time.monotonic() - start < 60


def _rank_zero_hangs():
    if dist.get_rank() == 0:
        time.sleep(600)


@pytest.mark.distributed
def test_a_stuck_rank_is_killed_at_the_timeout():
    start = time.monotonic()
    # rank 1 must be forked, join the group and report inside the timeout while the test suite's
    # other worker runs: well under a second from the preloaded forkserver (a failing or killed
    # rank's whole test takes under 2 s on a loaded 2-core machine), so 10 s keeps a wide margin
    with pytest.raises(RankTimeout, match=r"ranks \[0\] of 2 did not finish within 10s"):
        run_distributed(_rank_zero_hangs, 2, timeout=10)
    assert time.monotonic() - start < 35


def _rank_dies():
    import os
    import signal

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


@pytest.mark.distributed
def test_a_rank_killed_by_a_signal_is_reported():
    with pytest.raises(RankFailure, match="rank 1 exited with code -9"):
        run_distributed(_rank_dies, 2, timeout=60, pg_timeout=600)

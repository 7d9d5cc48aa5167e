"""A rank that dies or hangs makes the other ranks fail with a clear error instead of hanging."""

from __future__ import annotations

import re
import time

import pytest

from tests.engine.zero_cases import rank_dies_mid_training, rank_hangs_mid_training
from tests.utils import RankFailure, run_distributed

pytestmark = pytest.mark.distributed

GROUP_TIMEOUT_S = 6.0
"""The data-parallel group's timeout in the stuck-rank test: the test waits it out, and the first
two steps' collectives (both ranks arrive within a fraction of a second) must finish inside it."""


def test_a_rank_that_exits_makes_the_others_raise_a_collective_error():
    with pytest.raises(RankFailure) as info:
        # the default group's own timeout (pg_timeout) and the data-parallel group's are long:
        # the survivors must notice the closed connection, not wait for a timeout
        run_distributed(rank_dies_mid_training, 2, 300.0, timeout=120, pg_timeout=300)
    message = str(info.value)
    assert "rank 1 exited with code 3" in message
    assert "CollectiveError: data-parallel" in message and "failed on rank 0 of 2" in message


def test_a_stuck_rank_makes_the_others_fail_within_the_group_timeout():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_distributed(rank_hangs_mid_training, 2, GROUP_TIMEOUT_S, 600.0, timeout=180, pg_timeout=600)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "--- rank 0 ---" in message and "CollectiveError: data-parallel" in message
    assert f"within the group's {GROUP_TIMEOUT_S:g} s timeout" in message
    assert "ranks [1] were still running after the failure and were killed" in message
    waited = float(re.search(r"failed after ([0-9.]+) s", message).group(1))
    assert GROUP_TIMEOUT_S - 1 <= waited <= GROUP_TIMEOUT_S + 10, f"rank 0 gave up after {waited} s"
    assert elapsed < 120, f"took {elapsed:.0f}s"

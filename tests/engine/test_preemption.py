"""Save on preemption (tachyon.engine.preemption): a signal on one rank stops every rank after the
same step with a checkpoint and Preempted (exit code 75); no handler when the section is off.
The launcher side (tachyon launch forwarding SIGTERM to torchrun) is in tests/parallel/test_launch.py."""

from __future__ import annotations

import pytest

from tests.engine.nonfinite_cases import handlers_untouched_when_off, preempted_run
from tests.utils import run_distributed


@pytest.mark.distributed
def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step_with_a_checkpoint(tmp_path):
    results = run_distributed(preempted_run, 2, str(tmp_path), 1, 3, timeout=300)
    for rank, result in enumerate(results):
        assert result["installed"] and result["restored"]
        stopped = result["stopped"]
        assert stopped is not None, f"rank {rank} did not stop"
        # rank 1 got the signal after step 3; the ranks agree at step 4's boundary and stop after it
        assert (stopped["code"], stopped["step"], stopped["global_steps"], stopped["signal"]) == (75, 4, 4, "SIGUSR1")
        assert stopped["checkpoint"] == str(tmp_path / "ckpt" / "global_step4")
        assert result["resumed"] == (str(tmp_path / "ckpt" / "global_step4"), {"where": 0}, 4)
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step4"


def test_no_signal_handler_is_installed_when_preemption_is_off():
    assert handlers_untouched_when_off()


def test_preemption_needs_a_save_dir():
    from tachyon.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="preemption.enabled needs preemption.save_dir"):
        load_config({"train_batch_size": 1, "preemption": {"enabled": True}})

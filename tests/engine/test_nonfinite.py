"""Non-finite gradients never reach the weights, in every precision and ZeRO stage, and the ranks
skip together (tachyon.engine.nonfinite); a non-finite state is not saved."""

from __future__ import annotations

import pytest
import torch

from tests.engine.nonfinite_cases import POISONED_PARAM, poisoned_run, rank_main
from tests.engine.zero_cases import Case
from tests.utils import run_distributed

LIMIT = {"nonfinite_gradients": {"max_consecutive_skips": 3}}
RUNS = [
    # (name, case, {step: poison}, rank that poisons, extra config)
    ("bf16-zero2-nan-loss", Case(stage=2, precision="bf16", clip=1.0, steps=5), {2: "loss"}, 1, None),
    ("fp32-zero1-gas2-inf-grad", Case(stage=1, clip=1.0, gas=2, steps=4), {1: "grad"}, 0, None),
    ("bf16-zero0-limit", Case(stage=0, precision="bf16", steps=6), {s: "loss" for s in range(1, 6)}, 1, LIMIT),
    # 1-bit Adam past its warm-up (freeze_step 2) at ZeRO-1: the nan goes through the compressed
    # reduce-scatter's error feedback, which is reset on the skipped step
    ("onebit-zero1-nan-in-compression", Case(stage=1, steps=6, optimizer="config-onebit"), {4: "loss"}, 1,
     {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2}}}),
    ("bf16-zero2-config-adamw-check-off", Case(stage=2, precision="bf16", steps=3, optimizer="config-adam"),
     {1: "loss"}, 1, {"bf16": {"enabled": True, "check_grad_overflow": False}}),
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("nonfinite")
    return run_distributed(rank_main, 2, RUNS, str(root), timeout=300), root


def _same_on_both_ranks(results, name):
    a, b = (r[name]["params"] for r in results)
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["bf16-zero2-nan-loss", "fp32-zero1-gas2-inf-grad", "onebit-zero1-nan-in-compression"])
def test_one_rank_non_finite_skips_the_step_on_every_rank(two_ranks, name):
    results, _ = two_ranks
    _, case, poison, _, _ = next(r for r in RUNS if r[0] == name)
    bad = next(iter(poison))
    for result in (r[name] for r in results):
        assert result["error"] is None, result["error"]
        assert result["unchanged"] == [step == bad for step in range(case.steps)], result["unchanged"]
        assert (result["skipped_steps"], result["global_steps"]) == (1, case.steps)
        assert result["finite"], "a non-finite value reached the weights, masters or moments"
    assert _same_on_both_ranks(results, name)
    rank0 = results[0][name]["logs"]
    skipped = [line for line in rank0 if line.startswith(f"step {bad + 1} skipped: non-finite gradient")]
    assert len(skipped) == 1, rank0
    assert not results[1][name]["logs"], "one line per job, from rank 0"
    if poison[bad] == "grad":  # the inf is in one parameter's gradient, held by one ZeRO-1 partition
        assert f"in {POISONED_PARAM} " in skipped[0], skipped[0]


@pytest.mark.distributed
def test_consecutive_non_finite_steps_stop_training_on_every_rank(two_ranks):
    results, _ = two_ranks
    for result in (r["bf16-zero0-limit"] for r in results):
        assert result["error"] is not None and result["error"].startswith("NonFiniteGradientsError: training stopped "
                                                                         "at step 4: 3 consecutive steps"), result["error"]
        assert "those of step 1" in result["error"]
        assert (result["global_steps"], result["skipped_steps"]) == (4, 3) and result["finite"]
        assert result["unchanged"] == [False, True, True]


@pytest.mark.distributed
def test_bf16_check_grad_overflow_off_lets_nan_through_as_deepspeed_does(two_ranks):
    results, _ = two_ranks
    for result in (r["bf16-zero2-config-adamw-check-off"] for r in results):
        assert result["skipped_steps"] == 0 and not result["finite"]


@pytest.mark.distributed
def test_a_non_finite_state_is_not_saved_unless_allowed(two_ranks):
    results, root = two_ranks
    for result in results:
        error = result["refused"]["error"]
        assert error is not None and "refusing to save checkpoint" in error and "(step 2)" in error, error
        assert "rank 1: the master weight of 0.weight holds an inf or nan" in error, error
        assert result["allowed"]["error"] is None and result["allowed"]["saved"] is True
    assert (root / "refused" / "latest").read_text() == "global_step2"
    assert not (root / "refused" / "bad").exists()
    assert [p.name for p in (root / "refused").iterdir() if p.name.startswith(".")] == []
    assert (root / "allowed" / "latest").read_text() == "bad"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_single_process_nan_loss_with_clipping_is_skipped(precision):
    result = poisoned_run(Case(stage=0, precision=precision, clip=1.0, steps=3), {1: "loss"}, 0)
    assert result["unchanged"] == [False, True, False] and result["finite"]
    assert result["skipped_steps"] == 1 and result["grad_norm"] is not None
    assert any(line.startswith("step 2 skipped: non-finite gradient (inf or nan) in ") for line in result["logs"])


@pytest.mark.distributed
def test_a_disk_full_on_one_rank_is_the_same_checkpoint_error_on_both_naming_it(two_ranks):
    """(Shares this module's 2-rank spawn.) torch.distributed.checkpoint's CheckpointException, a
    BaseException, becomes a CheckpointError naming rank 1, its shard file and ENOSPC."""
    results, root = two_ranks
    errors = [r["disk_full"] for r in results]
    assert errors[0] == errors[1] and errors[0] is not None
    assert f"saving checkpoint {root / 'full' / 'full'} (step 1) failed: rank 1 could not write " in errors[0], errors[0]
    assert "__1_0.distcp: OSError [ENOSPC]: No space left on device" in errors[0], errors[0]
    assert (root / "full" / "latest").read_text() == "global_step1"
    assert sorted(p.name for p in (root / "full").iterdir()) == ["global_step1", "latest"]

"""The acceptance run: ``tachyon train examples/train_ci.json`` on 2 gloo processes (ZeRO-2,
bf16 where the CPU has it) exits 0, its loss goes down, it writes metrics.csv, loss.png and
summary.txt; then ``--resume`` with more steps continues from the saved step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tachyon.train.plot import read_png
from tachyon.train.run import read_metrics

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
CI_CONFIG = ROOT / "examples" / "train_ci.json"
CI_STEPS, RESUME_STEPS = 30, 40


def _train(output_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    command = [sys.executable, "-m", "tachyon", "train", str(CI_CONFIG), "--output-dir", str(output_dir),
               "--no-progress"]
    return subprocess.run([*command, *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


def _check(proc: subprocess.CompletedProcess) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}; output:\n{output[-4000:]}"
    return output


@pytest.fixture(scope="module")
def ci_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("train_ci")
    return output_dir, _train(output_dir)


def test_ci_run_learns_and_writes_its_outputs(ci_run):
    output_dir, proc = ci_run
    output = _check(proc)
    assert "torch.distributed.run --standalone --nproc-per-node 2" in output  # re-executed through torchrun
    assert "step 10 | loss" in output and "tokens/s | step" in output  # the engine's step lines
    for step in range(1, CI_STEPS + 1):  # printed by the engine alone, every steps_per_print (10) steps
        assert output.count(f"step {step} | loss") == (step % 10 == 0), f"step {step}'s line:\n{output[-4000:]}"
    rows = read_metrics(output_dir / "metrics.csv")
    assert [r["step"] for r in rows] == list(range(1, CI_STEPS + 1))
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert last < first - 0.8, f"the loss should fall: first 5 steps {first:.3f}, last 5 {last:.3f}"
    assert all(r["tokens_per_s"] > 0 and r["step_time_s"] > 0 for r in rows)
    width, height, _ = read_png(output_dir / "loss.png")
    assert (width, height) == (720, 560)
    summary = (output_dir / "summary.txt").read_text()
    for expected in ("2 process(es) on cpu", "ZeRO stage 2", f"steps: {CI_STEPS} of {CI_STEPS}", "loss:",
                     "validation loss:", "tokens/s", "rank 0:", "rank 1:", "model_states"):
        assert expected in summary, f"{expected!r} missing from summary.txt:\n{summary}"


def test_resume_continues_from_the_saved_step(ci_run):
    output_dir, proc = ci_run
    _check(proc)
    assert (output_dir / "checkpoints").is_dir(), "the CI run saved no checkpoint"
    before = read_metrics(output_dir / "metrics.csv")
    output = _check(_train(output_dir, "--resume", "--steps", str(RESUME_STEPS)))
    assert f"resumed from step {CI_STEPS}" in output
    assert output.count(f"step {RESUME_STEPS} | loss") == 1 and f"step {CI_STEPS} | loss" not in output
    rows = read_metrics(output_dir / "metrics.csv")
    assert [r["step"] for r in rows] == list(range(1, RESUME_STEPS + 1))
    assert rows[:CI_STEPS] == before  # the first segment is kept as it was
    # the weights were restored: the first resumed step is nowhere near the untrained loss
    assert rows[CI_STEPS]["loss"] < sum(r["loss"] for r in before[:5]) / 5 - 0.8
    summary = (output_dir / "summary.txt").read_text()
    assert f"steps: {RESUME_STEPS} of {RESUME_STEPS} (this run: {CI_STEPS + 1}-{RESUME_STEPS})" in summary
    assert f"global_step{RESUME_STEPS}" in summary

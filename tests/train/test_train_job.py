"""The acceptance runs of ``tachyon train`` on 2 gloo processes (ZeRO-2, bf16 where the CPU computes it natively, else fp32):

- examples/train_ci.json: the learning claim. Its validation loss (every scored token replaced
  by [MASK], so only the context can help) ends at least LEARNING_MARGIN nats/token below the
  unigram baseline on the same targets; the step lines, metrics.csv, validation.csv, loss.png,
  the final table and summary.txt (both losses in nats and perplexity, fill-mask examples) are
  there. Then ``--resume`` with more steps continues from the saved step, quietly.

A GPT job's generated lines, and a finished run resumed changing nothing, are checked on the
one-process run of test_parallel_train.py.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from matplotlib.image import imread

from tachyon.train.report import read_metrics
from tests.train._cli import ROOT, succeeded, train_process

pytestmark = pytest.mark.distributed

CI_CONFIG = ROOT / "examples" / "train_ci.json"
CI_STEPS = json.loads(CI_CONFIG.read_text())["steps"]
RESUME_STEPS = CI_STEPS + 4
LEARNING_MARGIN = 0.15
"""nats/token the CI run's validation loss must end below the unigram baseline (examples/README.md
gives the measured gap of this run and of the default job)."""


@pytest.fixture(scope="module")
def ci_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("train_ci")
    return output_dir, train_process(str(CI_CONFIG), "--output-dir", str(output_dir), "--no-progress")


def test_ci_run_beats_the_unigram_baseline(ci_run):
    output_dir, proc = ci_run
    succeeded(proc)
    validation = read_metrics(output_dir / "validation.csv")
    last = validation[-1]
    assert last["step"] == CI_STEPS
    gap = last["baseline_loss"] - last["loss"]
    assert gap >= LEARNING_MARGIN, (
        f"validation loss {last['loss']:.3f} is only {gap:.3f} nats/token below the unigram baseline "
        f"{last['baseline_loss']:.3f}; the run must learn from the context (>= {LEARNING_MARGIN} below)")
    assert last["accuracy"] > last["baseline_accuracy"], "top-1 accuracy no better than always guessing one token"
    assert validation[0]["loss"] > last["loss"], f"the validation loss did not fall: {validation}"


def test_ci_run_prints_lines_a_table_and_a_summary(ci_run):
    output_dir, proc = ci_run
    output = succeeded(proc)
    assert "torch.distributed.run --standalone --nproc-per-node 2" in output  # re-executed through torchrun
    steps_per_print = json.loads(CI_CONFIG.read_text())["engine"]["steps_per_print"]
    for step in range(1, CI_STEPS + 1):  # printed by the engine alone, every steps_per_print steps
        assert output.count(f"step {step} | loss") == (step % steps_per_print == 0), f"step {step}:\n{output[-4000:]}"
    assert "\r" not in output, "no progress bar without a terminal (--no-progress): lines only"
    table = output[output.index("  step  train loss  val loss   val ppl"):]
    rows = [line.split() for line in table.splitlines()[2:] if re.match(r"^\s+\d+\s", line)]
    validation = read_metrics(output_dir / "validation.csv")
    assert [int(r[0]) for r in rows] == [int(v["step"]) for v in validation]
    assert [float(r[2]) for r in rows] == [round(v["loss"], 3) for v in validation]

    summary = (output_dir / "summary.txt").read_text()
    assert summary in output
    last = validation[-1]
    model_line = next(line for line in summary.splitlines() if line.strip().startswith("model "))
    baseline_line = next(line for line in summary.splitlines() if line.strip().startswith("unigram baseline "))
    assert f"{last['loss']:.3f} nats/token" in model_line and "perplexity" in model_line
    assert f"{last['baseline_loss']:.3f} nats/token" in baseline_line and "perplexity" in baseline_line
    assert "below the baseline" in summary
    examples = summary.split("fill-mask on held-out lines")[1].split("memory per rank")[0].splitlines()[1:]
    answers = [line for line in examples if "answer:" in line]
    assert len(answers) == 5, summary
    for line in answers:
        assert re.search(r"answer: \S+\s+model: .+ \d\.\d\d, .+ \d\.\d\d, .+ \d\.\d\d\s+\((hit|miss)\)", line), line
    assert all("____" in line for line in examples if "answer:" not in line)
    for expected in ("2 process(es) on cpu", "ZeRO stage 2", f"steps: {CI_STEPS} of {CI_STEPS}", "tokens/s",
                     "rank 0:", "rank 1:", "model_states"):
        assert expected in summary, f"{expected!r} missing from summary.txt:\n{summary}"
    # "precision": "auto": bf16 only where this CPU has oneDNN's native bf16 kernels (else emulated, ~10x slower)
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert f"2 process(es) on cpu, {'bf16' if native else 'fp32'}, ZeRO stage 2" in output, output[:600]


def test_ci_run_writes_metrics_and_a_plot(ci_run):
    output_dir, proc = ci_run
    succeeded(proc)
    rows = read_metrics(output_dir / "metrics.csv")
    assert [r["step"] for r in rows] == list(range(1, CI_STEPS + 1))
    assert all(r["tokens_per_s"] > 0 and r["step_time_s"] > 0 for r in rows)
    lrs = [r["lr"] for r in rows]  # the rate each step used: linear warmup from 0, then linear decay to 0
    assert lrs[0] == 0.0 and all(lr > 0 for lr in lrs[1:]) and max(lrs) == lrs[30]
    assert lrs[-1] < lrs[CI_STEPS // 2] < lrs[30]
    assert imread(output_dir / "loss.png").shape[:2] == (900, 900)


def test_resume_continues_from_the_saved_step_quietly(ci_run):
    output_dir, proc = ci_run
    succeeded(proc)
    assert (output_dir / "checkpoints").is_dir(), "the CI run saved no checkpoint"
    before = read_metrics(output_dir / "metrics.csv")
    proc = train_process(str(CI_CONFIG), "--output-dir", str(output_dir), "--resume", "--steps", str(RESUME_STEPS), "--quiet")
    succeeded(proc)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tachyon train: validation loss"), proc.stdout
    assert "unigram baseline" in lines[0] and proc.stderr.strip() == "", proc.stderr[-2000:]
    rows = read_metrics(output_dir / "metrics.csv")
    assert [r["step"] for r in rows] == list(range(1, RESUME_STEPS + 1))
    assert rows[:CI_STEPS] == before  # the first segment is kept as it was
    # the weights were restored: the first resumed step is nowhere near the untrained loss
    assert rows[CI_STEPS]["loss"] < sum(r["loss"] for r in before[:5]) / 5 - 0.5
    validation = read_metrics(output_dir / "validation.csv")
    assert validation[-1]["step"] == RESUME_STEPS and validation[-2]["step"] <= CI_STEPS
    summary = (output_dir / "summary.txt").read_text()
    assert f"steps: {RESUME_STEPS} of {RESUME_STEPS} (this run: {CI_STEPS + 1}-{RESUME_STEPS})" in summary
    assert f"global_step{RESUME_STEPS}" in summary
    # the decaying schedule keeps the checkpoint's length unless --reschedule, and says so
    assert f"note: steps {CI_STEPS} -> {RESUME_STEPS}: the lr schedule stays the checkpoint's (WarmupDecayLR over " \
           f"{CI_STEPS} steps): step {CI_STEPS + 1} runs at lr 0" in summary, summary
    assert all(r["lr"] == 0.0 for r in rows[CI_STEPS:])

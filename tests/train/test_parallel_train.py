"""``tachyon train --tp N --pp M``: the GPT job split within layers and by layers trains the
same model as one process.

One tiny GPT job (byte tokenizer, so the embedding is padded from 262 to 320 rows; RoPE; fp32;
no dropout; AdamW with clipping) runs 4 steps on one process, then under tensor parallelism
(tp 2), a pipeline (pp 2: the micro-batch of 8 becomes 2 pipeline micro-batches of 4, the same
samples per step) and both (tp 2 x pp 2, 4 processes). With one data-parallel copy every layout
reads the same samples in the same order, so every step's training loss, both validation
losses and the parameters' effect on the generated text must agree with the single process up
to floating-point summation order. The single process's output also shows the GPT job's
generated lines, and resuming it at its last step changes no file.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from tachyon.train.report import read_metrics
from tests.train._cli import run_train, succeeded, train_process

pytestmark = pytest.mark.distributed

STEPS = 4
JOB = {
    "model": "gpt", "position": "rope", "tokenizer": "byte", "hidden_size": 32, "num_layers": 2, "num_heads": 2,
    "seq_len": 32, "steps": STEPS, "checkpoint_interval": 0, "eval_interval": 2, "eval_batches": 2, "examples": 1,
    "nproc": 1, "precision": "fp32", "seed": 3,
    "engine": {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
               "steps_per_print": 100, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
               "zero_optimization": {"stage": 1}},
}
RTOL = 1e-4
"""fp32 losses of the parallel layouts vs one process: the row-parallel sums and the gradient
reductions add in another order (measured differences are about 1e-6 relative)."""


def _train(config: Path, out: Path, *flags: str) -> str:
    return run_train(str(config), "--output-dir", str(out), "--no-progress", *flags)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel_train")
    config = root / "gpt.json"
    config.write_text(json.dumps(JOB))
    output = _train(config, root / "single")
    return config, root, output


def test_one_gpt_process_prints_generated_lines(single):
    *_, output = single
    generated = output.split("generated (")[1].split("memory per rank")[0].splitlines()[1:]
    prompts = [line for line in generated if re.fullmatch(r"  \| [A-Z][A-Z ]+\.", line)]
    assert len(prompts) == JOB["examples"], "\n".join(generated)
    assert len([line for line in generated if line.startswith("  | ")]) > len(prompts), "no generated text after the prompts"
    assert "validation (next-token prediction" in output


def test_resuming_a_finished_run_changes_nothing_and_says_so(single):
    config, root, _ = single
    out = root / "single"
    files = {name: (out / name).read_bytes() for name in ("metrics.csv", "validation.csv", "summary.txt")}
    again = train_process(str(config), "--output-dir", str(out), "--resume", "--steps", str(STEPS))
    output = succeeded(again)
    assert "already reached step" in output and "nothing to train, no file changed" in output, output[-2000:]
    assert files == {name: (out / name).read_bytes() for name in files}


def _losses(out: Path) -> tuple[list[float], list[float]]:
    train = [row["loss"] for row in read_metrics(out / "metrics.csv")]
    validation = [row["loss"] for row in read_metrics(out / "validation.csv")]
    return train, validation


@pytest.mark.parametrize("flags, processes, layout", [
    (("--tp", "2"), 2, "data parallel 1 x pipeline 1 x tensor parallel 2"),
    (("--tp", "2", "--pp", "2"), 4, "data parallel 1 x pipeline 2 x tensor parallel 2"),
])
def test_a_parallel_layout_trains_like_one_process(single, flags, processes, layout):
    config, root, _ = single
    out = root / "-".join(flags).replace("--", "")
    output = _train(config, out, *flags)
    assert f"--nproc-per-node {processes}" in output  # the default process count fits the layout
    assert f"{processes} process(es) ({layout})" in output
    train, validation = _losses(out)
    train_ref, validation_ref = _losses(root / "single")
    assert len(train) == len(train_ref) == STEPS and len(validation) == len(validation_ref) == 2
    for got, want in zip(train + validation, train_ref + validation_ref):
        assert math.isclose(got, want, rel_tol=RTOL), (train, train_ref, validation, validation_ref)
    assert train[-1] < train[0]  # it learns
    # the whole model was gathered for the generated line, and the final checkpoint written
    summary = (out / "summary.txt").read_text()
    assert "generated (" in summary and (out / "checkpoints" / f"global_step{STEPS}").is_dir()


@pytest.mark.slow
def test_a_pipeline_alone_trains_like_one_process(single):
    config, root, _ = single
    out = root / "pp2"
    output = _train(config, out, "--pp", "2")
    assert "ZeRO stage 1" in output and "micro-batch 4 x 2 accumulation x 1 data-parallel ranks" in output
    train, validation = _losses(out)
    train_ref, validation_ref = _losses(root / "single")
    for got, want in zip(train + validation, train_ref + validation_ref):
        assert math.isclose(got, want, rel_tol=RTOL), (train, train_ref, validation, validation_ref)


@pytest.mark.slow
def test_tensor_parallel_ranks_drop_the_same_layers(tmp_path):
    """Progressive layer drop under tp 2: the ranks of one model copy share the random stream
    (seeded per data-parallel rank), so they drop the same layers as the single process does."""
    job = {**JOB, "num_layers": 4, "steps": 6, "examples": 0,
           "engine": {**JOB["engine"], "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.5}}}
    config = tmp_path / "pld.json"
    config.write_text(json.dumps(job))
    _train(config, tmp_path / "single")
    _train(config, tmp_path / "tp2", "--tp", "2")
    rows = {name: read_metrics(tmp_path / name / "metrics.csv") for name in ("single", "tp2")}
    assert [r["pld_theta"] for r in rows["tp2"]] == [r["pld_theta"] for r in rows["single"]]
    assert rows["single"][-1]["pld_theta"] < 0.6  # layers were being dropped by the end
    for got, want in zip(rows["tp2"], rows["single"]):
        assert math.isclose(got["loss"], want["loss"], rel_tol=RTOL), (rows["tp2"], rows["single"])

"""``tachyon train --zero N [--offload]``: the engine section's ZeRO stage and optimizer offload
set from the command line; the GPT job trained at stage 3 with offload and the BERT job at
stage 3, each against stage 2 (slow: two launches each)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from tachyon.config import ConfigError
from tachyon.train.cli import add_arguments, launch_command, run
from tachyon.train.config import load_train_config
from tachyon.train.report import read_metrics
from tests.train._cli import run_train
from tests.train.test_parallel_train import JOB, RTOL


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_zero_and_offload_set_the_engine_section_and_travel_to_the_ranks():
    engine = load_train_config(model="gpt", zero=3, offload=True).engine
    zero = engine["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    # the section's other keys stay; --no-offload removes both offload sections
    source = {**JOB, "engine": {**JOB["engine"], "zero_optimization": {
        "stage": 3, "stage3_prefetch_bucket_size": 0, "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"}}}}
    zero = load_train_config(source, zero=2, offload=False).engine["zero_optimization"]
    assert zero == {"stage": 2, "stage3_prefetch_bucket_size": 0}
    assert load_train_config(source, offload=True).engine["zero_optimization"]["stage"] == 3
    cmd = launch_command(_args("--model", "gpt", "--zero", "3", "--offload"), 2, Path("o"))
    assert cmd[8:] == ["--model", "gpt", "--output-dir", "o", "--zero", "3", "--offload"]
    assert launch_command(_args("--no-offload"), 2, Path("o"))[-1] == "--no-offload"


def test_offload_below_stage_1_is_refused_before_any_work(capsys):
    with pytest.raises(ConfigError, match="stage 1, 2 or 3; the job's stage is 0"):
        load_train_config(model="gpt", zero=0, offload=True)
    assert run(_args("--model", "gpt", "--zero", "0", "--offload")) == 2
    assert "--offload moves the optimizer to the CPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _args("--zero", "4")


@pytest.mark.slow
@pytest.mark.distributed
def test_the_gpt_job_trains_at_stage_3_with_offload_like_stage_2(tmp_path):
    """2 processes, 4 steps: stage 3 with the optimizer on the host gives stage 2's losses (the
    same samples; only the sums' order differs), then gathers the model for the generated lines."""
    config = tmp_path / "gpt.json"
    config.write_text(json.dumps({**JOB, "nproc": 2}))
    outputs = {}
    for name, flags in (("z2", ("--zero", "2")), ("z3", ("--zero", "3", "--offload"))):
        outputs[name] = run_train(str(config), "--output-dir", str(tmp_path / name), "--no-progress", *flags)
    assert "ZeRO stage 3" in outputs["z3"] and "offloaded" in (tmp_path / "z3" / "summary.txt").read_text()
    assert "generated (" in (tmp_path / "z3" / "summary.txt").read_text()
    losses = {name: [row["loss"] for row in read_metrics(tmp_path / name / "validation.csv")]
              + [row["loss"] for row in read_metrics(tmp_path / name / "metrics.csv")] for name in outputs}
    assert len(losses["z3"]) == 2 + JOB["steps"]
    for got, want in zip(losses["z3"], losses["z2"]):
        assert math.isclose(got, want, rel_tol=RTOL), losses


BERT_JOB = {
    "model": "bert", "tokenizer": "byte", "hidden_size": 32, "num_layers": 2, "num_heads": 2, "seq_len": 32,
    "mask_prob": 0.3, "hidden_dropout": 0.0, "attention_dropout": 0.0, "steps": 6, "checkpoint_interval": 0,
    "eval_interval": 3, "eval_batches": 2, "examples": 1, "nproc": 2, "precision": "fp32", "seed": 0,
    "engine": {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
               "steps_per_print": 100, "optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "weight_decay": 0.01}},
               "zero_optimization": {"stage": 2}},
}


@pytest.mark.slow
@pytest.mark.distributed
def test_the_bert_job_trains_at_stage_3_like_stage_2(tmp_path):
    """The BERT masked-LM job (the examples' model at a small size; fused TransformerKernelLayers, the
    stage-3 units) on 2 processes, 6 steps, fp32: `--zero 3` runs, its training loss falls, and
    its training and validation losses are stage 2's (the same samples; only the sums' order
    differs)."""
    config = tmp_path / "bert.json"
    config.write_text(json.dumps(BERT_JOB))
    outputs = {}
    for name, flags in (("z2", ("--zero", "2")), ("z3", ("--zero", "3"))):
        outputs[name] = run_train(str(config), "--output-dir", str(tmp_path / name), "--no-progress", *flags)
    assert "ZeRO stage 3" in outputs["z3"] and "ZeRO stage 2" in outputs["z2"]
    train = {name: [row["loss"] for row in read_metrics(tmp_path / name / "metrics.csv")] for name in outputs}
    validation = {name: [row["loss"] for row in read_metrics(tmp_path / name / "validation.csv")] for name in outputs}
    assert len(train["z3"]) == BERT_JOB["steps"] and train["z3"][-1] < train["z3"][0], train
    for got, want in zip(train["z3"] + validation["z3"], train["z2"] + validation["z2"]):
        assert math.isclose(got, want, rel_tol=RTOL), (train, validation)

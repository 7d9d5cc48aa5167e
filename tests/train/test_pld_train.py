"""Progressive layer drop in ``tachyon train``: the job's models take the engine's
``progressive_layer_drop`` / ``pld_theta`` and drop layers in training only; ``--pld`` turns the
engine section on; a tiny 2-process run logs the keep ratio the engine's schedule gives every
step; a resume from a checkpoint continues the schedule and the layer-drop decisions exactly.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tachyon.config import ConfigError
from tachyon.data import CausalLMDataset, MaskedLMDataset, collate, load_tokenizer
from tachyon.engine.pld import ProgressiveLayerDrop
from tachyon.train.config import DEFAULT_ENGINE, load_train_config
from tachyon.train.models import GPT, BertMLM
from tachyon.train.report import read_metrics, time_to_loss
from tests.train._cli import run_train
from tests.utils import assert_close

BYTE = load_tokenizer("byte")
TOKENS = BYTE.encode_tensor("Shall I compare thee to a summer's day? Thou art more lovely and more temperate. " * 3)
LAYERS = 3


def _bert() -> BertMLM:
    torch.manual_seed(0)
    return BertMLM(vocab_size=BYTE.vocab_size, hidden_size=32, num_layers=LAYERS, num_heads=4, max_seq_len=24,
                   max_batch_size=4)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=BYTE.vocab_size, hidden_size=32, num_layers=LAYERS, num_heads=4, max_seq_len=24)


def _batch(model: nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(model, BertMLM):
        data = MaskedLMDataset(TOKENS, 20, mask_prob=0.3, seed=0, tokenizer=BYTE)
    else:
        data = CausalLMDataset(TOKENS, 20, tokenizer=BYTE)
    return collate([data[i] for i in range(3)])


BUILDERS = {"bert": _bert, "gpt": _gpt}


@pytest.mark.parametrize("name", BUILDERS)
def test_every_layer_knows_its_place_in_the_stack(name):
    model = BUILDERS[name]()
    places = [(layer.layer_number, layer.num_layers) for layer in model.layers]
    assert places == [(i, LAYERS) for i in range(1, LAYERS + 1)], places


@pytest.mark.parametrize("name", BUILDERS)
def test_eval_runs_every_layer_whatever_theta(name):
    model = BUILDERS[name]().eval()
    batch = _batch(model)
    with torch.no_grad():
        dense = model(**batch)
        for _ in range(5):  # theta 0.05: in training the last layer would run 1 time in 20
            assert torch.equal(model(**batch, progressive_layer_drop=True, pld_theta=0.05), dense), \
                f"{name}: evaluation with PLD arguments differs from the dense evaluation"


@pytest.mark.parametrize("name", BUILDERS)
def test_theta_one_keeps_every_layer_unscaled(name):
    model = BUILDERS[name]().train()
    batch = _batch(model)
    assert_close(model(**batch, progressive_layer_drop=True, pld_theta=1.0), model(**batch),
                 name=f"{name}: training loss with theta 1 vs dense")


@pytest.mark.parametrize("name", BUILDERS)
def test_training_drops_layers_and_a_dropped_layer_gets_no_gradient(name):
    model = BUILDERS[name]().train()
    batch = _batch(model)
    no_layers = copy.deepcopy(model)
    no_layers.layers = nn.ModuleList()  # what the model computes when every layer is skipped
    skip_all = no_layers(**batch)
    dense = model(**batch).detach()
    torch.manual_seed(1)
    dropped_counts = [0] * LAYERS
    all_dropped = 0
    for _ in range(20):
        model.zero_grad(set_to_none=True)
        loss = model(**batch, progressive_layer_drop=True, pld_theta=0.05)
        loss.backward()
        dropped = [all(p.grad is None for p in layer.parameters()) for layer in model.layers]
        kept_with_grad = [all(p.grad is not None for p in layer.parameters()) for layer in model.layers]
        assert all(d != k for d, k in zip(dropped, kept_with_grad)), "a layer got gradients for some parameters only"
        dropped_counts = [c + d for c, d in zip(dropped_counts, dropped)]
        if all(dropped):
            all_dropped += 1
            assert_close(loss, skip_all, name=f"{name}: every layer dropped vs the model without layers")
        elif any(dropped):
            assert not torch.equal(loss.detach(), dense), f"{name}: layers {dropped} dropped, yet the dense loss"
    # keep probabilities 1 - l/3 * 0.95 = 0.68, 0.37, 0.05: the deeper a layer, the more often it drops
    assert dropped_counts[0] < dropped_counts[1] < dropped_counts[2], dropped_counts
    assert dropped_counts[2] >= 15 and all_dropped >= 1, (dropped_counts, all_dropped)


@pytest.mark.parametrize("name", BUILDERS)
def test_pld_without_theta_is_a_clear_error(name):
    model = BUILDERS[name]().train()
    with pytest.raises(ValueError, match="pld_theta"):
        model(**_batch(model), progressive_layer_drop=True)


def test_the_pld_switch_sets_the_engine_section():
    on = load_train_config(None, pld=True)
    assert on.engine["progressive_layer_drop"] == {"enabled": True}
    assert load_train_config(None).engine == DEFAULT_ENGINE, "the built-in job is dense"
    assert load_train_config(None, model="gpt", pld=True).engine["progressive_layer_drop"] == {"enabled": True}
    mine = {"engine": {**DEFAULT_ENGINE, "progressive_layer_drop": {"enabled": True, "theta": 0.3, "gamma": 0.01}}}
    assert load_train_config(mine, pld=False).engine["progressive_layer_drop"] == {
        "enabled": False, "theta": 0.3, "gamma": 0.01}, "--no-pld keeps theta and gamma"
    assert load_train_config(mine).engine["progressive_layer_drop"]["enabled"] is True
    with pytest.raises(ConfigError, match="engine.progressive_layer_drop` must be a JSON object"):
        load_train_config({"engine": {**DEFAULT_ENGINE, "progressive_layer_drop": True}}, pld=True)


def test_the_pld_switch_reaches_the_ranks_through_torchrun():
    import argparse

    from tachyon.train.cli import add_arguments, launch_command

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert launch_command(parser.parse_args(["--pld"]), 2, Path("o"))[8:] == ["--output-dir", "o", "--pld"]
    assert launch_command(parser.parse_args(["--no-pld"]), 2, Path("o"))[8:] == ["--output-dir", "o", "--no-pld"]
    assert launch_command(parser.parse_args([]), 2, Path("o"))[8:] == ["--output-dir", "o"]  # the config decides


def test_the_pld_example_is_the_default_job_with_pld_on():
    examples = Path(__file__).resolve().parents[2] / "examples"
    pld = json.loads((examples / "train_bert_pld.json").read_text())
    dense = json.loads((examples / "train_bert_cpu.json").read_text())
    assert pld["engine"].pop("progressive_layer_drop") == {"enabled": True, "theta": 0.5, "gamma": 0.001}
    assert pld.pop("eval_interval") == 10 and dense.pop("eval_interval") == 50
    assert pld == dense, "the PLD example must differ from the default job only in PLD and the evaluation interval"


def test_time_to_loss_sums_the_training_time_up_to_the_first_crossing():
    metrics = [{"step": s, "step_time_s": 0.5, "cpu_s": 1.0 + s} for s in range(1, 7)]
    validation = [{"step": 2, "loss": 5.0}, {"step": 4, "loss": 4.0}, {"step": 6, "loss": 3.0}]
    assert time_to_loss(metrics, validation, 4.5) == {"step": 4, "loss": 4.0, "step_time_s": 2.0, "cpu_s": 14.0}
    assert time_to_loss(metrics, validation, 3.0)["step"] == 6  # at the target counts as reaching it
    assert time_to_loss(metrics, validation, 2.9) is None
    with pytest.raises(ValueError, match="every step 1..4"):
        time_to_loss(metrics[1:], validation, 4.5)


def test_compare_runs_prints_the_time_to_the_reference_loss(tmp_path):
    from tachyon.train.report import METRIC_COLUMNS, VALIDATION_COLUMNS, write_rows

    def run(name: str, step_time: float, losses: dict[int, float]) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        metrics = [{"step": s, "loss": 0.0, "lr": 0.0, "grad_norm": 0.0, "loss_scale": 1.0, "samples_per_s": 1.0,
                    "tokens_per_s": 1.0, "step_time_s": step_time, "cpu_s": 2 * step_time} for s in range(1, 7)]
        write_rows(folder / "metrics.csv", metrics, 1, METRIC_COLUMNS)
        validation = [{"step": s, "loss": v, "accuracy": 0.0, "baseline_loss": 6.0, "baseline_accuracy": 0.0}
                      for s, v in losses.items()]
        write_rows(folder / "validation.csv", validation, 1, VALIDATION_COLUMNS)
        return folder

    dense = run("dense", 1.0, {3: 5.5, 6: 5.0})
    fast = run("fast", 0.5, {3: 4.9, 6: 4.8})
    slow = run("slow", 0.5, {3: 5.9, 6: 5.3})
    script = Path(__file__).resolve().parents[2] / "examples" / "compare_runs.py"
    proc = subprocess.run([sys.executable, str(script), str(dense), str(fast), str(slow)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.startswith(str(tmp_path))}
    assert "target validation loss: 5.000" in proc.stdout
    assert lines[str(dense)][1:6] == ["6", "6.0", "12.0", "1.00", "1.00"], proc.stdout
    assert lines[str(fast)][1:6] == ["3", "1.5", "3.0", "4.00", "4.00"], proc.stdout
    assert lines[str(slow)][1] == "never" and "+0.300 from the target" in proc.stdout, proc.stdout


# --- tiny runs of the command -------------------------------------------------------------------

STEPS, HALF = 6, 3
TINY = {"model": "bert", "hidden_size": 32, "num_layers": 2, "num_heads": 2, "seq_len": 16, "steps": STEPS,
        "checkpoint_interval": HALF, "eval_interval": HALF, "eval_batches": 1, "nproc": 2, "examples": 0,
        "engine": {"train_micro_batch_size_per_gpu": 4, "steps_per_print": STEPS,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2},
                   "progressive_layer_drop": {"theta": 0.2, "gamma": 0.3}}}
"""2 layers, 2 processes; a fast schedule (keep ratio 0.2 + 0.8 exp(-0.3 t)) so layers drop in 6 steps."""


@pytest.fixture(scope="module")
def pld_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pld_train")
    config = root / "tiny.json"
    config.write_text(json.dumps(TINY))
    output = run_train(str(config), "--pld", "--output-dir", str(root / "full"), "--no-progress")
    return root, config, output


@pytest.mark.distributed
def test_a_pld_run_logs_the_engines_keep_ratio_every_step(pld_run):
    root, _, output = pld_run
    rows = read_metrics(root / "full" / "metrics.csv")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    schedule = ProgressiveLayerDrop(theta=0.2, gamma=0.3)
    # DeepSpeed's timing: the forwards of step k (global_steps == k - 1 at its start) use theta(k - 2)
    want = [schedule.theta_at(max(step - 2, 0)) for step in range(1, STEPS + 1)]
    got = [r["pld_theta"] for r in rows]
    assert got == pytest.approx(want, rel=1e-5), f"keep ratio per step {got}, schedule {want}"
    assert got[0] == got[1] == 1.0 and all(a > b for a, b in zip(got[1:], got[2:])), got
    assert all(r["cpu_s"] > 0 and r["step_time_s"] > 0 for r in rows)
    assert "torch.distributed.run --standalone --nproc-per-node 2" in output and "--pld" in output
    summary = (root / "full" / "summary.txt").read_text()
    assert f"progressive layer drop: theta 0.2, gamma 0.3; keep ratio 1.000 at step 1 -> {want[-1]:.3f} " \
           f"at step {STEPS}" in summary, summary


@pytest.mark.distributed
def test_a_resume_continues_the_schedule_and_the_drop_decisions(pld_run):
    root, config, _ = pld_run
    full, resumed = root / "full", root / "resumed"
    # the run as it stood after step HALF: its checkpoint (named `latest`, DeepSpeed's layout) and CSVs
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / f"global_step{HALF}", resumed / "checkpoints" / f"global_step{HALF}")
    (resumed / "checkpoints" / "latest").write_text(f"global_step{HALF}")
    for name in ("metrics.csv", "validation.csv"):
        rows = [line for line in (full / name).read_text().splitlines()
                if not line[:1].isdigit() or int(line.split(",")[0]) <= HALF]
        (resumed / name).write_text("\n".join(rows) + "\n")
    run_train(str(config), "--pld", "--output-dir", str(resumed), "--resume", "--quiet")
    want, got = read_metrics(full / "metrics.csv"), read_metrics(resumed / "metrics.csv")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(want[HALF:], got[HALF:]):
        # each rank's layer-drop draws continue from its saved generator: the same layers run, so the
        # same losses and gradient norms, bit for bit (a different draw changes the loss, see the model tests)
        assert (b["step"], b["pld_theta"], b["loss"], b["grad_norm"]) == (a["step"], a["pld_theta"], a["loss"],
                                                                          a["grad_norm"]), (a, b)
    assert read_metrics(resumed / "validation.csv") == read_metrics(full / "validation.csv")

"""The train job's config (keys, errors, fill-ins into the engine section), the example configs
and the command's argument handling (output dir, torchrun command, exit codes)."""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tachyon.config import ConfigError, load_config
from tachyon.train.cli import add_arguments, launch_command, resolve_output_dir, run
from tachyon.train.config import DEFAULT_ENGINE, load_train_config, resolve_precision

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE_CONFIGS = sorted(EXAMPLES.glob("train_*.json"))


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_examples_are_there():
    names = {p.name for p in EXAMPLE_CONFIGS}
    assert {"train_bert_cpu.json", "train_gpt_cpu.json", "train_bert_gpu.json", "train_ci.json"} <= names
    assert (EXAMPLES / "README.md").is_file()


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("bf16", [True, False])
def test_every_example_config_is_valid_for_the_engine(path, bf16):
    config = load_train_config(path)
    precision = config.training_precision(bf16_available=bf16)
    engine = config.engine_config(precision)
    checked = load_config(engine, world_size=config.nproc)
    assert checked.precision == precision
    assert checked.train_micro_batch_size_per_gpu >= 1


@pytest.mark.parametrize("model", ["bert", "gpt"])
def test_the_default_examples_are_the_built_in_jobs(model):
    # `tachyon train [--model M]` from an installed package (no examples/) trains the same job
    assert load_train_config(EXAMPLES / f"train_{model}_cpu.json") == load_train_config(None, model=model)
    assert load_train_config(None, model=model).model == model


def test_model_overrides_a_config_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model": "bert", "steps": 10}))
    assert load_train_config(path, model="gpt").model == "gpt"
    with pytest.raises(ConfigError, match="model must be one of bert, gpt; got 't5'"):
        load_train_config(None, model="t5")


def test_defaults_and_fill_ins():
    config = load_train_config(None)
    assert config.model == "bert" and config.nproc == 2 and config.engine == DEFAULT_ENGINE
    engine = config.engine_config("bf16")
    assert engine["bf16"] == {"enabled": True} and "fp16" not in engine
    assert engine["scheduler"]["params"]["total_num_steps"] == config.steps
    assert engine["zero_optimization"]["stage"] == 2 and engine["seed"] == 0
    assert "bf16" not in config.engine_config("fp32")
    given = load_train_config({"steps": 50, "engine": {**DEFAULT_ENGINE, "scheduler": {
        "type": "WarmupDecayLR", "params": {"total_num_steps": 80}}}})
    assert given.engine_config("fp32")["scheduler"]["params"]["total_num_steps"] == 80
    assert resolve_precision("auto", True) == "bf16" and resolve_precision("auto", False) == "fp32"
    assert resolve_precision("fp16", True) == "fp16"


def test_overrides_apply_on_top_of_the_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model": "gpt", "steps": 10}))
    config = load_train_config(path, steps=25, output_dir=None)
    assert (config.model, config.steps, config.objective) == ("gpt", 25, "causal")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"stpes": 10}, "unknown key 'stpes'; did you mean 'steps'"),
        ({"steps": "10"}, "`steps`"),
        ({"steps": 0}, "`steps`"),
        ({"model": "t5"}, "`model`"),
        ({"hidden_size": 100, "num_heads": 3}, "divisible"),
        ({"kernel_flags": {"gelu_chekpoint": True}}, "did you mean 'gelu_checkpoint'"),
        ({"model": "gpt", "kernel_flags": {"gelu_checkpoint": True}}, "model 'bert' only"),
        ({"position": "rope"}, "model 'gpt' only"),
        ({"hidden_dropout": 1.5}, "`hidden_dropout`"),
        ({"tokenizer": "wordpiece"}, "tokenizer must be \"bpe\", \"byte\" or the path of a tokenizer.json"),
        ({"eval_batches": 0}, "`eval_batches`"),
    ],
)
def test_bad_config_raises_config_error_naming_the_key(raw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("`", "`")):
        load_train_config(raw)


def test_precision_conflict_with_the_engine_section():
    config = load_train_config({"precision": "fp32", "engine": {**DEFAULT_ENGINE, "bf16": {"enabled": True}}})
    assert config.training_precision(bf16_available=False) == "bf16"  # the engine's section wins over "auto"
    with pytest.raises(ConfigError, match="precision"):
        config.engine_config("bf16")
    auto = load_train_config({"engine": {**DEFAULT_ENGINE, "fp16": {"enabled": True}}})
    assert auto.training_precision(bf16_available=True) == "fp16"
    assert auto.engine_config("fp16")["fp16"] == {"enabled": True}


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_train_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{steps: 1}")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_train_config(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_train_config(bad)
    bad.write_bytes('{"model": "bert", "output_dir": "r\u00e9sum\u00e9"}'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"bad\.json: not UTF-8 text \(byte \d+"):
        load_train_config(bad)


def test_engine_config_file_not_utf8_names_the_file(tmp_path):
    from tachyon.config import load_config

    path = tmp_path / "ds.json"
    path.write_bytes('{"train_batch_size": 1, "x": "\u00e9"}'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"ds\.json: not UTF-8 text"):
        load_config(path)


def test_resolve_output_dir(tmp_path):
    assert resolve_output_dir("x/y", "bert", resume=True, root=tmp_path) == Path("x/y")
    fresh = resolve_output_dir(None, "bert", resume=False, root=tmp_path)
    assert fresh.parent == tmp_path and fresh.name.startswith("bert-")
    for name in ("bert-20260101-000000", "bert-20260102-000000", "gpt-20260103-000000"):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
    (tmp_path / "bert-20260104-000000").mkdir()  # no checkpoints: not resumable
    assert resolve_output_dir(None, "bert", resume=True, root=tmp_path).name == "bert-20260102-000000"
    assert resolve_output_dir(None, "gpt", resume=True, root=tmp_path).name == "gpt-20260103-000000"


def test_launch_command_reexecutes_through_torchrun():
    cmd = launch_command(_args("examples/train_ci.json", "--resume", "--steps", "40"), 2, Path("runs/x"))
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    assert cmd[6:8] == ["-m", "tachyon.train"]
    assert cmd[8:] == ["examples/train_ci.json", "--output-dir", "runs/x", "--steps", "40", "--resume"]
    assert launch_command(_args(), 4, Path("o"))[8:] == ["--output-dir", "o"]
    assert launch_command(_args("--model", "gpt", "--quiet", "--no-progress"), 2, Path("o"))[8:] == [
        "--model", "gpt", "--output-dir", "o", "--no-progress", "--quiet"]


def test_run_reports_a_bad_config_with_exit_code_2(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"modle": "bert"}))
    assert run(_args(str(path))) == 2
    assert "did you mean 'model'" in capsys.readouterr().err
    assert run(_args(str(path.with_name("nope.json")))) == 2
    assert run(_args(str(EXAMPLES / "train_ci.json"), "--nproc", "0")) == 2
    path.write_text(json.dumps({"engine": {"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2}}))
    assert run(_args(str(path), "--nproc", "2")) == 2  # the engine section is checked before launching
    assert "train_batch_size" in capsys.readouterr().err


def test_a_resumed_epoch_continues_with_the_next_unseen_micro_batch():
    from torch.utils.data import DistributedSampler

    from tachyon.data import MaskedLMDataset, load_tokenizer
    from tachyon.train.helpers import epoch_loader as _epoch_loader

    byte = load_tokenizer("byte")
    data = MaskedLMDataset(byte.encode_tensor("To be, or not to be, that is the question. " * 12), 16, seed=3,
                           tokenizer=byte)
    for rank in (0, 1):
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, seed=5)
        full = list(_epoch_loader(data, sampler, epoch=1, skip_batches=0, micro_batch=3))
        resumed = list(_epoch_loader(data, sampler, epoch=1, skip_batches=2, micro_batch=3))
        assert len(resumed) == len(full) - 2 >= 1
        for a, b in zip(full[2:], resumed):
            assert all(bool((a[k] == b[k]).all()) for k in a)
        other_epoch = list(_epoch_loader(data, sampler, epoch=2, skip_batches=0, micro_batch=3))
        assert any(bool((a["input_ids"] != b["input_ids"]).any()) for a, b in zip(full, other_epoch))


def test_on_a_gpu_machine_the_same_command_uses_every_gpu(monkeypatch):
    import torch

    from tachyon.train.cli import _process_count

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert _process_count(_args(), 2) == 8
    assert _process_count(_args("--nproc", "3"), 2) == 3  # an explicit --nproc wins
    config = load_train_config(EXAMPLES / "train_bert_cpu.json")
    # the default config names a micro-batch, not a global batch, so it is valid on any GPU count
    assert load_config(config.engine_config("bf16"), world_size=8).train_batch_size == 8 * 64


def test_on_a_cpu_machine_the_config_decides(monkeypatch):
    import torch

    from tachyon.train.cli import _process_count

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _process_count(_args(), 2) == 2


def test_help_shows_every_option_with_its_default():
    from tachyon.cli import build_parser

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    for action in train._actions:
        if action.dest == "help":
            continue
        assert action.help and "(default:" in action.help, f"{action.option_strings or action.dest}: {action.help!r}"
    text = train.format_help()
    for option in ("--model", "--steps", "--nproc", "--output-dir", "--resume", "--no-progress", "--quiet"):
        assert option in text, f"{option} missing from `tachyon train --help`"


def test_a_missing_train_dependency_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    assert run(_args()) == 2
    err = capsys.readouterr().err
    assert "matplotlib is not installed" in err and "pip install 'tachyon[train]'" in err


def test_the_tachyon_command_and_tachyon_data_import_without_the_train_extra():
    script = (
        "import sys\n"
        "sys.modules['tokenizers'] = sys.modules['matplotlib'] = None\n"
        "from tachyon.cli import main\n"
        "from tachyon.data import padded_vocab_size\n"
        "assert padded_vocab_size(100) == 128\n"
        "sys.exit(main(['train', '--steps', '5']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "tachyon train: error: matplotlib and tokenizers are not installed" in proc.stderr
    assert "pip install 'tachyon[train]'" in proc.stderr and "Traceback" not in proc.stderr


def test_tp_and_pp_set_the_engine_sections_and_fit_the_pipeline():
    config = load_train_config(model="gpt", tp=2, pp=2)
    engine = config.engine_config("fp32")
    assert engine["tensor_parallel"] == {"tp_size": 2} and engine["pipeline"] == {"stages": 2}
    assert (config.tensor_parallel_size, config.pipeline_stages) == (2, 2)
    # the GPT job's ZeRO-2 becomes 1 under a pipeline, and its micro-batch of 16 becomes 2 x 8
    assert engine["zero_optimization"]["stage"] == 1
    assert (engine["train_micro_batch_size_per_gpu"], engine["gradient_accumulation_steps"]) == (8, 2)
    checked = load_config(engine, world_size=4)
    assert (checked.tensor_parallel.size, checked.pipeline.num_stages, checked.train_batch_size) == (2, 2, 16)
    # tp alone changes nothing else; pp 1 neither
    alone = load_train_config(model="gpt", tp=2, pp=1).engine_config("fp32")
    assert alone["zero_optimization"]["stage"] == 2 and alone["gradient_accumulation_steps"] == 1
    assert alone["pipeline"] == {"stages": 1}
    # a config's own pipeline keys are kept; enough micro-batches already: untouched
    raw = {"model": "gpt", "engine": {**DEFAULT_ENGINE, "gradient_accumulation_steps": 4,
                                      "pipeline": {"schedule": "GPipe"}}}
    kept = load_train_config(raw, pp=2).engine_config("fp32")
    assert kept["pipeline"] == {"schedule": "GPipe", "stages": 2} and kept["gradient_accumulation_steps"] == 4
    assert kept["train_micro_batch_size_per_gpu"] == DEFAULT_ENGINE["train_micro_batch_size_per_gpu"]


@pytest.mark.parametrize("kwargs, message", [
    ({"model": "bert", "tp": 2}, "apply to model 'gpt' only"),
    ({"model": "bert", "pp": 2}, "apply to model 'gpt' only"),
    ({"model": "gpt", "tp": 0}, "--tp must be an int >= 1"),
    ({"model": "gpt", "pp": 2, "pld": True}, "progressive layer drop with pipeline parallelism"),
])
def test_bad_layouts_are_refused_before_any_work(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(**kwargs)


def test_tp_and_pp_choose_the_process_count_and_travel_to_the_ranks(monkeypatch, capsys):
    import torch

    from tachyon.train.cli import _process_count

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _process_count(_args(), 2, model_parallel=4) == 4
    assert _process_count(_args(), 6, model_parallel=4) == 8
    assert _process_count(_args("--nproc", "3"), 2, model_parallel=4) == 3  # checked (and refused) by the engine
    cmd = launch_command(_args("--model", "gpt", "--tp", "2", "--pp", "2"), 4, Path("o"))
    assert cmd[8:] == ["--model", "gpt", "--output-dir", "o", "--tp", "2", "--pp", "2"]
    # 3 processes cannot hold tp 2 x pp 2: refused before launching, naming the sizes
    assert run(_args("--model", "gpt", "--tp", "2", "--pp", "2", "--nproc", "3")) == 2
    err = capsys.readouterr().err
    assert "3" in err and ("tp_size" in err or "stages" in err), err


def test_fp8_recipe_option_is_checked_and_travels_to_the_ranks():
    """--fp8 {delayed,current,block}: TrainConfig.fp8 (model gpt, no pipeline, seq_len a multiple
    of 16), forwarded to torchrun's ranks, and the autocast each forward of the job runs in."""
    from tachyon.fp8 import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
    from tachyon.train.run import fp8_autocast

    assert load_train_config(model="gpt", fp8="block").fp8 == "block"
    assert load_train_config(model="gpt").fp8 is None
    for kwargs in ({"model": "bert", "fp8": "current"}, {"model": "gpt", "fp8": "current", "pp": 2},
                   {"model": "gpt", "fp8": "current", "seq_len": 40}):
        with pytest.raises(ConfigError, match="fp8 'current' applies to model 'gpt' without pipeline stages"):
            load_train_config(**kwargs)
    with pytest.raises(ConfigError, match="fp8"):
        load_train_config(model="gpt", fp8="mxfp8")
    cmd = launch_command(_args("--model", "gpt", "--fp8", "current"), 2, Path("o"))
    assert cmd[8:] == ["--model", "gpt", "--output-dir", "o", "--fp8", "current"]
    recipes = {"delayed": DelayedScaling, "current": Float8CurrentScaling, "block": Float8BlockScaling}
    for name, cls in recipes.items():
        context = fp8_autocast(name)()
        assert context.settings.enabled and isinstance(context.recipe, cls)
    assert fp8_autocast("delayed")().recipe.amax_history_len == 16
    assert isinstance(fp8_autocast(None)(), contextlib.nullcontext)  # no FP8: nothing around the forwards


def test_threads_follow_the_usable_cpus_not_the_host(monkeypatch, tmp_path):
    """A container limited to 2 CPUs on a 64-core host: os.cpu_count() says 64, the job must use 2."""
    import os

    from tachyon.train import helpers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    quota = tmp_path / "cpu.max"
    quota.write_text("200000 100000\n")
    assert helpers.usable_cpus(quota) == 2
    quota.write_text("max 100000\n")
    assert helpers.usable_cpus(quota) == 64
    assert helpers.usable_cpus(tmp_path / "absent") == 64

"""Checkpoint faults in one process: a disk that fills while the shards are written or while
``latest`` is rewritten, a meta.json that passes the manifest but lacks a key, a checkpoint whose
optimizer settings differ from the config's; and DeepSpeed's save/load arguments and return
values (save_checkpoint returns True; load returns (path, client_state), (None, None) when there
is nothing; load_module_strict, exclude_frozen_parameters)."""

from __future__ import annotations

import errno
import hashlib
import json
import logging

import pytest
import torch

import tachyon
from tachyon.engine.checkpoint import CheckpointError
from tachyon.engine.checkpoint import manifest as mf
from tachyon.engine.checkpoint import save as save_module
from tests.engine.test_checkpoint import _state, make_engine, make_model, train


def _no_space(path) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


def test_a_disk_that_fills_while_the_shards_are_written_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    engine = make_engine(stage=2)
    train(engine, 2)
    assert engine.save_checkpoint(tmp_path) is True  # DeepSpeed's return value

    class FullDisk(save_module.dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            raise _no_space(f"{self.path}/__0_0.distcp")

    monkeypatch.setattr(save_module.dcp, "FileSystemWriter", FullDisk)
    train(engine, 1)
    with pytest.raises(CheckpointError) as info:  # an Exception: `except Exception` catches it
        engine.save_checkpoint(tmp_path)
    message = str(info.value)
    assert isinstance(info.value, Exception)
    assert f"saving checkpoint {tmp_path / 'global_step3'} (step 3) failed: rank 0 could not write " in message
    assert "__0_0.distcp: OSError: [Errno 28] No space left on device" in message or "ENOSPC" in message, message
    assert "the previous checkpoints and `latest` are unchanged" in message
    assert "Traceback" not in message
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step2", "latest"], "the unfinished save was left"
    fresh = make_engine(stage=2)
    assert fresh.load_checkpoint(tmp_path)[0] == str(tmp_path / "global_step2")


def test_when_only_latest_cannot_be_written_the_message_says_the_checkpoint_was_saved(tmp_path, monkeypatch):
    engine = make_engine()
    train(engine, 2)
    engine.save_checkpoint(tmp_path)

    def full(save_dir, tag):
        raise _no_space(save_dir / mf.LATEST)

    monkeypatch.setattr(mf, "write_latest", full)
    train(engine, 1)
    with pytest.raises(CheckpointError, match=r"checkpoint .*global_step3 \(step 3\) was saved completely, but rank 0 "
                                              r"could not update .*latest \(.*ENOSPC\]: No space left on device\); "
                                              r"`latest` still names 'global_step2': load the new one with "
                                              r"load_checkpoint\(.*, tag='global_step3'\)"):
        engine.save_checkpoint(tmp_path)
    assert make_engine().load_checkpoint(tmp_path, tag="global_step3")[0] == str(tmp_path / "global_step3")


def _rewrite_meta(ckpt, edit) -> None:
    """Change meta.json and fix its manifest entry (a checkpoint that passes the manifest check)."""
    meta = json.loads((ckpt / "meta.json").read_text())
    edit(meta)
    data = json.dumps(meta).encode()
    (ckpt / "meta.json").write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["meta.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m.pop("skipped_steps"), r"meta.json: key 'skipped_steps' is missing"),
    (lambda m: m.update(global_steps="2"), r"meta.json: key 'global_steps' should be a JSON int; got str"),
    (lambda m: m["precision_state"].update(name="fp16"), r"precision_state does not fit this engine's fp32 precision"),
    (lambda m: m["optimizer"]["groups"][0].pop("flat"), r"optimizer.groups\[0\] should hold the dicts"),
])
def test_a_meta_json_that_passes_the_manifest_but_is_malformed_changes_nothing(tmp_path, edit, message):
    engine = make_engine()
    train(engine, 2)
    engine.save_checkpoint(tmp_path)
    _rewrite_meta(tmp_path / "global_step2", edit)
    other = make_engine()
    train(other, 1)
    before = _state(other)
    with pytest.raises(CheckpointError, match=message):
        other.load_checkpoint(tmp_path)
    assert other.global_steps == 1 and all(torch.equal(a, b) for a, b in zip(before, _state(other)))


def _adam_engine(kind: str, weight_decay: float, adam_w_mode: bool | None = None):
    params = {"lr": 1e-2, "weight_decay": weight_decay}
    if adam_w_mode is not None:
        params["adam_w_mode"] = adam_w_mode
    config = {"train_batch_size": 4, "optimizer": {"type": kind, "params": params}}
    return tachyon.initialize(model=make_model(), config=config)[0]


def test_the_configs_optimizer_settings_win_and_every_difference_is_reported(tmp_path, caplog):
    saved = _adam_engine("Adam", 0.1, adam_w_mode=False)
    train(saved, 2)
    saved.save_checkpoint(tmp_path)
    resumed = _adam_engine("AdamW", 0.01)
    with caplog.at_level(logging.WARNING, logger="tachyon.checkpoint"):
        resumed.load_checkpoint(tmp_path)
    group = resumed.optimizer.param_groups[0]
    assert group["weight_decay"] == 0.01 and group["adam_w_mode"] is True
    assert resumed.global_steps == 2 and len(resumed.optimizer.state) == 1  # the moments did load
    report = " ".join(r.getMessage() for r in caplog.records)
    assert "optimizer settings differ from the checkpoint's and are kept (the config wins)" in report
    assert "group 0: weight_decay 0.1 (checkpoint) -> 0.01 (kept)" in report
    assert "group 0: adam_w_mode False (checkpoint) -> True (kept)" in report


def test_deepspeed_load_arguments(tmp_path):
    engine = make_engine()
    train(engine, 2)
    engine.save_checkpoint(tmp_path, client_state={"epoch": 7})
    weights = [p.detach().clone() for p in engine.module.parameters()]
    only = make_engine()
    assert only.load_checkpoint(tmp_path, load_module_only=True) == (str(tmp_path / "global_step2"), {"epoch": 7})
    assert only.global_steps == 0 and len(only.optimizer.state) == 0
    assert all(torch.equal(a, b) for a, b in zip(only.module.parameters(), weights))
    with pytest.raises(ValueError, match="custom_load_fn=...\\) is not supported"):
        only.load_checkpoint(tmp_path, custom_load_fn=lambda src, dst: None)
    with pytest.warns(UserWarning, match="does not exist; nothing loaded, returning \\(None, None\\)"):
        assert only.load_checkpoint(tmp_path / "missing") == (None, None)

    # load_module_strict=False: a model with a parameter the checkpoint lacks keeps its own value
    wider = make_engine()
    wider.module.add_module("extra", torch.nn.Linear(2, 2))
    wider = tachyon.initialize(model=wider.module, config={"train_batch_size": 4,
                                                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})[0]
    extra = wider.module.extra.weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"missing \['extra.weight', 'extra.bias'\]"):
        wider.load_checkpoint(tmp_path)
    wider.load_checkpoint(tmp_path, load_module_strict=False)
    assert torch.equal(wider.module.extra.weight, extra) and torch.equal(wider.module[0].weight, weights[0])


def test_exclude_frozen_parameters_leaves_them_to_the_model(tmp_path):
    engine = make_engine()
    train(engine, 1)
    engine.save_checkpoint(tmp_path, exclude_frozen_parameters=True)
    meta = json.loads((tmp_path / "global_step1" / "meta.json").read_text())
    assert "3.bias" not in meta["model_keys"] and meta["exclude_frozen_parameters"] is True
    other = make_engine()
    with torch.no_grad():
        other.module[3].bias.fill_(0.5)
    other.load_checkpoint(tmp_path)
    assert torch.equal(other.module[3].bias, torch.full_like(other.module[3].bias, 0.5))
    assert torch.equal(other.module[0].weight, engine.module[0].weight)

"""Checkpoints in one process: what survives a save/load (fp16 loss scale, skipped steps,
scheduler, RNG, client state), what load_optimizer_states / load_module_only leave alone,
what is refused (bad client state, incomplete, corrupted or mismatching checkpoints, pickled
objects), and the exports (a strict state_dict; an HF model that from_pretrained loads).

The multi-rank protocol (resharding, a killed save, ranks agreeing) is in
test_checkpoint_distributed.py.
"""

from __future__ import annotations

import json
import pickle
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tachyon
from tachyon.engine.checkpoint import CheckpointError, export_model_state_dict, save_16bit_model
from tachyon.engine.checkpoint.manifest import SafeFileSystemReader, torch_load_safe
from tests.utils import assert_close

IN, HIDDEN, OUT = 6, 13, 3


def make_model(hidden: int = HIDDEN) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(4321)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN, hidden), torch.nn.GELU(), torch.nn.BatchNorm1d(hidden), torch.nn.Linear(hidden, OUT)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    model[3].bias.requires_grad_(False)  # a frozen parameter travels as model state
    return model


def make_engine(precision: str = "fp32", stage: int = 1, optimizer: str = "AdamW", hidden: int = HIDDEN):
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "train_batch_size": 4,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": optimizer, "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-2}},
    }
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = tachyon.initialize(model=make_model(hidden), config=config)
    return engine


def train(engine, steps: int, poison_at: tuple[int, ...] = ()) -> None:
    dtype = engine.precision.model_dtype
    for _ in range(steps):
        step = engine.global_steps
        gen = torch.Generator().manual_seed(900 + step)
        x, y = torch.randn(4, IN, generator=gen), torch.randn(4, OUT, generator=gen)
        loss = F.mse_loss(engine(x.to(engine.device, dtype)).float(), y.to(engine.device))
        if step in poison_at:  # an inf gradient: fp16 skips the step
            loss = loss * torch.tensor(float("inf"), device=engine.device)
        engine.backward(loss)
        engine.step()


def test_fp16_scale_skipped_steps_scheduler_rng_and_client_state_survive(tmp_path):
    engine = make_engine("fp16")
    train(engine, 4, poison_at=(1,))
    assert engine.skipped_steps == 1
    assert engine.loss_scale == 2.0**7  # halved at the overflow; DeepSpeed doubles on the 3rd clean step after it
    engine.save_checkpoint(tmp_path, client_state={"epoch": 2, "ids": torch.arange(4), "nested": [{"a": None}]})
    expected_rng = (torch.rand(5), random.random(), np.random.rand())
    expected = {
        "scaler": engine.precision.scaler.state_dict(), "lr": engine.get_lr(),
        "scheduler": engine.lr_scheduler.state_dict(), "masters": [m.detach().clone() for m in engine.zero.masters],
        "exp_avg": engine.optimizer.state[engine.zero.masters[0]]["exp_avg"].clone(),
        "model": [t.clone() for t in engine.module.state_dict().values()],
    }

    fresh = make_engine("fp16")
    path, client = fresh.load_checkpoint(tmp_path)
    assert path == str(tmp_path / "global_step4")
    assert client["epoch"] == 2 and torch.equal(client["ids"], torch.arange(4)) and client["nested"] == [{"a": None}]
    assert (fresh.global_steps, fresh.micro_steps, fresh.skipped_steps) == (4, 4, 1)
    assert fresh.precision.scaler.state_dict() == expected["scaler"] and fresh.loss_scale == 2.0**7
    assert fresh.lr_scheduler.state_dict() == expected["scheduler"] and fresh.get_lr() == expected["lr"]
    for got, want in zip(fresh.zero.masters, expected["masters"]):
        assert torch.equal(got, want)
    assert torch.equal(fresh.optimizer.state[fresh.zero.masters[0]]["exp_avg"], expected["exp_avg"])
    for got, want in zip(fresh.module.state_dict().values(), expected["model"]):  # incl. BatchNorm buffers
        assert torch.equal(got, want)
    assert torch.equal(torch.rand(5), expected_rng[0])
    assert random.random() == expected_rng[1] and np.random.rand() == expected_rng[2]
    train(engine, 2)
    train(fresh, 2)
    for a, b in zip(engine.module.parameters(), fresh.module.parameters()):
        assert torch.equal(a, b)


def test_optimizer_states_can_be_left_fresh_and_module_only_loads_weights(tmp_path):
    engine = make_engine()
    train(engine, 3)
    engine.save_checkpoint(tmp_path)
    weights = [p.detach().clone() for p in engine.module.parameters()]

    fresh = make_engine()
    fresh.load_checkpoint(tmp_path, load_optimizer_states=False)
    assert len(fresh.optimizer.state) == 0, "load_optimizer_states=False must leave the optimizer fresh"
    assert fresh.global_steps == 3 and fresh.lr_scheduler.last_batch_iteration == 2
    for a, b in zip(fresh.module.parameters(), weights):
        assert torch.equal(a, b)

    only = make_engine()
    only.load_checkpoint(tmp_path, load_module_only=True, load_lr_scheduler_states=False)
    assert len(only.optimizer.state) == 0 and only.global_steps == 0
    assert only.lr_scheduler.last_batch_iteration == make_engine().lr_scheduler.last_batch_iteration
    for a, b in zip(only.module.parameters(), weights):
        assert torch.equal(a, b)


def test_client_state_must_be_json_data_or_tensors(tmp_path):
    engine = make_engine()
    with pytest.raises(ValueError, match=r"client_state\['cfg'\]\[1\] is a object; checkpoints store only JSON"):
        engine.save_checkpoint(tmp_path, client_state={"cfg": [1, object()]})
    with pytest.raises(ValueError, match="has a key 3 of type int"):
        engine.save_checkpoint(tmp_path, client_state={3: "x"})
    assert not tmp_path.exists() or not any(tmp_path.iterdir()), "a refused save writes nothing"
    with pytest.raises(ValueError, match="not a valid checkpoint tag"):
        engine.save_checkpoint(tmp_path, tag="../escape")


def _state(engine) -> list[torch.Tensor]:
    out = [t.clone() for t in engine.module.state_dict().values()] + [m.detach().clone() for m in engine.zero.masters]
    return out + [v.clone() for v in engine.optimizer.state[engine.zero.masters[0]].values()]


def test_bad_checkpoints_are_refused_naming_the_file_and_change_nothing(tmp_path):
    engine = make_engine()
    assert engine.load_checkpoint(tmp_path / "nothing") == (None, None)
    train(engine, 2)
    engine.save_checkpoint(tmp_path)
    ckpt = tmp_path / "global_step2"
    other = make_engine()
    train(other, 1)
    before = _state(other)

    meta = ckpt / "meta.json"
    original = meta.read_bytes()
    meta.write_bytes(original.replace(b'"global_steps": 2', b'"global_steps": 9'))
    with pytest.raises(CheckpointError, match=r"meta.json is corrupted: its sha256 differs"):
        other.load_checkpoint(tmp_path)
    meta.write_bytes(original[:-5])
    with pytest.raises(CheckpointError, match=r"meta.json has \d+ bytes; the manifest says \d+ \(truncated"):
        other.load_checkpoint(tmp_path)
    meta.write_bytes(original)
    (ckpt / "rng" / "rank_00000.pt").unlink()
    with pytest.raises(CheckpointError, match=r"rank_00000.pt is missing"):
        other.load_checkpoint(tmp_path)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest.json is missing: .* is not a complete tachyon checkpoint"):
        other.load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"global_step7 does not exist"):
        other.load_checkpoint(tmp_path, tag="global_step7")
    assert other.global_steps == 1
    for a, b in zip(before, _state(other)):
        assert torch.equal(a, b)


def test_a_checkpoint_that_does_not_fit_is_refused(tmp_path):
    engine = make_engine()
    train(engine, 1)
    engine.save_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"parameter '0.weight' has shape \(13, 6\) in the checkpoint and \(9, 6\)"):
        make_engine(hidden=9).load_checkpoint(tmp_path)
    lamb = make_engine(optimizer="Lamb")
    with pytest.raises(CheckpointError, match="holds FusedAdam state; this engine's optimizer is Lamb"):
        lamb.load_checkpoint(tmp_path)
    lamb.load_checkpoint(tmp_path, load_optimizer_states=False)
    assert lamb.global_steps == 1


def test_saving_a_tag_again_replaces_it(tmp_path):
    engine = make_engine(stage=2)
    train(engine, 1)
    engine.save_checkpoint(tmp_path, tag="best")
    train(engine, 1)
    engine.save_checkpoint(tmp_path, tag="best", save_latest=False)
    assert (tmp_path / "latest").read_text() == "best"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "latest"]
    fresh = make_engine(stage=2)
    fresh.load_checkpoint(tmp_path)
    assert fresh.global_steps == 2


def test_a_save_that_dies_before_the_rename_is_never_loaded(tmp_path, monkeypatch):
    """Single-process stand-in for the SIGKILL test at the last step: the manifest is written
    but the directory not yet renamed. The previous checkpoint stays the one that loads."""
    from tachyon.engine.checkpoint import save as save_module

    engine = make_engine(stage=2)
    train(engine, 1)
    engine.save_checkpoint(tmp_path)
    train(engine, 1)

    def die(stage: str) -> None:
        if stage == "manifest":
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(save_module, "_PAUSE_HOOK", die)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(tmp_path)
    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp.global_step2.")]
    assert len(partial) == 1 and (partial[0] / "manifest.json").is_file()
    assert (tmp_path / "latest").read_text() == "global_step1" and not (tmp_path / "global_step2").exists()
    with pytest.raises(ValueError, match="not a valid checkpoint tag"):
        engine.load_checkpoint(tmp_path, tag=partial[0].name)
    fresh = make_engine(stage=2)
    assert fresh.load_checkpoint(tmp_path)[0] == str(tmp_path / "global_step1") and fresh.global_steps == 1
    monkeypatch.setattr(save_module, "_PAUSE_HOOK", None)
    engine.save_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step1", "global_step2", "latest"]


class _Evil:
    def __reduce__(self):
        return (print, ("unpickled!",))


def test_loading_never_unpickles_objects(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError, match="refers to builtins.print"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()
    torch.save({"x": _Evil()}, tmp_path / "extra.pt")
    with pytest.raises(CheckpointError, match="cannot be read as a weights-only torch file"):
        torch_load_safe(tmp_path / "extra.pt")


def test_export_state_dict_loads_strict_into_a_fresh_model(tmp_path):
    engine = make_engine("fp16", stage=2)
    train(engine, 3)
    engine.save_checkpoint(tmp_path)
    state = export_model_state_dict(tmp_path)
    assert list(state) == list(engine.module.state_dict())
    fresh = make_model()
    fresh.load_state_dict(state, strict=True)
    masters = engine.zero.masters[0]
    for (name, p), slot in zip(fresh.named_parameters(), engine.zero.flat.slots):
        if not p.requires_grad:
            continue
        assert p.dtype == torch.float32
        assert torch.equal(p.detach().reshape(-1), masters.detach()[slot.offset:slot.offset + slot.numel]), name
        assert torch.equal(p.detach().half(), slot.param.detach()), f"{name}: fp16 weights are the rounded masters"
    assert torch.equal(fresh[3].bias, engine.module[3].bias.float())
    assert torch.equal(fresh[2].running_mean, engine.module[2].running_mean.float())
    assert json.loads((tmp_path / "global_step3" / "meta.json").read_text())["zero_stage"] == 2


def test_hf_bert_exports_load_with_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config)
    engine, *_ = tachyon.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "train_batch_size": 2, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    })
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    path = save_16bit_model(engine, tmp_path / "hf")
    assert path == str(tmp_path / "hf" / "model.safetensors") and (tmp_path / "hf" / "config.json").is_file()
    assert engine.save_16bit_model(tmp_path / "hf2") == str(tmp_path / "hf2" / "model.safetensors")  # the DeepSpeed-named method
    assert (tmp_path / "hf2" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()

    loaded = transformers.BertForMaskedLM.from_pretrained(tmp_path / "hf")
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    model.eval()
    loaded.eval()
    with torch.no_grad():
        assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, name="logits")

    fresh = transformers.BertForMaskedLM(config)
    fresh.load_state_dict(export_model_state_dict(tmp_path / "ckpt"), strict=True)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh.cls.predictions.decoder.weight is fresh.bert.embeddings.word_embeddings.weight


@pytest.mark.gpu
def test_cuda_bf16_checkpoint_round_trip_and_export(tmp_path):
    engine = make_engine("bf16", stage=2)
    assert engine.device.type == "cuda"
    train(engine, 3)
    engine.save_checkpoint(tmp_path)
    expected_rand = torch.rand(4, device="cuda")
    fresh = make_engine("bf16", stage=2)
    fresh.load_checkpoint(tmp_path)
    assert torch.equal(torch.rand(4, device="cuda"), expected_rand), "CUDA RNG state restored"
    for a, b in zip(engine.zero.masters, fresh.zero.masters):
        assert torch.equal(a, b)
    train(engine, 2)
    train(fresh, 2)
    for a, b in zip(engine.module.parameters(), fresh.module.parameters()):
        assert torch.equal(a, b)
    state = export_model_state_dict(tmp_path)
    model = make_model()
    model.load_state_dict(state, strict=True)
    assert torch.equal(model[0].weight.to("cuda", torch.bfloat16), make_engine_weights(tmp_path))


def make_engine_weights(root) -> torch.Tensor:
    """The first layer's bf16 weight of an engine loaded from ``root``."""
    engine = make_engine("bf16", stage=2)
    engine.load_checkpoint(root, load_module_only=True)
    return engine.module[0].weight.detach()

"""checkpoint= forms: an HF folder (safetensors), one file, DeepSpeed's checkpoint json (dict or
file, split into parts), a tachyon training checkpoint; mismatched weights refused by name."""

from __future__ import annotations

import json

import pytest
import torch

import tachyon
from tests.inference.models import make_model, prompts
from tests.utils import assert_close


def _logits(engine):
    ids, mask = prompts()
    return engine(ids, attention_mask=mask).logits


@pytest.fixture(scope="module")
def trained_and_reference():
    model = make_model("llama", seed=0)
    return model, _logits(tachyon.init_inference(make_model("llama", seed=0), dtype=torch.float32))


def test_hf_folder_and_single_file(tmp_path, trained_and_reference):
    model, expected = trained_and_reference
    model.save_pretrained(tmp_path / "hf")
    for checkpoint in (tmp_path / "hf", tmp_path / "hf" / "model.safetensors"):
        engine = tachyon.init_inference(make_model("llama", seed=9), dtype=torch.float32, checkpoint=str(checkpoint))
        assert_close(_logits(engine), expected, name=f"loaded from {checkpoint.name}")


def test_deepspeed_checkpoint_json_with_parts(tmp_path, trained_and_reference):
    from safetensors.torch import save_file

    model, expected = trained_and_reference
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight" or
             not model.config.tie_word_embeddings}
    keys = sorted(state)
    save_file({k: state[k] for k in keys[::2]}, str(tmp_path / "part-1.safetensors"))
    torch.save({k: state[k] for k in keys[1::2]}, tmp_path / "part-2.pt")
    spec = {"type": "ds_model", "version": 1.0, "checkpoints": ["part-1.safetensors", "part-2.pt"]}
    (tmp_path / "ckpt.json").write_text(json.dumps(spec))
    for checkpoint, base_dir in ((str(tmp_path / "ckpt.json"), None), (spec, str(tmp_path))):
        engine = tachyon.init_inference(make_model("llama", seed=9), dtype=torch.float32, checkpoint=checkpoint,
                                        base_dir=base_dir)
        assert_close(_logits(engine), expected, name="DeepSpeed json")


def test_tachyon_training_checkpoint(tmp_path):
    model = make_model("gpt2", seed=3)
    config = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = tachyon.initialize(model=model, config=config)
    ids, mask = prompts((6, 6))
    engine.backward(engine(ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(tmp_path)
    trained = engine.module.eval()
    with torch.no_grad():
        expected = trained(ids).logits
    inference = tachyon.init_inference(make_model("gpt2", seed=9), dtype=torch.float32, checkpoint=str(tmp_path))
    assert_close(inference(ids).logits, expected, name="from the training checkpoint")


def test_mismatched_checkpoints_are_refused(tmp_path):
    torch.save({"model.embed_tokens.weight": torch.zeros(3, 3), "extra.weight": torch.zeros(1)}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"missing .*unexpected \['extra.weight'\].*shape mismatches"):
        tachyon.init_inference(make_model("llama"), dtype=torch.float32, checkpoint=str(tmp_path / "bad.pt"))
    with pytest.raises(ValueError, match="type='Megatron' is not supported"):
        tachyon.init_inference(make_model("llama"), dtype=torch.float32,
                               checkpoint={"type": "Megatron", "checkpoints": ["x"]})
    with pytest.raises(ValueError, match="does not exist"):
        tachyon.init_inference(make_model("llama"), dtype=torch.float32, checkpoint=str(tmp_path / "none"))

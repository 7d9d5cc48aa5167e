"""engine.generate against HF's generate: greedy 64 tokens on a left-padded batch of three prompts,
eos stopping and pad filling, sampling with top-k / top-p / temperature / repetition penalty
under a fixed seed (HF's tokens, and the same with and without the KV cache), min_new_tokens,
num_return_sequences; options it does not implement are refused by name."""

from __future__ import annotations

import pytest
import torch

import tachyon
from tests.inference.models import DECODERS, make_model, prompts

pytest.importorskip("transformers", reason="transformers is not installed")


def _both(name, **kwargs):
    """(HF's tokens, tachyon's tokens) for the same model, prompts and generate kwargs."""
    model = make_model(name)
    ids, mask = prompts()
    seed = kwargs.pop("seed", None)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, **kwargs)
    engine = tachyon.init_inference(model, dtype=torch.float32)
    if seed is not None:
        torch.manual_seed(seed)
    return expected, engine.generate(ids, attention_mask=mask, **kwargs), engine


def _assert_same(expected, got, what):
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} != HF's {tuple(expected.shape)}"
    diff = (got != expected).nonzero()
    assert diff.numel() == 0, f"{what}: {len(diff)} tokens differ, first at (row, position) {tuple(diff[0].tolist())}"


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_greedy_64_tokens_identical_to_hf(name):
    expected, got, _ = _both(name, max_new_tokens=64, do_sample=False, eos_token_id=None)
    assert got.shape[1] == prompts()[0].shape[1] + 64
    _assert_same(expected, got, f"{name} greedy")


@pytest.mark.parametrize("name", [n for n in DECODERS if n not in ("gpt2", "llama")])
def test_greedy_identical_to_hf_for_every_policy(name):
    """GPT-Neo's local window (8) and Mistral's sliding window (12) are crossed on the way."""
    expected, got, _ = _both(name, max_new_tokens=24, do_sample=False, eos_token_id=None)
    _assert_same(expected, got, f"{name} greedy")


def test_eos_stops_rows_and_pads_them_like_hf():
    model = make_model("gpt2")
    ids, mask = prompts()
    with torch.no_grad():
        free = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 3])  # the token row 0 produces 4th: make it the eos
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                                  pad_token_id=0)
    got = tachyon.init_inference(model, dtype=torch.float32).generate(ids, attention_mask=mask, max_new_tokens=12,
                                                                      do_sample=False, eos_token_id=eos, pad_token_id=0)
    _assert_same(expected, got, "eos")
    row0 = got[0, ids.shape[1]:].tolist()
    stop = row0.index(eos)
    assert all(t == 0 for t in row0[stop + 1:]), f"after eos, row 0 must be padding: {row0}"


SAMPLING = {
    "top_k": dict(do_sample=True, top_k=10),
    "top_p_temperature": dict(do_sample=True, top_p=0.8, temperature=0.7, top_k=0),
    "repetition_penalty_min_new": dict(do_sample=True, repetition_penalty=1.3, min_new_tokens=5),
    "defaults": dict(do_sample=True),  # HF's defaults: top_k=50
}


@pytest.mark.parametrize("kind", SAMPLING)
def test_sampling_with_a_seed_matches_hf(kind):
    expected, got, _ = _both("llama", max_new_tokens=16, seed=123, **SAMPLING[kind])
    _assert_same(expected, got, f"sampling {kind}")


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_sampling_with_and_without_kv_cache_is_identical(name):
    engine = tachyon.init_inference(make_model(name), dtype=torch.float32)
    ids, mask = prompts()
    runs = []
    for use_cache in (True, False):
        torch.manual_seed(7)
        runs.append(engine.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=True, top_p=0.9,
                                    use_cache=use_cache))
    _assert_same(runs[1], runs[0], "cache vs no cache")


def test_num_return_sequences_and_default_attention_mask():
    expected, got, engine = _both("gpt2", max_new_tokens=6, do_sample=True, num_return_sequences=2, seed=3)
    _assert_same(expected, got, "num_return_sequences=2")
    assert got.shape[0] == 6
    ids, _ = prompts((5, 5))
    with torch.no_grad():  # no mask, no padding: HF builds ones
        expected = engine._hf_model[0].generate(ids, max_new_tokens=5, do_sample=False)
    _assert_same(expected, engine.generate(ids, max_new_tokens=5, do_sample=False), "no attention_mask")


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_beams=2), "num_beams"),
    (dict(stop_strings=["x"]), "stop_strings"),
    (dict(foo=1), "unknown or unsupported"),
    (dict(max_new_tokens=2000), "max_out_tokens"),
    (dict(num_return_sequences=2), "do_sample"),
])
def test_unsupported_generate_options_are_refused(kwargs, match):
    engine = tachyon.init_inference(make_model("gpt2"), dtype=torch.float32, max_out_tokens=1024)
    ids, mask = prompts()
    with pytest.raises(ValueError, match=match):
        engine.generate(ids, attention_mask=mask, **{"max_new_tokens": 4, **kwargs})


def test_encoder_engine_does_not_generate():
    engine = tachyon.init_inference(make_model("bert"), dtype=torch.float32)
    with pytest.raises(ValueError, match="encoder"):
        engine.generate(prompts()[0])

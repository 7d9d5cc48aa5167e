"""Kernel injection of tachyon's own decoder (tachyon.train.models.GPT) against GPT itself.

Small random GPTs in four configurations (learned positions / RoPE, LayerNorm + gelu / RMSNorm +
swiglu, tied / untied head; vocab 100, padded to 128 rows): the injected model's logits equal
GPT.logits within the fp32 tolerance; greedy decoding with the KV cache equals greedy decoding by
calling GPT.logits on the growing sequence; a left-padded batch gives every row the tokens of its
prompt alone; INT8 weights keep most greedy tokens; 2 gloo ranks match one process; the layer
settings the injected decoder cannot reproduce are refused by name."""

from __future__ import annotations

import pytest
import torch

import tachyon
from tachyon.nn import TransformerLayer
from tachyon.train.models import GPT
from tests.inference.models import prompts as left_padded_prompts
from tests.utils import assert_close, run_distributed

pytest.importorskip("transformers", reason="transformers is not installed (the engine's forward output types)")

VOCAB = 100  # not a multiple of 64: the embedding has 128 rows, 28 of them padding

CONFIGS = {
    "learned-layernorm-gelu-tied": dict(position="learned", normalization="LayerNorm", activation="gelu",
                                        tie_embeddings=True),
    "rope-rmsnorm-swiglu-untied": dict(position="rope", normalization="RMSNorm", activation="swiglu",
                                       tie_embeddings=False),
    "rope-layernorm-gelu-tied": dict(position="rope", normalization="LayerNorm", activation="gelu",
                                     tie_embeddings=True),
    "learned-rmsnorm-swiglu-untied": dict(position="learned", normalization="RMSNorm", activation="swiglu",
                                          tie_embeddings=False),
}


def make_gpt(name: str, seed: int = 0, init_std: float = 0.15, **overrides) -> GPT:
    """A small random GPT in eval mode; every weight matrix and vector drawn N(0, init_std) (plus
    1 for the norm weights) so that logits are peaky and greedy tokens are not decided by rounding."""
    torch.manual_seed(seed)
    kwargs = dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96, max_seq_len=64)
    kwargs.update(CONFIGS[name])
    kwargs.update(overrides)
    model = GPT(VOCAB, **kwargs).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            norm_weight = p.dim() == 1 and "norm" in pname and "weight" in pname
            p.normal_(1.0 if norm_weight else 0.0, init_std)
    return model


def prompts(batch_lengths=(9, 4, 6), seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded_prompts(batch_lengths, seed, vocab=VOCAB)


def greedy_reference(model: GPT, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding without a cache: GPT.logits over the whole growing sequence every step."""
    ids = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            next_token = model.logits(ids)[:, -1].argmax(dim=-1)
            ids = torch.cat([ids, next_token[:, None]], dim=-1)
    return ids


def _assert_same(expected, got, what):
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    diff = (got != expected).nonzero()
    assert diff.numel() == 0, f"{what}: {len(diff)} tokens differ, first at (row, position) {tuple(diff[0].tolist())}"


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_gpt(name):
    model = make_gpt(name)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model.logits(ids)
    engine = tachyon.init_inference(model, dtype=torch.float32)
    out = engine(ids).logits
    assert out.shape == (2, 11, VOCAB), f"logits must have GPT's vocab_size={VOCAB} columns; got {tuple(out.shape)}"
    assert_close(out, expected, name=f"{name} logits")


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_32_tokens_with_kv_cache_match_gpt(name):
    model = make_gpt(name)
    ids, _ = prompts(batch_lengths=(7, 7))
    expected = greedy_reference(model, ids, 32)
    got = tachyon.init_inference(model, dtype=torch.float32).generate(ids, max_new_tokens=32, do_sample=False)
    _assert_same(expected, got, f"{name} greedy")


@pytest.mark.parametrize("name", ["learned-layernorm-gelu-tied", "rope-rmsnorm-swiglu-untied"])
def test_left_padded_batch_gives_each_prompt_its_own_tokens(name):
    """Positions restart at 0 after the padding, so each row equals its prompt decoded alone."""
    model = make_gpt(name)
    ids, mask = prompts()
    got = tachyon.init_inference(model, dtype=torch.float32).generate(ids, attention_mask=mask, max_new_tokens=32,
                                                                      do_sample=False)
    for row in range(ids.shape[0]):
        alone = ids[row, mask[row].bool()][None]
        expected = greedy_reference(model, alone, 32)[0, alone.shape[1]:]
        _assert_same(expected, got[row, ids.shape[1]:], f"{name} row {row}")


def test_explicit_eos_stops_rows_and_pads_them():
    """A tachyon GPT has no HF config: eos and pad ids come from generate's arguments."""
    model = make_gpt("rope-rmsnorm-swiglu-untied")
    ids, mask = prompts()
    engine = tachyon.init_inference(model, dtype=torch.float32)
    free = engine.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert free.shape[1] == ids.shape[1] + 12, "without an eos id, generation runs to max_new_tokens"
    eos = int(free[0, ids.shape[1] + 3])  # row 0's 4th new token becomes the eos
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                          pad_token_id=0)
    row0 = got[0, ids.shape[1]:].tolist()
    stop = row0.index(eos)
    assert stop <= 3 and row0[:stop + 1] == free[0, ids.shape[1]:ids.shape[1] + stop + 1].tolist()
    assert all(t == 0 for t in row0[stop + 1:]), f"after eos, row 0 must be padding: {row0}"


def test_generating_past_max_seq_len_is_refused():
    model = make_gpt("learned-layernorm-gelu-tied", max_seq_len=16)
    engine = tachyon.init_inference(model, dtype=torch.float32, max_out_tokens=64)
    with pytest.raises(ValueError, match="exceed the model's 16 positions"):
        engine.generate(prompts()[0], max_new_tokens=10, do_sample=False)


INT8_LEADING_MIN = 0.75   # "most of the first 16": free-running tokens, per row up to its first divergence
INT8_TEACHER_FORCED_MIN = 0.9  # each of the 16 positions given fp32 GPT's own context


@pytest.mark.parametrize("name", ["learned-layernorm-gelu-tied", "rope-rmsnorm-swiglu-untied"])
def test_int8_weights_keep_most_greedy_tokens(name):
    """INT8 weights (per-row symmetric, fp32 activations on the CPU) against fp32 GPT's greedy
    tokens on 8 prompts. Weights at std 0.05: activations of a trained model's size (at 0.15 the
    random network amplifies the quantization error and flips more near-ties)."""
    model = make_gpt(name, init_std=0.05)
    ids, _ = prompts(batch_lengths=(7,) * 8, seed=4)
    prompt_len = ids.shape[1]
    reference = greedy_reference(model, ids, 16)
    expected = reference[:, prompt_len:]
    engine = tachyon.init_inference(model, dtype=torch.int8)
    assert engine.weight_bytes()["layers_gemm"] < tachyon.init_inference(
        model, dtype=torch.float32).weight_bytes()["layers_gemm"] / 3, "INT8 layers must hold int8 weights"
    got = engine.generate(ids, max_new_tokens=16, do_sample=False)[:, prompt_len:]
    leading = (got == expected).int().cumprod(dim=1).sum().item() / expected.numel()
    forced = engine(reference).logits[:, prompt_len - 1:-1].argmax(dim=-1)
    teacher_forced = (forced == expected).float().mean().item()
    print(f"{name}: INT8 greedy = fp32 GPT on {leading:.0%} of the leading tokens (free-running), "
          f"{teacher_forced:.0%} teacher-forced")
    assert leading >= INT8_LEADING_MIN, f"{name}: INT8 free-running agreement {leading:.0%} < {INT8_LEADING_MIN:.0%}"
    assert teacher_forced >= INT8_TEACHER_FORCED_MIN, (
        f"{name}: INT8 teacher-forced agreement {teacher_forced:.0%} < {INT8_TEACHER_FORCED_MIN:.0%}")


REFUSED = {
    "apply_residual_connection_post_layernorm": dict(apply_residual_connection_post_layernorm=True),
    "output_layernorm": dict(output_layernorm=True),
    "self_attn_mask_type": dict(self_attn_mask_type="no_mask"),
    "attn_input_format": dict(attn_input_format="sbhd"),
    "zero_centered_gamma": dict(zero_centered_gamma=True),
    "layer_type": dict(layer_type="decoder"),
}


@pytest.mark.parametrize("setting", REFUSED)
def test_settings_the_decoder_cannot_reproduce_are_refused(setting):
    model = make_gpt("learned-layernorm-gelu-tied")
    kwargs = dict(hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                  self_attn_mask_type="causal", attn_input_format="bshd")
    kwargs.update(REFUSED[setting])
    model.layers[1] = TransformerLayer(**kwargs)
    with pytest.raises(ValueError, match=f"layers\\[1\\].{setting}=.*cannot be converted exactly"):
        tachyon.init_inference(model, dtype=torch.float32)


def test_a_transformer_layer_subclass_is_refused():
    class Patched(TransformerLayer):
        pass

    model = make_gpt("learned-layernorm-gelu-tied")
    model.layers[0] = Patched(64, 96, 4, attn_input_format="bshd")
    with pytest.raises(ValueError, match="layer 0 is a Patched"):
        tachyon.init_inference(model, dtype=torch.float32)


TP_CASES = ("learned-layernorm-gelu-tied", "rope-rmsnorm-swiglu-untied")


def run_tp_cases(tp_size: int):
    results = {}
    ids, mask = prompts()
    for name in TP_CASES:
        engine = tachyon.init_inference(make_gpt(name), dtype=torch.float32, tensor_parallel={"tp_size": tp_size})
        results[name] = {"logits": engine(ids, attention_mask=mask).logits,
                         "tokens": engine.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False),
                         "weight_bytes": engine.weight_bytes()["layers_gemm"]}
    return results


@pytest.mark.distributed
def test_two_ranks_match_one_process():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = run_tp_cases(1)
        ranks = run_distributed(run_tp_cases, 2, 2, timeout=600)
    finally:
        torch.set_num_threads(threads)
    keep = prompts()[1].bool()
    for rank, result in enumerate(ranks):
        for name in TP_CASES:
            assert_close(result[name]["logits"][keep], single[name]["logits"][keep], rtol=1e-5, atol=1e-5,
                         name=f"{name} rank {rank} logits")
            assert torch.equal(result[name]["tokens"], single[name]["tokens"]), f"{name} rank {rank}: tokens differ"
            assert result[name]["weight_bytes"] == single[name]["weight_bytes"] // 2, f"{name} rank {rank}: not half"

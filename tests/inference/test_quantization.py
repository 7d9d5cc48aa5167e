"""INT8 weight-only inference: all-MiniLM-L6-v2 sentence embeddings of 100 sentences against fp32
(cosine), greedy GPT-2 tokens against fp32 (match rate over 20 prompts), the weights the engine
holds (int8 + fp32 scales, a quarter of fp32's bytes), group-wise scales."""

from __future__ import annotations

import copy

import pytest
import torch

import tachyon
from tests.inference.models import make_model, prompts
from tests.inference.test_injection import _minilm, mean_pool

COSINE_MIN = 0.99          # the bound for INT8 MiniLM embeddings
GREEDY_MATCH_MIN = 0.8     # "most prompts": at least 80% of them identical for 16 tokens


def _sentences(n: int = 100) -> list[str]:
    """n lines of the embedded Shakespeare corpus with 6 to 30 words (real, varied English)."""
    from tachyon.data import load_corpus

    lines = [" ".join(line.split()) for line in load_corpus().splitlines()]
    picked = [line for line in lines if 6 <= len(line.split()) <= 30]
    step = max(1, len(picked) // n)
    return picked[::step][:n]


@pytest.mark.parametrize("quant", [None, pytest.param({"weight": {"group_size": 64}}, marks=pytest.mark.slow)],
                         ids=["per-channel", "group64"])
def test_int8_minilm_embeddings_keep_cosine_099_on_100_sentences(quant):
    model, tokenizer = _minilm()
    sentences = _sentences()
    assert len(sentences) == 100
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=64, return_tensors="pt")
    with torch.no_grad():
        expected = mean_pool(model(**batch).last_hidden_state, batch["attention_mask"])
    engine = tachyon.init_inference(copy.deepcopy(model), dtype=torch.int8, quant=quant)
    got = mean_pool(engine(**batch).last_hidden_state, batch["attention_mask"])
    cosine = torch.nn.functional.cosine_similarity(got, expected)
    print(f"INT8 MiniLM ({'per-channel' if quant is None else 'group 64'}): cosine min {cosine.min():.5f}, "
          f"mean {cosine.mean():.5f} over {len(sentences)} sentences")
    assert float(cosine.min()) >= COSINE_MIN, f"lowest cosine {float(cosine.min()):.4f} < {COSINE_MIN}"
    layer = engine.module.encoder.layer[0]
    assert layer.qkv.qweight.dtype == torch.int8 and layer.qkv.scales.dtype == torch.float32


def test_int8_gpt2_greedy_tokens_match_fp32_on_most_prompts():
    model = make_model("gpt2")
    fp32 = tachyon.init_inference(copy.deepcopy(model), dtype=torch.float32)
    int8 = tachyon.init_inference(copy.deepcopy(model), dtype=torch.int8)
    ids, mask = prompts((9, 4, 6, 12, 3, 7, 10, 5, 8, 11, 2, 6, 9, 4, 13, 7, 3, 8, 5, 10))  # 20 prompts, one batch
    a = fp32.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None)
    b = int8.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None)
    same, total = int((a == b).all(dim=1).sum()), a.shape[0]
    print(f"INT8 GPT-2 greedy: {same}/{total} prompts identical to fp32 for 16 tokens")
    assert same / total >= GREEDY_MATCH_MIN, f"only {same}/{total} prompts match fp32"


def test_int8_engine_holds_a_quarter_of_fp32_bytes():
    model = make_model("llama")
    fp32 = tachyon.init_inference(copy.deepcopy(model), dtype=torch.float32).weight_bytes()
    int8 = tachyon.init_inference(copy.deepcopy(model), dtype=torch.int8).weight_bytes()
    rows = sum(layer.qkv.out_features + layer.out.out_features + layer.mlp.fc1.out_features
               + layer.mlp.fc2.out_features for layer in tachyon.init_inference(
                   copy.deepcopy(model), dtype=torch.int8).module.layers)
    assert int8["layers_gemm"] == fp32["layers_gemm"] // 4 + 4 * rows  # int8 weights + one fp32 scale per row


def test_int8_logits_error_is_small_against_fp32():
    model = make_model("llama")
    ids, mask = prompts()
    ref = tachyon.init_inference(copy.deepcopy(model), dtype=torch.float32)(ids, attention_mask=mask).logits
    for quant in (None, {"weight": {"group_size": 16}}):
        got = tachyon.init_inference(copy.deepcopy(model), dtype=torch.int8, quant=quant)(ids, attention_mask=mask).logits
        keep = mask.bool()
        rel = float((got[keep] - ref[keep]).norm() / ref[keep].norm())
        assert rel < 0.02, f"INT8 logits relative error {rel:.4f} (quant={quant})"


@pytest.mark.parametrize("name", ["gpt2", "gptj", "llama"])
def test_int8_fused_norm_and_activation_gemms_match_the_torch_path(name):
    """The Triton path (interpreted here) runs each norm inside the INT8 GEMM after it and the MLP's
    bias + activation in fc1's epilogue (learned positions added inside the first norm, q read in
    place without RoPE); the torch path runs them one op at a time. Prefill logits and the greedy
    tokens of the prefill and a decode step agree (GPT-J: parallel attention + MLP, both GEMMs normalizing; Llama: RMSNorm,
    SwiGLU, GQA, RoPE)."""
    from tests.utils import assert_close

    model = make_model(name, init_std=0.2)
    ids, mask = prompts()
    out = {}
    for backend in ("torch", "triton"):
        with tachyon.use_backend(backend):
            engine = tachyon.init_inference(copy.deepcopy(model), dtype=torch.int8)
            logits = engine(ids, attention_mask=mask).logits
            # 2 tokens: the prefill's and one decode step's (each interpreted decode step costs
            # about as much as the prefill; later steps run the same kernels on a longer cache)
            tokens = engine.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None)
        out[backend] = (logits, tokens)
    keep = mask.bool()
    assert_close(out["triton"][0][keep], out["torch"][0][keep], rtol=1e-4, atol=1e-4, name=f"{name} prefill logits")
    assert torch.equal(out["triton"][1], out["torch"][1]), f"{name}: greedy decode tokens differ between backends"

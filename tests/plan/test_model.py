"""The planner's parameter counts equal the real modules' (tachyon's GPT and BERT, a Llama-style stack, HF)."""

from __future__ import annotations

import json

import pytest
import torch

import tachyon.nn as tnn
from tachyon.plan.model import PRESETS, ModelSpec, PlanError, from_hf_config, preset, resolve_model
from tachyon.train.models import GPT, BertMLM, count_parameters


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("hidden, layers, heads, vocab, seq", [(64, 2, 4, 262, 32), (48, 3, 3, 1000, 17)])
def test_gpt_count_equals_tachyons_gpt(hidden, layers, heads, vocab, seq, tied):
    model = GPT(vocab, hidden, layers, heads, max_seq_len=seq, tie_embeddings=tied)
    spec = ModelSpec(family="gpt", layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, tied_embeddings=tied)
    assert spec.total_params() == count_parameters(model)


def test_bert_count_equals_tachyons_bert_mlm():
    model = BertMLM(262, 64, 2, 4, intermediate_size=160, max_seq_len=32, max_batch_size=2)
    spec = ModelSpec(family="bert", layers=2, hidden=64, heads=4, ffn=160, seq=32, vocab=262)
    assert spec.total_params() == count_parameters(model)


def test_llama_count_equals_a_stack_of_tachyon_layers():
    h, heads, kv, ffn, layers, vocab = 64, 8, 2, 176, 3, 320
    stack = torch.nn.ModuleList(
        tnn.TransformerLayer(h, ffn, heads, num_gqa_groups=kv, normalization="RMSNorm", activation="swiglu", bias=False)
        for _ in range(layers))
    rest = torch.nn.ModuleList([torch.nn.Embedding(vocab, h), tnn.RMSNorm(h), torch.nn.Linear(h, vocab, bias=False)])
    spec = ModelSpec(family="llama", layers=layers, hidden=h, heads=heads, kv_heads=kv, ffn=ffn, seq=16, vocab=vocab,
                     tied_embeddings=False)
    assert spec.total_params() == count_parameters(stack) + count_parameters(rest)


def test_llama_count_equals_hf_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=320,
                                      max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config)
    spec = ModelSpec(family="llama", layers=2, hidden=64, heads=8, kv_heads=2, ffn=176, seq=128, vocab=320,
                     tied_embeddings=False)
    assert spec.total_params() == sum(p.numel() for p in model.parameters())


def test_presets_match_the_published_counts():
    # Llama-2-7B's 6,738,415,616 parameters (its vocabulary 32000 is already a multiple of 64)
    assert preset("llama-7b").total_params() == 6_738_415_616
    assert preset("llama-70b").total_params() == 68_976_648_192
    # GPT-2: 124,439,808 with the 50257-row vocabulary; tachyon pads it to 50304 rows
    assert preset("gpt2").total_params() == 124_439_808 + (50304 - 50257) * 768
    assert set(PRESETS) >= {"gpt2", "llama-7b", "bert-large"}


def test_tensor_parallel_split_keeps_norms_and_row_biases_whole():
    spec = preset("gpt2")
    h = spec.hidden
    replicated = 2 * 2 * h + 2 * h  # two LayerNorms (weight + bias), projection and fc2 biases
    for tp in (2, 4):
        assert tp * spec.layer_params(tp) - spec.layer_params(1) == (tp - 1) * replicated
    assert spec.padded_vocab(4) % (64 * 4) == 0


def _write(tmp_path, config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_hf_configs(tmp_path):
    gpt2 = from_hf_config(_write(tmp_path, {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4,
                                            "vocab_size": 100, "n_positions": 128}))
    assert (gpt2.family, gpt2.layers, gpt2.seq, gpt2.tied_embeddings) == ("gpt", 2, 128, True)
    llama = from_hf_config(_write(tmp_path, {"model_type": "mistral", "num_hidden_layers": 2, "hidden_size": 64,
                                             "num_attention_heads": 8, "num_key_value_heads": 2,
                                             "intermediate_size": 176, "vocab_size": 320,
                                             "max_position_embeddings": 4096}), seq=1024)
    assert (llama.family, llama.num_kv_heads, llama.seq, llama.tied_embeddings) == ("llama", 2, 1024, False)
    bert = resolve_model(_write(tmp_path, {"model_type": "bert", "num_hidden_layers": 2, "hidden_size": 64,
                                           "num_attention_heads": 4, "intermediate_size": 256, "vocab_size": 100,
                                           "max_position_embeddings": 512}))
    assert bert.family == "bert" and not bert.pre_layer_norm


def test_bad_models_are_refused_with_what_is_allowed(tmp_path):
    with pytest.raises(PlanError, match="model_type 't5' is not supported; supported: .*'gpt2'"):
        from_hf_config(_write(tmp_path, {"model_type": "t5"}))
    with pytest.raises(PlanError, match=r"lacks \['n_head'\]"):
        from_hf_config(_write(tmp_path, {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "vocab_size": 10}))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(PlanError, match="not valid JSON"):
        from_hf_config(str(tmp_path / "bad.json"))
    with pytest.raises(PlanError, match="did you mean 'llama-7b'"):
        preset("llama-7")
    with pytest.raises(PlanError, match="missing: --heads"):
        resolve_model(None, layers=2, hidden=64, seq=8, vocab=10)
    with pytest.raises(PlanError, match=r"hidden \(65\) must be divisible by heads \(4\)"):
        ModelSpec(family="gpt", layers=1, hidden=65, heads=4, seq=8, vocab=10)
    with pytest.raises(PlanError, match="memory flags of the bert family"):
        ModelSpec(family="gpt", layers=1, hidden=64, heads=4, seq=8, vocab=10, gelu_checkpoint=True)

"""The planner's activation bytes equal what tachyon's layers and models save for backward on CPU.

Measured with ``torch.autograd.graph.saved_tensors_hooks`` (unique storages, parameters excluded;
tachyon.nn.transformer_kernel.memory). Per-layer figures are "one more layer in a stack". The
only bytes the formulas leave out are a few 0-dim tensors per layer (dropout seeds, FP8 scales):
at most SMALL_PER_LAYER bytes.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import tachyon
import tachyon.nn as tnn
from tachyon.nn.transformer_kernel.memory import saved_bytes_per_layer, saved_tensor_bytes
from tachyon.plan import activations as act
from tachyon.plan.model import ModelSpec
from tachyon.train.models import GPT, BertMLM

SMALL_PER_LAYER = 256  # bytes: 0-dim seeds (int64) and FP8 scale/scale_inv copies per layer
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _layer_pair(spec: ModelSpec, dtype: torch.dtype, fmt: str, dropout: float):
    kw = dict(num_gqa_groups=spec.num_kv_heads, normalization=spec.norm, activation=spec.activation, bias=spec.bias,
              hidden_dropout=dropout, attention_dropout=dropout, attn_input_format=fmt, params_dtype=dtype)
    return (tnn.TransformerLayer(spec.hidden, spec.ffn_size, spec.heads, **kw),
            tnn.TransformerLayer(spec.hidden, spec.ffn_size, spec.heads, **kw))


LAYERS = [
    # family, hidden, heads, kv heads, ffn, dtype, format, dropout
    ("gpt", 64, 4, None, None, "fp32", "bshd", 0.0),
    ("gpt", 48, 3, None, 80, "bf16", "sbhd", 0.1),
    ("llama", 64, 8, 2, 176, "bf16", "bshd", 0.0),
    ("llama", 96, 6, 6, 128, "fp32", "sbhd", 0.0),
]


@pytest.mark.parametrize("family, hidden, heads, kv, ffn, dtype, fmt, dropout", LAYERS)
def test_transformer_layer_bytes_equal_the_measured_ones(family, hidden, heads, kv, ffn, dtype, fmt, dropout):
    batch, seq = 2, 24
    spec = ModelSpec(family=family, layers=2, hidden=hidden, heads=heads, kv_heads=kv, ffn=ffn, seq=seq, vocab=64)
    first, second = _layer_pair(spec, DTYPES[dtype], fmt, dropout)
    shape = (batch, seq, hidden) if fmt == "bshd" else (seq, batch, hidden)
    measured = saved_bytes_per_layer(first, second, torch.randn(shape, dtype=DTYPES[dtype]))
    planned = act.layer_bytes_per_token(spec, dtype) * batch * seq
    assert 0 <= measured - planned <= SMALL_PER_LAYER, f"measured {measured} B, planned {planned} B"


@pytest.mark.parametrize("family, kv", [("gpt", None), ("llama", 2)])
def test_fp8_layer_bytes_equal_the_measured_ones(family, kv):
    batch, seq = 2, 32
    spec = ModelSpec(family=family, layers=2, hidden=64, heads=4, kv_heads=kv, ffn=192, seq=seq, vocab=64)
    first, second = _layer_pair(spec, torch.bfloat16, "bshd", 0.0)
    x = torch.randn(batch, seq, 64, dtype=torch.bfloat16)
    params = [*first.parameters(), *second.parameters()]
    with tachyon.fp8_autocast():
        _, one = saved_tensor_bytes(lambda: first(x), exclude=params)
    with tachyon.fp8_autocast():
        _, two = saved_tensor_bytes(lambda: second(first(x)), exclude=params)
    planned = act.layer_bytes_per_token(spec, "fp8") * batch * seq + act.fp8_weight_bytes(spec, "fp8")
    assert 0 <= (two - one) - planned <= SMALL_PER_LAYER, f"measured {two - one} B, planned {planned} B"


KERNEL_FLAGS = list(itertools.product((True, False), repeat=4))


@pytest.mark.parametrize("pre, inv, gelu, attn", KERNEL_FLAGS)
def test_kernel_layer_bytes_equal_the_measured_ones_for_every_flag(pre, inv, gelu, attn):
    # a size the coefficients were not fitted at (hidden 96, ffn 160, 6 heads), bf16
    batch, seq, hidden, ffn, heads = 2, 16, 96, 160, 6
    spec = ModelSpec(family="bert", layers=2, hidden=hidden, heads=heads, ffn=ffn, seq=seq, vocab=64,
                     pre_layer_norm=pre, normalize_invertible=inv, gelu_checkpoint=gelu, attn_dropout_checkpoint=attn)
    config = tnn.TransformerKernelConfig(
        batch_size=batch, max_seq_length=seq, hidden_size=hidden, intermediate_size=ffn, heads=heads,
        attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1, num_hidden_layers=2, initializer_range=0.02, seed=1,
        bf16=True, pre_layer_norm=pre, normalize_invertible=inv, gelu_checkpoint=gelu, attn_dropout_checkpoint=attn)
    measured = saved_bytes_per_layer(tnn.TransformerKernelLayer(config), tnn.TransformerKernelLayer(config),
                                     torch.randn(batch, seq, hidden, dtype=torch.bfloat16))
    planned = act.layer_bytes_per_token(spec, "bf16") * batch * seq
    assert 0 <= measured - planned <= SMALL_PER_LAYER, f"measured {measured} B, planned {planned} B"


class _Checkpointed(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return tachyon.checkpointing.checkpoint(self.inner, *args, **kwargs)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", ["none", "selective", "full"])
def test_whole_gpt_model_bytes_equal_the_measured_ones(dtype, checkpointing):
    batch, seq, layers, vocab = 2, 32, 3, 262
    model = GPT(vocab, 64, layers, 4, max_seq_len=seq, dtype=DTYPES[dtype])
    if checkpointing == "full":  # every layer a checkpointed region
        model.layers = torch.nn.ModuleList(_Checkpointed(layer) for layer in model.layers)
    if checkpointing == "selective":  # the attention core of every layer recomputed (Megatron's selective)
        for layer in model.layers:
            layer.self_attention.core_attention = _Checkpointed(layer.self_attention.core_attention)
    spec = ModelSpec(family="gpt", layers=layers, hidden=64, heads=4, seq=seq, vocab=vocab)
    ids, labels = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    _, measured = saved_tensor_bytes(lambda: model(ids, None, labels), exclude=list(model.parameters()))
    planned = act.stage_activations(spec, dtype, checkpointing, batch * seq, layers, first=True, last=True).saved
    assert 0 <= measured - planned <= SMALL_PER_LAYER * layers, f"measured {measured} B, planned {planned} B"


def test_whole_bert_model_bytes_are_within_ten_percent():
    # 10 of 64 tokens scored (the planner's mlm_fraction set to match); embedding dropout 0.1: PyTorch's
    # CPU dropout keeps its mask in the activation dtype, CUDA's (which the planner counts) as bool
    batch, seq, layers, vocab = 2, 32, 3, 262
    model = BertMLM(vocab, 64, layers, 4, max_seq_len=seq, max_batch_size=batch, hidden_dropout=0.1,
                    attention_dropout=0.1, dtype=torch.bfloat16)
    ids, labels = torch.randint(0, vocab, (batch, seq)), torch.full((batch, seq), -100)
    labels.view(-1)[torch.randperm(batch * seq)[:10]] = 7
    spec = ModelSpec(family="bert", layers=layers, hidden=64, heads=4, seq=seq, vocab=vocab, mlm_fraction=10 / 64)
    _, measured = saved_tensor_bytes(lambda: model(ids, None, labels), exclude=list(model.parameters()))
    planned = act.stage_activations(spec, "bf16", "none", batch * seq, layers, first=True, last=True).saved
    cpu_dropout_mask = (2 - 1) * batch * seq * 64  # bf16 instead of bool
    assert 0 <= measured - planned - cpu_dropout_mask <= SMALL_PER_LAYER * layers, (measured, planned)
    assert abs(measured - planned) / measured < 0.10


def test_tachyon_layers_save_less_than_megatrons_accounting():
    spec = ModelSpec(family="gpt", layers=1, hidden=1024, heads=16, seq=2048, vocab=64)
    tokens = spec.seq
    ours = act.layer_bytes_per_token(spec, "bf16") * tokens
    megatron = act.megatron_layer_bytes(spec, tokens)
    # no a*s^2 probabilities and no dropout masks (2 bytes of Megatron's 34 per element of sbh),
    # plus fp32 statistics: within 1% of Megatron's selective figure less the masks (32 of 34)
    selective = act.megatron_layer_bytes(spec, tokens, "selective")
    assert ours < selective < megatron and abs(ours - selective * 32 / 34) / selective < 0.01
    assert act.layer_bytes_per_token(spec, "bf16", tp=4) == pytest.approx(ours / tokens / 4)

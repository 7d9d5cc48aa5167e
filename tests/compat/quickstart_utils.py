"""The helper module of Transformer Engine's getting-started tutorial (``quickstart_utils.py``),
which the tutorial imports as ``utils``: a plain-PyTorch DotProductAttention and BasicMLP, a
speedometer, and the functions that make the TE layers use the basic layer's weights.

Ported the same way as the tutorial (its ``te`` import points at tachyon's compat module). The
speedometer runs one iteration by default (CPU). Parameter sharing for ``te.TransformerLayer``
copies the QKV weight with its rows regrouped: the basic layer's fused QKV is interleaved per head
([q_0 k_0 v_0 q_1 ...], TE's default ``qkv_weight_interleaved=True``), tachyon's TransformerLayer
holds [Q heads | K heads | V heads] (TE's ``qkv_weight_interleaved=False``).
"""

from __future__ import annotations

import math
import time

import torch

import tachyon.compat.transformer_engine.pytorch as te


class DotProductAttention(torch.nn.Module):
    """Attention over q, k, v [seq, batch, heads, head_dim] -> [seq, batch, heads * head_dim];
    ``attention_mask``: bool, True = masked out (None: no mask)."""

    def __init__(self, num_attention_heads: int, kv_channels: int, attention_dropout: float) -> None:
        super().__init__()
        self.projection_size = kv_channels * num_attention_heads
        self.hidden_size_per_attention_head = kv_channels
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        self.dropout = torch.nn.Dropout(attention_dropout)

    def masked_softmax(self, inp: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is not None:
            inp = inp.masked_fill(mask, -10000.0)
        return torch.nn.Softmax(dim=-1)(inp)

    def forward(self, query, key, value, attention_mask=None):
        b, np_, sq, sk, hn = query.size(1), query.size(2), query.size(0), key.size(0), value.size(3)
        query = query.reshape(sq, b * np_, -1)
        key = key.reshape(sk, b * np_, -1)
        bmm1 = torch.bmm(query.transpose(0, 1), key.transpose(0, 1).transpose(1, 2)) / self.norm_factor
        attention_scores = bmm1.view(b, np_, sq, sk)
        attention_probs = self.dropout(self.masked_softmax(attention_scores, attention_mask))
        value = value.reshape(sk, b * np_, -1)
        context = torch.bmm(attention_probs.view(b * np_, sq, -1), value.transpose(0, 1))
        return context.view(b, np_, sq, hn).permute(2, 0, 1, 3).contiguous().view(sq, b, self.projection_size)


class BasicMLP(torch.nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.linear1 = torch.nn.Linear(hidden_size, ffn_hidden_size, bias=True)
        self.linear2 = torch.nn.Linear(ffn_hidden_size, hidden_size, bias=True)

    def forward(self, x):
        return self.linear2(torch.nn.functional.gelu(self.linear1(x), approximate="tanh"))


def speedometer(module, input, output_grad, forward_kwargs=None, fp8_autocast_kwargs=None, timing_iters=1,
                warmup_iters=0):
    """Mean forward + backward time in ms (printed like the tutorial's); returns it."""
    forward_kwargs = forward_kwargs or {}
    fp8_autocast_kwargs = fp8_autocast_kwargs or {"enabled": False}

    def step():
        with te.fp8_autocast(**fp8_autocast_kwargs):
            out = module(input, **forward_kwargs)
        out.backward(output_grad)

    for _ in range(warmup_iters):
        step()
    start = time.perf_counter()
    for _ in range(timing_iters):
        step()
    mean_ms = (time.perf_counter() - start) / timing_iters * 1e3
    print(f"Mean time: {mean_ms} ms")
    return mean_ms


def share_parameters_with_basic_te_model(te_model, basic_model):
    """BasicTETransformerLayer uses the basic layer's parameters (same module names)."""
    for name in ("ln1", "qkv_projection", "projection", "ln2"):
        getattr(te_model, name).weight = getattr(basic_model, name).weight
        getattr(te_model, name).bias = getattr(basic_model, name).bias
    for name in ("linear1", "linear2"):
        getattr(te_model.mlp, name).weight = getattr(basic_model.mlp, name).weight
        getattr(te_model.mlp, name).bias = getattr(basic_model.mlp, name).bias


def share_parameters_with_fused_te_model(te_model, basic_model):
    """FusedTETransformerLayer (LayerNormLinear + LayerNormMLP) uses the basic layer's parameters."""
    te_model.ln_qkv.layer_norm_weight = basic_model.ln1.weight
    te_model.ln_qkv.layer_norm_bias = basic_model.ln1.bias
    te_model.ln_qkv.weight = basic_model.qkv_projection.weight
    te_model.ln_qkv.bias = basic_model.qkv_projection.bias
    te_model.projection.weight = basic_model.projection.weight
    te_model.projection.bias = basic_model.projection.bias
    te_model.ln_mlp.layer_norm_weight = basic_model.ln2.weight
    te_model.ln_mlp.layer_norm_bias = basic_model.ln2.bias
    te_model.ln_mlp.fc1_weight = basic_model.mlp.linear1.weight
    te_model.ln_mlp.fc1_bias = basic_model.mlp.linear1.bias
    te_model.ln_mlp.fc2_weight = basic_model.mlp.linear2.weight
    te_model.ln_mlp.fc2_bias = basic_model.mlp.linear2.bias


def _heads_grouped(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [q_0 k_0 v_0 q_1 k_1 v_1 ...] -> [q_0 q_1 ... | k_0 ... | v_0 ...]."""
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def share_parameters_with_transformerlayer_te_model(te_model, basic_model):
    """te.TransformerLayer takes the basic layer's weights (QKV rows regrouped by Q/K/V)."""
    heads = basic_model.num_attention_heads
    attn = te_model.self_attention
    with torch.no_grad():
        attn.layernorm_qkv.weight.copy_(_heads_grouped(basic_model.qkv_projection.weight, heads))
        attn.layernorm_qkv.bias.copy_(_heads_grouped(basic_model.qkv_projection.bias, heads))
    attn.layernorm_qkv.layer_norm_weight = basic_model.ln1.weight
    attn.layernorm_qkv.layer_norm_bias = basic_model.ln1.bias
    attn.proj.weight = basic_model.projection.weight
    attn.proj.bias = basic_model.projection.bias
    mlp = te_model.layernorm_mlp
    mlp.layer_norm_weight = basic_model.ln2.weight
    mlp.layer_norm_bias = basic_model.ln2.bias
    mlp.fc1_weight = basic_model.mlp.linear1.weight
    mlp.fc1_bias = basic_model.mlp.linear1.bias
    mlp.fc2_weight = basic_model.mlp.linear2.weight
    mlp.fc2_bias = basic_model.mlp.linear2.bias

"""The injected inference layers: a linear that may be INT8 and/or tensor-sliced, a pre-LN decoder
layer with a KV cache (GPT-2, GPT-Neo, GPT-J, Llama-style), a post-LN BERT encoder layer.

Decoder layer, per step (x [batch, s, hidden], the residual stream kept as (delta, residual) so
that every residual add runs fused into the next norm):

    h, x    = norm1(delta, residual=residual)              one kernel: x = delta + residual, h = norm(x)
    qkv     = h @ Wqkv^T + bqkv                            one GEMM (q | k | v rows), INT8 or float
                                                            (INT8: the norm runs inside it, h is never
                                                            written: norm_int8_linear; norm2 + fc1 alike)
    q       = rotary_kv_append(qkv, positions, ...)        RoPE on q, k; k, v written into the cache
                                                            (no RoPE: q stays in qkv, read in place)
    a       = attention(q, cache)                          prefill: flash attention over the new keys;
                                                            decode / windowed: decode_attention (split-K)
    a       = all_reduce(a @ Wo^T) + bo                    row-parallel under tensor slicing
    h2, x2  = norm2(a, residual=x)                         (GPT-J: no norm2, the MLP reads h too)
    m       = all_reduce(act(h2 @ W1^T + b1) @ W2^T) + b2  bias + activation fused (bias_act; INT8: in
                                                            the fc1 GEMM's epilogue)
    return (m, x2)                                         GPT-J: (a + m, x)

Encoder layer (HF BertLayer / RobertaLayer, post-LN), called by HF's own encoder with HF's masks:

    y = LN_attn(attn(x) + x);  out = LN_out(mlp(y) + y)    each add fused into its LayerNorm

No process group is created here: a layer gets the group to all-reduce over from the injector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tachyon.inference.config import WeightQuant
from tachyon.inference.weights import (
    AttentionWeights, DecoderLayerWeights, EncoderLayerWeights, MLPWeights, Norm, fused_bias,
)
from tachyon.kernels.activation import bias_act
from tachyon.kernels.attention import attention
from tachyon.kernels.decode_attention import decode_attention
from tachyon.kernels.int8_linear import int8_linear, norm_int8_linear, quantize_symmetric
from tachyon.kernels.kv_append import rotary_kv_append
from tachyon.kernels.layernorm import layer_norm, rms_norm


class InferenceLinear(nn.Module):
    """y = x @ W^T + b with W float ([out, in], ``weight``) or int8 (``qweight`` + fp32 ``scales``,
    quantized from the float weight here); with ``reduce_group`` the layer is row-parallel: the
    partial products are all-reduced over the group and the (full) bias is added once after."""

    def __init__(self, weight: Tensor, bias: Tensor | None, *, dtype: torch.dtype, device: torch.device,
                 quant: WeightQuant | None = None, reduce_group: Any = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.reduce_group = reduce_group
        self.quantized = quant is not None
        if quant is not None:
            q, scales = quantize_symmetric(weight.to(device), quant.num_bits, group_size=quant.group_size,
                                           q_groups=quant.q_groups)
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scales)
            self.weight = None
        else:
            self.weight = nn.Parameter(weight.detach().to(device=device, dtype=dtype).contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device=device, dtype=dtype),
                                                           requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.reduce_group is not None else self.bias
        y = int8_linear(x, self.qweight, self.scales, bias) if self.quantized else F.linear(x, self.weight, bias)
        if self.reduce_group is not None:
            dist.all_reduce(y, group=self.reduce_group)
            if self.bias is not None:
                y = y + self.bias
        return y

    def weight_bytes(self) -> int:
        """Bytes a forward reads for the weight (and its scales): what decode streams per token."""
        if self.quantized:
            return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * 4
        return self.weight.numel() * self.weight.element_size()

    def extra_repr(self) -> str:
        kind = f"int8 (scales {tuple(self.scales.shape)})" if self.quantized else str(self.weight.dtype)
        return (f"in={self.in_features}, out={self.out_features}, {kind}, bias={self.bias is not None}, "
                f"row_parallel={self.reduce_group is not None}")


class InferenceNorm(nn.Module):
    """LayerNorm / RMSNorm with the residual add fused in: returns (norm(x + residual), x + residual)."""

    def __init__(self, norm: Norm, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.kind, self.eps = norm.kind, float(norm.eps)
        self.weight = nn.Parameter(norm.weight.detach().to(device=device, dtype=dtype), requires_grad=False)
        self.bias = None if norm.bias is None else nn.Parameter(norm.bias.detach().to(device=device, dtype=dtype),
                                                                requires_grad=False)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if self.kind == "rms":
            return rms_norm(x, self.weight, residual=residual, eps=self.eps, return_residual=True)
        return layer_norm(x, self.weight, self.bias, residual=residual, eps=self.eps, return_residual=True)


def norm_linear(norm: InferenceNorm, linear: InferenceLinear, x: Tensor, residual: Tensor | None, *,
                activation: str | None = None, act_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(act(linear(norm(x + residual)) + act_bias), x + residual).

    When ``linear`` is INT8 (and not row-parallel) this is one launch: the norm runs in the GEMM's
    prologue and the bias + activation in its epilogue (norm_int8_linear), so neither the norm's
    output nor the pre-activation is written. Otherwise: the norm kernel, the GEMM, and bias_act
    when ``activation`` is given (``linear`` then has no bias of its own: act_bias is its bias)."""
    if linear.quantized and linear.reduce_group is None:
        return norm_int8_linear(x, norm.weight, norm.bias, linear.qweight, linear.scales,
                                act_bias if activation is not None else linear.bias, residual=residual,
                                rms=norm.kind == "rms", eps=norm.eps, activation=activation)
    h, z = norm(x, residual)
    y = linear(h)
    return (y if activation is None else bias_act(y, act_bias, activation)), z


def _linear(weights: list[Tensor], biases: list[Tensor | None], **kw: Any) -> InferenceLinear:
    return InferenceLinear(torch.cat(weights) if len(weights) > 1 else weights[0], fused_bias(weights, biases), **kw)


class InferenceMLP(nn.Module):
    """fc2(act(fc1(x))): fc1 is one GEMM over [gate | up] rows when gated; bias + activation fused
    (into fc1's GEMM when its weight is INT8)."""

    def __init__(self, mlp: MLPWeights, group: Any, **kw: Any) -> None:
        super().__init__()
        self.activation = mlp.activation
        self.fc1 = _linear(mlp.fc1, [None] * len(mlp.fc1), **kw)
        bias = fused_bias(mlp.fc1, mlp.fc1_bias)
        self.fc1_bias = None if bias is None else nn.Parameter(bias.detach().to(device=kw["device"], dtype=kw["dtype"]),
                                                               requires_grad=False)
        self.fc2 = InferenceLinear(mlp.fc2, mlp.fc2_bias, reduce_group=group, **kw)

    def forward(self, x: Tensor) -> Tensor:
        fc1 = self.fc1
        if fc1.quantized:  # the bias and activation run in the INT8 GEMM's epilogue: one launch
            h = int8_linear(x, fc1.qweight, fc1.scales, self.fc1_bias, activation=self.activation)
        else:
            h = bias_act(fc1(x), self.fc1_bias, self.activation)
        return self.fc2(h)

    def forward_norm(self, norm: InferenceNorm, x: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        """(self(norm(x + residual)), x + residual), the norm fused into fc1 (see norm_linear)."""
        h, z = norm_linear(norm, self.fc1, x, residual, activation=self.activation, act_bias=self.fc1_bias)
        return self.fc2(h), z


@dataclass
class StepState:
    """What every layer of one forward step shares (built once per step by the model).

    positions: int64 [batch, s] rotary / learned positions of the new tokens; lengths_before /
    lengths_after: int32 [batch] cache slots filled before / after the step (device tensors);
    past: the same count as a host int (every row holds the same number of slots); bias: fp32
    [batch, capacity], 0 for real tokens, -inf for padding slots; rotary: (cos, sin, interleaved)
    or None."""

    positions: Tensor
    lengths_before: Tensor
    lengths_after: Tensor
    past: int
    bias: Tensor | None
    rotary: tuple[Tensor, Tensor, bool] | None


class DecoderLayer(nn.Module):
    """One pre-LN decoder layer (see the module docstring) over a slice of heads."""

    def __init__(self, w: DecoderLayerWeights, heads: int, kv_heads: int, head_dim: int, *, group: Any,
                 dtype: torch.dtype, device: torch.device, quant: WeightQuant | None) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device, "quant": quant}
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.softmax_scale, self.window = float(w.softmax_scale), w.window
        a = w.attn
        self.ln1 = InferenceNorm(w.ln1, dtype, device)
        self.ln2 = None if w.ln2 is None else InferenceNorm(w.ln2, dtype, device)
        self.qkv = _linear([a.q, a.k, a.v], [a.q_bias, a.k_bias, a.v_bias], **kw)
        self.out = InferenceLinear(a.out, a.out_bias, reduce_group=group, **kw)
        self.mlp = InferenceMLP(w.mlp, group, **kw)

    def attention(self, qkv: Tensor, k_cache: Tensor, v_cache: Tensor, step: StepState) -> Tensor:
        """qkv: the QKV GEMM's output [batch, s, (heads + 2 kv_heads) * head_dim]."""
        batch, seq, _ = qkv.shape
        cos, sin, interleaved = step.rotary if step.rotary is not None else (None, None, False)
        q = rotary_kv_append(qkv, step.positions, cos, sin, k_cache, v_cache, step.lengths_before,
                             heads=self.heads, kv_heads=self.kv_heads, interleaved=interleaved,
                             q_in_place=cos is None)  # no rotary: attention reads q in the GEMM output
        if step.past == 0 and (self.window is None or seq <= self.window):
            bias = None if step.bias is None else step.bias[:, :seq]
            o = attention(q, k_cache[:, :, :seq], v_cache[:, :, :seq], causal=True, key_padding_bias=bias,
                          softmax_scale=self.softmax_scale)
        else:
            o = decode_attention(q, k_cache, v_cache, step.lengths_after, key_padding_bias=step.bias,
                                 window=self.window, softmax_scale=self.softmax_scale)
        return self.out(o.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))

    def forward(self, delta: Tensor, residual: Tensor | None, k_cache: Tensor, v_cache: Tensor,
                step: StepState) -> tuple[Tensor, Tensor]:
        """(delta, residual) in, (delta, residual) out; the hidden state is their sum. INT8: each
        norm runs inside the GEMM after it (norm_linear)."""
        if self.ln2 is None and not self.qkv.quantized:  # GPT-J: attention and MLP read one norm output
            h, x = self.ln1(delta, residual)
            return self.attention(self.qkv(h), k_cache, v_cache, step) + self.mlp(h), x
        qkv, x = norm_linear(self.ln1, self.qkv, delta, residual)
        a = self.attention(qkv, k_cache, v_cache, step)
        if self.ln2 is None:  # GPT-J, INT8: fc1 runs ln1 in its prologue as the QKV GEMM did
            return a + self.mlp.forward_norm(self.ln1, x, None)[0], x
        return self.mlp.forward_norm(self.ln2, a, x)


class EncoderLayer(nn.Module):
    """A post-LN BERT/RoBERTa encoder layer that HF's encoder calls in place of its BertLayer:
    ``layer(hidden_states, attention_mask, ...)`` -> hidden_states (transformers 5.x)."""

    def __init__(self, w: EncoderLayerWeights, *, group: Any, dtype: torch.dtype, device: torch.device,
                 quant: WeightQuant | None, return_tuple: bool = False) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device, "quant": quant}
        a: AttentionWeights = w.attn
        self.heads, self.head_dim = w.heads, w.head_dim
        self.return_tuple = return_tuple
        self.qkv = _linear([a.q, a.k, a.v], [a.q_bias, a.k_bias, a.v_bias], **kw)
        self.out = InferenceLinear(a.out, a.out_bias, reduce_group=group, **kw)
        self.ln_attn = InferenceNorm(w.ln_attn, dtype, device)
        self.mlp = InferenceMLP(w.mlp, group, **kw)
        self.ln_out = InferenceNorm(w.ln_out, dtype, device)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, *args: Any, **kwargs: Any):
        from tachyon.nn.transformer_kernel.layer import key_padding_bias

        for value in (*args, *(v for k, v in kwargs.items() if k not in _ENCODER_IGNORED)):
            if value is not None and value is not False:
                raise ValueError("the injected encoder layer takes hidden_states and attention_mask only (no "
                                 "cross-attention, KV cache or head mask)")
        batch, seq, _ = hidden_states.shape
        x = hidden_states.to(self.qkv.bias.dtype if self.qkv.bias is not None else hidden_states.dtype)
        bias = key_padding_bias(attention_mask, batch, seq, x.device)
        qkv = self.qkv(x).view(batch, seq, 3, self.heads, self.head_dim)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        o = attention(q, k, v, key_padding_bias=bias)
        a = self.out(o.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))
        y, _ = self.ln_attn(a, x)
        out, _ = self.ln_out(self.mlp(y), y)
        return (out,) if self.return_tuple else out


_ENCODER_IGNORED = frozenset({"position_ids", "cache_position", "use_cache", "return_dict", "output_hidden_states",
                              "output_attentions"})


__all__ = ["DecoderLayer", "EncoderLayer", "InferenceLinear", "InferenceMLP", "InferenceNorm", "StepState"]

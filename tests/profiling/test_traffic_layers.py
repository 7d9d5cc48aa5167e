"""TransformerLayer's launches and bytes per training step (forward + backward), pinned on a small
shape in its GPT configuration (LayerNorm, tanh GELU, biases, dropout, causal) and its Llama
configuration (RMSNorm, SwiGLU, RoPE, GQA, no bias, no dropout), Triton kernels under the
interpreter.

The launches are the lists below and nothing else runs: no add of residual gradients (the norms'
backward kernels add them), no concatenation of dq, dk, dv or reduction for the QKV bias (the
packed attention op writes one packed gradient and sums the bias gradient), no separate norm
pass after a residual add (bias_dropout_add_layer_norm), one draw for all dropout seeds. Above the
minimum's launches (tachyon.profiling.traffic_minimum) are only: the seed draw, the sums of the
backward kernels' per-program partial sums, and (Llama) RoPE as its own launch each way. A change
that adds or removes a launch must change these lists.
"""

from __future__ import annotations

import torch

from tachyon.nn import TransformerLayer
from tachyon.nn.rope import RotaryTables
from tachyon.profiling import TrafficCounter
from tachyon.profiling.traffic_minimum import transformer_layer_minimum

BATCH, SEQ, HIDDEN, HEADS = 2, 40, 64, 4
GPT_FFN, LLAMA_FFN, LLAMA_KV_HEADS = 256, 96, 2
GOAL_LAUNCHES, GOAL_BYTES = 28, 1.15  # issue 21: launches per layer step; bytes over the layer's minimum

MM = "aten.mm.default"
GPT_FORWARD = [
    "aten.randint.low",  # the three dropout seeds, one draw
    "tachyon::norm_fwd > triton _norm_fwd_kernel",  # norm1 (x also returned as the residual branch)
    MM,  # QKV, without its bias (added by the attention kernels)
    "tachyon::attention_packed_fwd > triton _fwd_kernel",
    MM,  # proj, without its bias
    "tachyon::bias_dropout_add_norm_fwd > triton _bda_norm_fwd_kernel",  # h = x + dropout(a + b); norm2(h)
    "tachyon::gemm_bias_act > triton _gemm_act_kernel",  # fc1 with its bias and the GELU in its epilogue
    MM,  # fc2, without its bias
    "tachyon::bias_dropout_add_fwd > triton _bda_fwd_kernel",
]
GPT_BACKWARD = [
    "tachyon::dropout_bwd > triton _bda_bwd_kernel",
    "tachyon::dropout_bwd > triton _sum_partials_kernel",  # fc2 bias
    MM,  # fc2 dW
    "tachyon::gemm_act_grad > triton _gemm_act_kernel",  # fc2 dX with the GELU's backward in its epilogue
    "tachyon::gemm_act_grad > triton _sum_partials_kernel",  # fc1 bias
    MM, MM,  # fc1
    "tachyon::bias_dropout_add_norm_bwd > triton _bda_norm_bwd_kernel",  # adds h's residual gradient
    "tachyon::bias_dropout_add_norm_bwd > triton _sum_partials_kernel",  # proj bias, norm2 weight and bias
    MM, MM,  # proj
    "tachyon::attention_packed_bwd > triton _bwd_one_kernel",  # dq, dk, dv into one packed gradient
    "tachyon::attention_packed_bwd > triton _sum_partials_kernel",  # QKV bias
    MM, MM,  # QKV
    "tachyon::norm_bwd > triton _norm_bwd_kernel",  # adds x's residual gradient
    "tachyon::norm_bwd > triton _sum_partials_kernel",  # norm1 weight and bias
]
LLAMA_FORWARD = [
    "tachyon::norm_fwd > triton _norm_fwd_kernel",
    MM,  # QKV
    "tachyon::attention_packed_fwd > triton _rope_kernel",  # q, k rotated into one new tensor; v stays
    "tachyon::attention_packed_fwd > triton _fwd_kernel",
    MM,  # proj
    "tachyon::bias_dropout_add_norm_fwd > triton _bda_norm_fwd_kernel",
    "tachyon::gemm_bias_act > triton _gemm_act_kernel",  # fc1 (gate and up), silu(gate) * up in its epilogue
    MM,  # fc2
    "tachyon::bias_dropout_add_fwd > triton _bda_fwd_kernel",  # the residual add
]
LLAMA_BACKWARD = [
    MM,  # fc2 dW
    "tachyon::gemm_act_grad > triton _gemm_act_kernel",  # fc2 dX, SwiGLU's backward in its epilogue
    MM, MM,  # fc1
    "tachyon::bias_dropout_add_norm_bwd > triton _bda_norm_bwd_kernel",
    "tachyon::bias_dropout_add_norm_bwd > triton _sum_partials_kernel",  # norm2 weight
    MM, MM,  # proj
    "tachyon::attention_packed_bwd > triton _bwd_one_kernel",
    "tachyon::attention_packed_bwd > triton _rope_kernel",  # dq, dk rotated back in place
    MM, MM,  # QKV
    "tachyon::norm_bwd > triton _norm_bwd_kernel",
    "tachyon::norm_bwd > triton _sum_partials_kernel",  # norm1 weight
]


def _count(layer: TransformerLayer, **kw) -> TrafficCounter:
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    grad = torch.randn(BATCH, SEQ, HIDDEN)
    with TrafficCounter() as counter:
        layer(x, **kw).backward(grad)
    return counter


def _check(counter: TrafficCounter, forward: list[str], backward: list[str], minimum) -> None:
    fwd = [e.label for e in counter.events if not e.backward]
    bwd = [e.label for e in counter.events if e.backward]
    assert fwd == forward, f"forward launches changed:\n{counter.table()}"
    assert bwd == backward, f"backward launches changed:\n{counter.table()}"
    assert counter.total.launches == len(forward) + len(backward) <= GOAL_LAUNCHES
    ratio = counter.total.bytes / minimum.bytes
    assert ratio <= GOAL_BYTES, f"{ratio:.3f}x the minimum of {minimum.bytes} bytes\n{counter.table()}"


def test_gpt_transformer_layer_step_takes_26_launches():
    layer = TransformerLayer(HIDDEN, GPT_FFN, HEADS, hidden_dropout=0.1, attention_dropout=0.1,
                             attn_input_format="bshd", backend="triton").train()
    counter = _count(layer)
    minimum = transformer_layer_minimum(BATCH, SEQ, HIDDEN, GPT_FFN, HEADS)
    _check(counter, GPT_FORWARD, GPT_BACKWARD, minimum)
    assert counter.total.launches == 26
    assert minimum.launches == 20  # above it: the seed draw and five sums of partial sums


def test_llama_transformer_layer_step_takes_23_launches():
    layer = TransformerLayer(HIDDEN, LLAMA_FFN, HEADS, num_gqa_groups=LLAMA_KV_HEADS, normalization="RMSNorm",
                             activation="swiglu", bias=False, hidden_dropout=0.0, attention_dropout=0.0,
                             attn_input_format="bshd", backend="triton").train()
    angles = torch.outer(torch.arange(SEQ, dtype=torch.float32), torch.rand(HIDDEN // HEADS // 2)).repeat(1, 2)
    counter = _count(layer, rotary_pos_emb=RotaryTables(angles.cos(), angles.sin()))
    minimum = transformer_layer_minimum(BATCH, SEQ, HIDDEN, LLAMA_FFN, HEADS, LLAMA_KV_HEADS,
                                        normalization="RMSNorm", gated=True, bias=False, dropout=False)
    _check(counter, LLAMA_FORWARD, LLAMA_BACKWARD, minimum)
    assert counter.total.launches == 23
    assert minimum.launches == 19  # above it: RoPE each way (the minimum rotates inside the attention loads), two sums

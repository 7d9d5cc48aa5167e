"""The BERT kernel layer's bytes and launches per training step, pinned exactly on a small shape.

Post-LN, no memory flags, dropout on, Triton kernels under the interpreter: the launches are the
list below (12 GEMMs, two of them Triton GEMMs with GELU and its backward in their epilogues,
4 attention launches, 7 fused elementwise launches, the seed counter) and
nothing else runs: no copy, zero fill, add or reduction outside a kernel. The bytes are the
shape's minimum (tachyon.profiling.traffic_minimum) plus four named extras, each computed here;
a change that moves one byte more or less must change this test and say why.
"""

from __future__ import annotations

import torch

from tachyon.nn import TransformerKernelConfig, TransformerKernelLayer
from tachyon.profiling import TrafficCounter
from tachyon.profiling.traffic_minimum import bert_layer_minimum

BATCH, SEQ, HIDDEN, HEADS, FFN = 2, 40, 64, 4, 256
F32, SEED = 4, 8  # fp32 elements; a 0-dim int64 dropout seed, read by the kernel that uses it

FORWARD = [
    "tachyon::next_dropout_seeds > triton _chained_seeds_kernel",
    "aten.mm.default",  # QKV, without its bias (added by the attention kernels)
    "tachyon::attention_packed_fwd > triton _fwd_kernel",
    "aten.mm.default",  # attention output
    "tachyon::bias_dropout_add_norm_fwd > triton _bda_norm_fwd_kernel",
    "tachyon::gemm_bias_act > triton _gemm_act_kernel",  # intermediate, bias + GELU in its epilogue
    "aten.mm.default",  # output
    "tachyon::bias_dropout_add_norm_fwd > triton _bda_norm_fwd_kernel",
]
BACKWARD = [
    "tachyon::bias_dropout_add_norm_bwd > triton _bda_norm_bwd_kernel",
    "tachyon::bias_dropout_add_norm_bwd > triton _sum_partials_kernel",
    "aten.mm.default",  # output dW
    "tachyon::gemm_act_grad > triton _gemm_act_kernel",  # output dX, GELU's backward in its epilogue
    "tachyon::gemm_act_grad > triton _sum_partials_kernel",  # the intermediate bias gradient
    "aten.addmm.default",  # intermediate dX, accumulated into y1's residual gradient
    "aten.mm.default",  # intermediate dW
    "tachyon::bias_dropout_add_norm_bwd > triton _bda_norm_bwd_kernel",
    "tachyon::bias_dropout_add_norm_bwd > triton _sum_partials_kernel",
    "aten.mm.default", "aten.mm.default",  # attention output: dW, dX
    "tachyon::attention_packed_bwd > triton _bwd_one_kernel",  # dK/dV of a key block, then dQ of a query block
    "tachyon::attention_packed_bwd > triton _sum_partials_kernel",  # the QKV bias gradient
    "aten.addmm.default",  # QKV dX, accumulated into x's residual gradient
    "aten.mm.default",  # QKV dW
]


def _count() -> TrafficCounter:
    config = TransformerKernelConfig(
        batch_size=BATCH, max_seq_length=SEQ, hidden_size=HIDDEN, intermediate_size=FFN, heads=HEADS,
        attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1, num_hidden_layers=2, initializer_range=0.02, seed=3,
        pre_layer_norm=False)
    layer = TransformerKernelLayer(config, backend="triton").train()
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    grad = torch.randn(BATCH, SEQ, HIDDEN)
    with TrafficCounter() as counter:
        layer(x).backward(grad)
    return counter


def test_bert_kernel_layer_step_launches_and_bytes_are_pinned():
    counter = _count()
    fwd = [e.label for e in counter.events if not e.backward]
    bwd = [e.label for e in counter.events if e.backward]
    assert fwd == FORWARD, f"forward launches changed:\n{counter.table()}"
    assert bwd == BACKWARD, f"backward launches changed:\n{counter.table()}"
    assert counter.total.launches == 23

    minimum = bert_layer_minimum(BATCH, SEQ, HIDDEN, FFN, HEADS)
    assert minimum.launches == 18
    # 1. dropout seeds: the counter kernel reads key and counter, writes the counter and 3 seeds;
    #    6 kernels read a seed (attention forward and backward; both LNs forward and backward)
    seeds = 2 * SEED + 4 * SEED + 6 * SEED
    # 2. the QKV bias is read by the two attention kernels, not once by the GEMM
    qkv_bias = 3 * HIDDEN * F32
    # 3. the attention backward is one kernel, as in the minimum: q, k, v, dO, O and the
    #    logsumexp are read once, and no delta is written (each program recomputes it from O)
    # 4. weight and bias gradients are summed from per-program fp32 partial rows: written by the
    #    kernel and read by sum_partials (which writes the final sums, as the minimum does)
    partial_reads = [e.traffic.read for e in counter.events if e.op == "triton _sum_partials_kernel"]
    assert len(partial_reads) == 4
    partials = 2 * sum(partial_reads)
    assert partials < 0.01 * minimum.bytes, "the partial sums are small beside the step"
    expected = minimum.bytes + seeds + qkv_bias + partials
    assert counter.total.bytes == expected, (
        f"{counter.total.bytes} bytes, expected {expected} = minimum {minimum.bytes} + seeds {seeds} + QKV bias "
        f"{qkv_bias} + partial sums {partials}\n{counter.table()}")
    # compulsory traffic is never above what the kernels request
    assert counter.total.requested >= counter.total.bytes

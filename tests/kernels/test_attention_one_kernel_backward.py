"""The one-kernel attention backward (``one_kernel_backward=True``): the same gradients bit for bit
as the two-kernel backward (dQ with delta, then dK/dV), for attention() and attention_qkvpacked()
(with the QKV bias), in one launch (plus the bias gradient's sum), counted."""

from __future__ import annotations

import pytest
import torch

from tachyon.kernels.attention import attention, attention_qkvpacked, padding_bias_from_mask
from tachyon.profiling import TrafficCounter

CASES = [  # (batch, seq_q, seq_k, heads, kv_heads, head_dim, causal, padded, dropout_p)
    (2, 37, 37, 2, 2, 16, False, True, 0.1),  # padding mask, dropout (2 heads: the interpreter's cost)
    (1, 40, 40, 4, 2, 16, True, False, 0.0),  # GQA, causal
    (1, 19, 45, 2, 1, 8, True, False, 0.2),  # MQA, more keys than queries (bottom-right causal)
    (1, 45, 19, 2, 2, 8, False, False, 0.0),  # more queries than keys: programs with dQ work only
]


def _grads(fn, inputs, dout):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    return [out, *torch.autograd.grad(out, inputs, dout)]


def _assert_equal(got, want, names):
    for name, a, b in zip(names, got, want):
        assert torch.equal(a, b), f"{name}: max abs diff {(a - b).abs().max().item():.3g} (must be bit-identical)"


@pytest.mark.parametrize("case", CASES, ids=lambda c: "q{1}k{2}h{3}kv{4}d{5}c{6}p{7}drop{8}".format(*c))
def test_one_kernel_backward_equals_two_kernels_bitwise(case):
    batch, seq_q, seq_k, heads, kv_heads, d, causal, padded, p = case
    q = torch.randn(batch, heads, seq_q, d)
    k, v = torch.randn(batch, kv_heads, seq_k, d), torch.randn(batch, kv_heads, seq_k, d)
    bias = None
    if padded:
        keep = torch.ones(batch, seq_k, dtype=torch.bool)
        keep[0, -5:] = False
        bias = padding_bias_from_mask(keep)
    dout = torch.randn(batch, heads, seq_q, d)
    kw = dict(causal=causal, key_padding_bias=bias, dropout_p=p, seed=77 if p else None, backend="triton")
    want = _grads(lambda *t: attention(*t, **kw), (q, k, v), dout)
    with TrafficCounter() as counter:
        got = _grads(lambda *t: attention(*t, one_kernel_backward=True, **kw), (q, k, v), dout)
    _assert_equal(got, want, ["out", "dq", "dk", "dv"])
    ops = [e.op for e in counter.events if e.backward]
    assert ops == ["triton _bwd_one_kernel"], ops


@pytest.mark.parametrize("fmt,causal,p", [("bshd", False, 0.1), ("sbhd", True, 0.0)])
def test_one_kernel_backward_packed_with_qkv_bias(fmt, causal, p):
    """Packed QKV with its bias: dqkv and the bias gradient equal the two-kernel backward's; the
    backward is the one kernel and the bias gradient's sum of partials, delta never written."""
    batch, seq, heads, kv_heads, d = 2, 40, 2, 1, 16  # GQA, 2 query heads per kv head
    width = (heads + 2 * kv_heads) * d
    shape = (seq, batch) if fmt == "sbhd" else (batch, seq)
    qkv, b = torch.randn(*shape, width), torch.randn(width)
    dctx = torch.randn(*shape, heads * d)
    kw = dict(qkv_bias=None, qkv_format=fmt, causal=causal, dropout_p=p, seed=5 if p else None, backend="triton")

    def run(one_kernel):
        def fn(t, bias):
            return attention_qkvpacked(t, heads, kv_heads, **{**kw, "qkv_bias": bias}, one_kernel_backward=one_kernel)
        return _grads(fn, (qkv, b), dctx)

    with TrafficCounter() as two:  # counting changes no result: the reference and the two-kernel counts
        want = run(False)
    with TrafficCounter() as one:
        got = run(True)
    _assert_equal(got, want, ["ctx", "dqkv", "dqkv_bias"])
    ops = [e.op for e in one.events if e.backward]
    assert ops == ["triton _bwd_one_kernel", "triton _sum_partials_kernel"], ops
    # one launch fewer, and delta [b, h, s] fp32 is neither written by dQ nor read by dK/dV
    delta = batch * heads * seq * 4
    one_bwd, two_bwd = one.phase(True), two.phase(True)
    assert two_bwd.launches - one_bwd.launches == 1
    assert two_bwd.written - one_bwd.written == delta, (one.table(), two.table())
    # the two kernels each read qkv, dO, the logsumexp and the bias; dK/dV also reads delta. The
    # one kernel reads each once (O too, as dQ did), so its reads are one kernel's fewer
    qkv_bytes, dout_bytes, lse = qkv.numel() * 4, dctx.numel() * 4, batch * heads * seq * 4
    assert two_bwd.read - one_bwd.read == qkv_bytes + dout_bytes + lse + width * 4 + delta, (one.table(), two.table())


def test_one_kernel_backward_flag_is_checked():
    q = torch.randn(1, 2, 8, 8)
    with pytest.raises(ValueError, match="one_kernel_backward"):
        attention(q, q, q, one_kernel_backward=1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_one_kernel_backward_on_a_gpu_follows_the_2x_rule(dtype, causal):
    """Compiled for the GPU (autotuned blocks, fp16/bf16): the output and gradients are within
    2x of PyTorch's own error in the dtype (SDPA), against SDPA in fp32, with GQA."""
    import torch.nn.functional as F

    from tests.utils import assert_close_to_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 333, 64, device="cuda", generator=gen)
    k, v = (torch.randn(2, 4, 333, 64, device="cuda", generator=gen) for _ in range(2))
    dout = torch.randn(2, 8, 333, 64, device="cuda", generator=gen)

    def sdpa(*t):
        return F.scaled_dot_product_attention(*t, is_causal=causal, enable_gqa=True)

    low = [t.to(dtype) for t in (q, k, v)]
    got = _grads(lambda *t: attention(*t, causal=causal, one_kernel_backward=True, backend="triton"), low, dout.to(dtype))
    torch_low = _grads(sdpa, low, dout.to(dtype))
    oracle = _grads(sdpa, (q, k, v), dout)
    for name, a, lowp, ref in zip(["out", "dq", "dk", "dv"], got, torch_low, oracle):
        assert_close_to_reference(a, lowp, ref, name=name)

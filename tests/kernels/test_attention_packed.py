"""attention_qkvpacked: the same numbers as attention() on q, k, v split from the packed tensor
(forward and the packed gradient), with no copy around the kernels (counted), and bad input."""

from __future__ import annotations

import pytest
import torch

from tachyon.kernels.attention import attention, attention_qkvpacked, padding_bias_from_mask
from tachyon.profiling import TrafficCounter
from tests.utils.asserts import assert_close

CASES = [  # (batch, seq, heads, kv_heads, head_dim, qkv_format, causal, padded, dropout_p)
    (2, 37, 2, 2, 16, "bshd", False, True, 0.1),  # BERT-like: padding mask, dropout (2 heads: the interpreter's cost)
    (2, 33, 4, 2, 16, "sbhd", True, False, 0.0),  # GQA, TE's sbhd, causal
    (1, 19, 2, 1, 8, "bshd", True, False, 0.2),  # MQA, head_dim below the 16 block
]


def _unpacked(qkv, heads, kv_heads, sbhd):
    """q, k, v [b, h, s, d] split from qkv the usual way (copies in backward: stack/cat)."""
    d = qkv.shape[-1] // (heads + 2 * kv_heads)
    t = qkv.view(*qkv.shape[:2], heads + 2 * kv_heads, d)
    order = (1, 2, 0, 3) if sbhd else (0, 2, 1, 3)
    return [x.permute(order) for x in t.split([heads, kv_heads, kv_heads], dim=2)]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}s{c[1]}h{c[2]}kv{c[3]}d{c[4]}-{c[5]}")
def test_packed_equals_attention_on_the_split_tensors(case, backend):
    batch, seq, heads, kv_heads, head_dim, fmt, causal, padded, p = case
    sbhd = fmt == "sbhd"
    shape = (seq, batch) if sbhd else (batch, seq)
    qkv = torch.randn(*shape, (heads + 2 * kv_heads) * head_dim, requires_grad=True)
    bias = None
    if padded:
        keep = torch.ones(batch, seq, dtype=torch.bool)
        keep[0, -5:] = False
        bias = padding_bias_from_mask(keep)
    kw = dict(causal=causal, key_padding_bias=bias, dropout_p=p, seed=1234 if p else None, backend=backend)
    ctx = attention_qkvpacked(qkv, heads, kv_heads, qkv_format=fmt, **kw)
    dctx = torch.randn_like(ctx)
    (dqkv,) = torch.autograd.grad(ctx, qkv, dctx)

    qkv2 = qkv.detach().clone().requires_grad_()
    out = attention(*_unpacked(qkv2, heads, kv_heads, sbhd), **kw)  # [b, h, s, d]
    ctx2 = (out.permute(2, 0, 1, 3) if sbhd else out.transpose(1, 2)).reshape(ctx.shape)
    (dqkv2,) = torch.autograd.grad(ctx2, qkv2, dctx)
    # the same kernels on the same values through other strides: bit-identical
    assert ctx.shape == ctx2.shape and ctx.is_contiguous()
    assert torch.equal(ctx, ctx2), f"context differs: max abs diff {(ctx - ctx2).abs().max().item():.3g}"
    assert torch.equal(dqkv, dqkv2), f"dqkv differs: max abs diff {(dqkv - dqkv2).abs().max().item():.3g}"


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}s{c[1]}h{c[2]}kv{c[3]}d{c[4]}-{c[5]}")
def test_qkv_bias_is_added_on_load_and_its_gradient_is_the_column_sums(case, deterministic, backend):
    """qkv_bias=b on qkv gives the context of qkv + b (bit-identical in fp32: the same sums), the
    same dqkv, and db = the column sums of dqkv (summed in another order: the fp32 table)."""
    batch, seq, heads, kv_heads, head_dim, fmt, causal, padded, p = case
    shape = (seq, batch) if fmt == "sbhd" else (batch, seq)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(*shape, width, requires_grad=True)
    b = torch.randn(width, requires_grad=True)
    bias = None
    if padded:
        keep = torch.ones(batch, seq, dtype=torch.bool)
        keep[0, -5:] = False
        bias = padding_bias_from_mask(keep)
    kw = dict(qkv_format=fmt, causal=causal, key_padding_bias=bias, dropout_p=p, seed=99 if p else None,
              deterministic=deterministic, backend=backend)
    ctx = attention_qkvpacked(qkv, heads, kv_heads, qkv_bias=b, **kw)
    dctx = torch.randn_like(ctx)
    dqkv, db = torch.autograd.grad(ctx, (qkv, b), dctx)
    biased = (qkv.detach() + b.detach()).requires_grad_()
    want = attention_qkvpacked(biased, heads, kv_heads, **kw)
    (want_dqkv,) = torch.autograd.grad(want, biased, dctx)
    assert torch.equal(ctx, want), f"context differs: max abs diff {(ctx - want).abs().max().item():.3g}"
    assert_close(dqkv, want_dqkv, name="dqkv")
    assert_close(db, want_dqkv.reshape(-1, width).sum(0), name="dqkv_bias")


def test_qkv_bias_gradient_costs_one_small_launch():
    """The bias gradient is summed from per-program partials (one row per dK/dV program): one more
    launch that reads [programs, width] fp32 and writes [width]; nothing reads dqkv again."""
    batch, seq, heads, d = 2, 40, 2, 16
    width = 3 * heads * d
    qkv = torch.randn(batch, seq, width, requires_grad=True)
    b = torch.randn(width, requires_grad=True)
    dctx = torch.randn(batch, seq, heads * d)
    with TrafficCounter() as with_bias:
        torch.autograd.grad(attention_qkvpacked(qkv, heads, qkv_bias=b, backend="triton"), (qkv, b), dctx)
    with TrafficCounter() as without:
        torch.autograd.grad(attention_qkvpacked(qkv, heads, backend="triton"), qkv, dctx)
    ops = [e.op for e in with_bias.events]
    assert ops == ["triton _fwd_kernel", "triton _bwd_dq_kernel", "triton _bwd_dkdv_kernel",
                   "triton _sum_partials_kernel"], ops
    programs = batch * -(-seq // 32)  # interpreter tiles: BLOCK_N = 32
    extra = with_bias.total.bytes - without.total.bytes
    # each of the three kernels reads the bias (width) once more; dK/dV writes the partials,
    # the sum reads them and writes db
    assert extra == (3 * width + 2 * programs * width + width) * 4, (extra, with_bias.table())


def test_packed_moves_no_copy_around_the_kernels():
    """Counted: the forward is one kernel and the backward two (dQ with delta, then dK/dV); no
    copy of q, k, v, the context or their gradients. The unpacked call on views of the same
    tensor needs one: the cat of dq, dk, dv (split's backward)."""
    batch, seq, heads, d = 1, 32, 2, 16
    qkv = torch.randn(batch, seq, 3 * heads * d, requires_grad=True)
    dctx = torch.ones(batch, seq, heads * d)
    with TrafficCounter() as packed:
        attention_qkvpacked(qkv, heads, backend="triton").backward(dctx)
    ops = [e.op for e in packed.events]
    assert ops == ["triton _fwd_kernel", "triton _bwd_dq_kernel", "triton _bwd_dkdv_kernel"], \
        f"packed attention ran {ops}"
    # the backward reads q, k, v, the context and its gradient once each, beside lse and delta
    q_k_v_out_dout = (3 + 1 + 1) * batch * seq * heads * d * 4
    bwd = packed.phase(True)
    stats = batch * heads * seq * 4
    assert bwd.read == q_k_v_out_dout + stats + (q_k_v_out_dout - batch * seq * heads * d * 4) + 2 * stats, \
        "dQ reads q, k, v, out, dO, lse; dK/dV reads q, k, v, dO, lse, delta"
    assert bwd.written == 3 * batch * seq * heads * d * 4 + stats  # dq, dk, dv and delta
    qkv.grad = None
    with TrafficCounter() as unpacked:
        out = attention(*_unpacked(qkv, heads, heads, False), backend="triton")
        out.transpose(1, 2).reshape(batch, seq, heads * d).backward(dctx)
    copies = [e.op for e in unpacked.events if not e.op.startswith("triton")]
    assert copies == ["aten.cat.default"], f"the unpacked call's copies: {copies}"
    # the cat reads dq, dk, dv and writes dqkv
    assert unpacked.total.bytes == packed.total.bytes + 2 * qkv.numel() * 4


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_attention_writes_its_output_in_q_memory_order_and_reads_a_strided_gradient(fmt):
    """The usual unpacked pattern (q, k, v split from one projection, the output transposed back
    to [b, s, h * d]): the output is allocated in q's memory order, so the transpose + reshape is
    a view; its gradient comes back as a strided view, read in place; only split's backward
    (the cat of dq, dk, dv) copies. Gradients equal those of contiguous q, k, v."""
    b, s, h, d = 2, 21, 2, 16
    sbhd = fmt == "sbhd"
    qkv = torch.randn(*((s, b) if sbhd else (b, s)), 3 * h * d, requires_grad=True)
    dctx = torch.randn(*qkv.shape[:2], h * d)

    def back_to_hidden(o):
        return (o.permute(2, 0, 1, 3) if sbhd else o.transpose(1, 2)).reshape(*qkv.shape[:2], h * d)

    with TrafficCounter() as counter:
        q, k, v = _unpacked(qkv, h, h, sbhd)
        out = attention(q, k, v, backend="triton")
        ctx = back_to_hidden(out)
        ctx.backward(dctx)
    assert ctx._base is not None or ctx.data_ptr() == out.data_ptr(), "the reshape copied the output"
    copies = [(e.backward, e.label) for e in counter.events if not e.op.startswith("triton")]
    assert copies == [(True, "aten.cat.default")], copies
    q2, k2, v2 = (t.detach().contiguous().requires_grad_() for t in _unpacked(qkv, h, h, sbhd))
    out2 = attention(q2, k2, v2, backend="triton")
    assert out2.is_contiguous(), "a contiguous q gives a contiguous output"
    assert torch.equal(back_to_hidden(out2), ctx)
    grads = torch.autograd.grad(back_to_hidden(out2), (q2, k2, v2), dctx)
    qkv_grad = torch.cat([g.permute(2, 0, 1, 3) if sbhd else g.transpose(1, 2) for g in grads], dim=2)
    assert torch.equal(qkv_grad.reshape(qkv.shape), qkv.grad)


def test_bad_inputs_name_the_argument_and_what_is_allowed():
    qkv = torch.randn(2, 8, 3 * 2 * 4)
    with pytest.raises(ValueError, match=r"qkv must be a 3-d tensor"):
        attention_qkvpacked(qkv[0], 2)
    with pytest.raises(ValueError, match=r"qkv_format='bhsd' is not supported; allowed: 'bshd', 'sbhd'"):
        attention_qkvpacked(qkv, 2, qkv_format="bhsd")
    with pytest.raises(ValueError, match=r"last dim 24 is not \(num_heads \+ 2 \* num_kv_heads\) \* head_dim = 7"):
        attention_qkvpacked(qkv, 3, 2)
    with pytest.raises(ValueError, match=r"num_kv_heads must be an int >= 1"):
        attention_qkvpacked(qkv, 2, 0)
    with pytest.raises(ValueError, match=r"heads must be a multiple of kv_heads"):
        attention_qkvpacked(torch.randn(2, 8, (3 + 2 * 2) * 4), 3, 2)
    with pytest.raises(ValueError, match=r"dropout_p=0.1 needs one"):
        attention_qkvpacked(qkv, 2, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"qkv_bias must be a 1-d tensor \[24\] \(qkv's last dim\); got \(8,\)"):
        attention_qkvpacked(qkv, 2, qkv_bias=torch.zeros(8))
    with pytest.raises(ValueError, match=r"qkv_bias has dtype torch.float64 but qkv has torch.float32"):
        attention_qkvpacked(qkv, 2, qkv_bias=torch.zeros(24, dtype=torch.float64))


@pytest.mark.slow  # compiling takes tens of seconds on a 2-core machine
def test_torch_compile_traces_the_packed_op():
    """The fake implementations give torch.compile the shapes: one graph, the same numbers."""
    qkv = torch.randn(2, 9, 3 * 2 * 8, requires_grad=True)

    def f(t):
        return attention_qkvpacked(t, 2, causal=True, backend="torch")

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    out = compiled(qkv)
    (grad,) = torch.autograd.grad(out.sum(), qkv)
    qkv2 = qkv.detach().clone().requires_grad_()
    want = f(qkv2)
    (want_grad,) = torch.autograd.grad(want.sum(), qkv2)
    assert torch.equal(out, want) and torch.equal(grad, want_grad)

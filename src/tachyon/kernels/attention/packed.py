"""Attention on the packed output of one fused QKV GEMM, returning the context ready for the
output projection: no copy on either side of the kernels.

    qkv = x @ w_qkv.t()                                     # the QKV GEMM without its bias
    ctx = attention_qkvpacked(qkv, num_heads, qkv_bias=b_qkv, dropout_p=0.1, seed=s)  # BERT
    ctx = attention_qkvpacked(qkv, 32, 8, qkv_format="sbhd", causal=True)   # GQA, TE's sbhd layout

Why: a layer that splits the QKV GEMM's output into q, k, v ([b, h, s, d] views) and calls
:func:`attention` gets its context without a copy (the output is written in q's memory order)
but pays in backward: autograd puts dq, dk, dv back into the packed layout with a copy
(``split``'s backward concatenates them; ``unbind``'s stacks them, and the permute back to
[b, s, 3, h, d] copies once more). Here the kernels read q, k, v straight from ``qkv`` through
strides, write the context straight into [b, s, h, d] memory, and in backward write dq, dk, dv
straight into one packed ``dqkv``.

``qkv_bias`` (the QKV GEMM's bias, the GEMM then run without it) is added by the kernels as they
load q, k and v, and its gradient (the column sums of dqkv) is summed by the dK/dV kernel from
what it holds, so no pass reads dqkv again for it (the bias gradient of a separate ``F.linear``
is such a pass: a reduction over all of dqkv). On the torch backend the bias is added and summed
by plain torch ops.

Layout of qkv's last dim: head-major, ``[q heads | k heads | v heads]``, each head ``head_dim``
wide, i.e. ``qkv.view(b, s, heads + 2 * kv_heads, head_dim)`` (TE's fused QKV and tachyon's BERT
layer; HF's separate q/k/v projections concatenated in that order).

Saved for backward: qkv (without the bias), the QKV bias, the context, the fp32 logsumexp
[b, h, s] and the fp32 key padding bias (what :func:`attention` saves, with q, k, v as one
tensor). Semantics (mask, dropout stream, scale, deterministic) are those of
:func:`tachyon.kernels.attention.attention`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tachyon.backend import resolve
from tachyon.kernels.attention import reference
from tachyon.kernels.attention.op import MAX_TRITON_HEAD_DIM, _check_flag, _check_inputs
from tachyon.kernels.common import check_same_device, lazy_module
from tachyon.kernels.random import join_seed, split_seed
from tachyon.kernels.registry import fused_op

_triton = lazy_module("tachyon.kernels.attention.triton")  # imported on first use (it imports Triton)
from tachyon.kernels.rope import reference as rope_reference

OP = "attention_qkvpacked"
QKV_FORMATS = ("bshd", "sbhd")


def _split(qkv: Tensor, heads: int, kv_heads: int, sbhd: bool) -> tuple[Tensor, Tensor, Tensor]:
    """q [b, h, s, d], k, v [b, kvh, s, d]: views of qkv [b, s, (h + 2 kvh) d] (or [s, b, ...])."""
    d = qkv.shape[-1] // (heads + 2 * kv_heads)
    t = qkv.view(*qkv.shape[:2], heads + 2 * kv_heads, d)
    order = (1, 2, 0, 3) if sbhd else (0, 2, 1, 3)
    q, k, v = t.split([heads, kv_heads, kv_heads], dim=2)
    return q.permute(order), k.permute(order), v.permute(order)


def _context_view(ctx: Tensor, heads: int, sbhd: bool) -> Tensor:
    """The [b, h, s, d] view of a context ctx [b, s, h d] (or [s, b, h d])."""
    t = ctx.view(*ctx.shape[:2], heads, ctx.shape[-1] // heads)
    return t.permute((1, 2, 0, 3) if sbhd else (0, 2, 1, 3))


def _one_kernel_kw(one_kernel: bool) -> dict:
    return {"one_kernel": True} if one_kernel else {}


def _split_qk(qk: Tensor, heads: int, kv_heads: int, sbhd: bool) -> tuple[Tensor, Tensor]:
    """q [b, h, s, d], k [b, kvh, s, d]: views of the rotated qk [b, s, (h + kvh) d] (or [s, b, ...])."""
    d = qk.shape[-1] // (heads + kv_heads)
    q, k = qk.view(*qk.shape[:2], heads + kv_heads, d).split([heads, kv_heads], dim=2)
    order = (1, 2, 0, 3) if sbhd else (0, 2, 1, 3)
    return q.permute(order), k.permute(order)


def _rotate(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, inverse: bool,
            out: tuple[Tensor, Tensor], backend: str) -> None:
    """RoPE of q [b, h, s, d] and k [b, kvh, s, d] (views) written into ``out`` (views of the same
    shapes; may be q and k themselves): one launch on the Triton backend."""
    qb, kb, ob = q.transpose(1, 2), k.transpose(1, 2), (out[0].transpose(1, 2), out[1].transpose(1, 2))
    if backend == "triton":
        from tachyon.kernels.rope import triton as rope_triton

        rope_triton.rotary(qb, kb, cos, sin, interleaved, inverse, out=ob)
    else:
        for x, o in zip((qb, kb), ob):
            o.copy_(rope_reference.rotary_forward(x, cos, sin, interleaved, inverse))


@fused_op("tachyon::attention_packed_fwd", mutates_args=(), triton_op=True)
def _packed_fwd(
    qkv: Tensor, qkv_bias: Tensor | None, bias: Tensor | None, heads: int, kv_heads: int, sbhd: bool, causal: bool,
    dropout_p: float, seed: int, seed_tensor: Tensor | None, softmax_scale: float, deterministic: bool,
    one_kernel_backward: bool, rope_cos: Tensor | None, rope_sin: Tensor | None, rope_interleaved: bool, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """qkv: [b, s, (h + 2 kvh) d] (sbhd: [s, b, ...]) with unit last stride; qkv_bias: None or
    [(h + 2 kvh) d]; rope_cos / rope_sin: None or fp32 [s, r] (then qkv_bias is None). Returns (ctx
    [b, s, h d] (sbhd: [s, b, h d]) contiguous in qkv's dtype, lse [b, h, s] fp32, the rotated
    q and k [b, s, (h + kvh) d] (sbhd: [s, b, ...]) or an empty tensor without RoPE)."""
    del deterministic, one_kernel_backward  # only the backward uses them (setup_context keeps them)
    ctx = qkv.new_empty((*qkv.shape[:2], heads * (qkv.shape[-1] // (heads + 2 * kv_heads))))
    out = _context_view(ctx, heads, sbhd)
    s = join_seed(seed, seed_tensor)
    plus_bias = backend != "triton" and qkv_bias is not None  # the kernels add it as they load
    q, k, v = _split(qkv + qkv_bias if plus_bias else qkv, heads, kv_heads, sbhd)
    qk_rot = qkv.new_empty(0)
    if rope_cos is not None:
        qk_rot = qkv.new_empty((*qkv.shape[:2], (heads + kv_heads) * (qkv.shape[-1] // (heads + 2 * kv_heads))))
        rotated = _split_qk(qk_rot, heads, kv_heads, sbhd)
        _rotate(q, k, rope_cos, rope_sin, rope_interleaved, False, rotated, backend)
        q, k = rotated
    if backend == "triton":
        tri = _triton()
        _, lse = tri.attention_fwd(q, k, v, bias, causal, dropout_p, s, softmax_scale, out=out, qkv_bias=qkv_bias)
    else:
        _, lse = reference.attention_forward(q, k, v, bias, causal, dropout_p, s, softmax_scale, out)
    return ctx, lse, qk_rot


@_packed_fwd.register_fake
def _(qkv, qkv_bias, bias, heads, kv_heads, sbhd, causal, dropout_p, seed, seed_tensor, softmax_scale, deterministic,
      one_kernel_backward, rope_cos, rope_sin, rope_interleaved, backend):
    d = qkv.shape[-1] // (heads + 2 * kv_heads)
    batch, seq = (qkv.shape[1], qkv.shape[0]) if sbhd else (qkv.shape[0], qkv.shape[1])
    qk_rot = qkv.new_empty((*qkv.shape[:2], (heads + kv_heads) * d)) if rope_cos is not None else qkv.new_empty(0)
    return (qkv.new_empty((*qkv.shape[:2], heads * d)), qkv.new_empty((batch, heads, seq), dtype=torch.float32),
            qk_rot)


@fused_op("tachyon::attention_packed_bwd", mutates_args=(), triton_op=True)
def _packed_bwd(
    dctx: Tensor, qkv: Tensor, qkv_bias: Tensor | None, ctx: Tensor, lse: Tensor, bias: Tensor | None, heads: int,
    kv_heads: int, sbhd: bool, causal: bool, dropout_p: float, seed: int, seed_tensor: Tensor | None,
    softmax_scale: float, deterministic: bool, one_kernel_backward: bool, qk_rot: Tensor | None,
    rope_cos: Tensor | None, rope_sin: Tensor | None, rope_interleaved: bool, backend: str,
) -> tuple[Tensor, Tensor]:
    """Returns (dqkv, qkv's shape and dtype, contiguous: dq, dk, dv are written into it in place
    (with RoPE: the gradients of the rotated q and k, then rotated back in place, one launch);
    the QKV bias gradient (its column sums, summed in fp32) or an empty tensor)."""
    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    grads = _split(dqkv, heads, kv_heads, sbhd)
    dout, out = _context_view(dctx, heads, sbhd), _context_view(ctx, heads, sbhd)
    s = join_seed(seed, seed_tensor)
    plus_bias = backend != "triton" and qkv_bias is not None
    q, k, v = _split(qkv + qkv_bias if plus_bias else qkv, heads, kv_heads, sbhd)
    if rope_cos is not None:
        q, k = _split_qk(qk_rot, heads, kv_heads, sbhd)
    if backend == "triton":
        tri = _triton()
        *_, dbias = tri.attention_bwd(dout, q, k, v, out, lse, bias, causal, dropout_p, s, softmax_scale, grads,
                                      qkv_bias, deterministic, **_one_kernel_kw(one_kernel_backward))
    else:
        for g, value in zip(grads, reference.attention_backward(dout, q, k, v, out, lse, bias, causal, dropout_p, s,
                                                                softmax_scale)):
            g.copy_(value)
        dbias = None
        if qkv_bias is not None:
            dbias = dqkv.reshape(-1, dqkv.shape[-1]).sum(0, dtype=torch.float32).to(qkv_bias.dtype)
    if rope_cos is not None:  # the transpose of the rotation, in place on dq and dk
        _rotate(grads[0], grads[1], rope_cos, rope_sin, rope_interleaved, True, grads[:2], backend)
    return dqkv, (dbias if dbias is not None else qkv.new_empty(0))


@_packed_bwd.register_fake
def _(dctx, qkv, qkv_bias, ctx, lse, bias, heads, kv_heads, sbhd, causal, dropout_p, seed, seed_tensor, softmax_scale,
      deterministic, one_kernel_backward, qk_rot, rope_cos, rope_sin, rope_interleaved, backend):
    dbias = torch.empty_like(qkv_bias) if qkv_bias is not None else qkv.new_empty(0)
    return torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device), dbias


def _setup_context(ctx, inputs, output) -> None:
    (qkv, qkv_bias, bias, heads, kv_heads, sbhd, causal, dropout_p, seed, seed_tensor, softmax_scale, deterministic,
     one_kernel, rope_cos, rope_sin, rope_interleaved, backend) = inputs
    context, lse, qk_rot = output
    ctx.set_materialize_grads(False)  # lse and qk_rot get no gradient: None, not a zero fill
    ctx.args = (heads, kv_heads, sbhd, causal, dropout_p, seed)
    ctx.softmax_scale, ctx.deterministic, ctx.one_kernel, ctx.backend = softmax_scale, deterministic, one_kernel, backend
    ctx.rope_interleaved = rope_interleaved
    ctx.save_for_backward(qkv, qkv_bias, context, lse, bias, seed_tensor, qk_rot if rope_cos is not None else None,
                          rope_cos, rope_sin)


def _backward(ctx, dctx, _dlse, _dqk_rot):
    qkv, qkv_bias, context, lse, bias, seed_tensor, qk_rot, rope_cos, rope_sin = ctx.saved_tensors
    heads, kv_heads, sbhd, causal, dropout_p, seed = ctx.args
    dqkv, dbias = _packed_bwd(dctx.contiguous(), qkv, qkv_bias, context, lse, bias, heads, kv_heads, sbhd, causal,
                              dropout_p, seed, seed_tensor, ctx.softmax_scale, ctx.deterministic, ctx.one_kernel,
                              qk_rot, rope_cos, rope_sin, ctx.rope_interleaved, ctx.backend)
    return (dqkv, dbias if qkv_bias is not None else None) + (None,) * 15


_packed_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention_qkvpacked(
    qkv: Tensor, num_heads: int, num_kv_heads: int | None = None, *, qkv_bias: Tensor | None = None,
    qkv_format: str = "bshd", causal: bool = False, key_padding_bias: Tensor | None = None, dropout_p: float = 0.0,
    seed: int | Tensor | None = None, softmax_scale: float | None = None, deterministic: bool = True,
    one_kernel_backward: bool = False, rotary_cos: Tensor | None = None, rotary_sin: Tensor | None = None,
    rotary_interleaved: bool = False, backend: str | None = None,
) -> Tensor:
    """Scaled dot-product attention on a packed QKV tensor (see the module docstring).

    qkv: [batch, seq, (num_heads + 2 * num_kv_heads) * head_dim] for ``qkv_format="bshd"``,
    [seq, batch, ...] for "sbhd"; float32, float16 or bfloat16; any strides with a contiguous last
    dim that can be viewed as [.., heads, head_dim]. num_kv_heads: default num_heads; num_heads
    must be a multiple of it. qkv_bias: None or [(num_heads + 2 * num_kv_heads) * head_dim] in
    qkv's dtype, the bias of the GEMM that produced qkv (run without it): attention sees
    ``qkv + qkv_bias``. rotary_cos, rotary_sin: None, or RoPE tables fp32 [seq, rotary_dim] as
    :func:`tachyon.kernels.rope.apply_rotary` takes them (with ``rotary_interleaved``): q and k are
    rotated first (one launch, into a new [.., (heads + kv_heads) * head_dim] tensor, saved for
    backward; v is read from qkv), and in backward their gradients are rotated back in place in
    the packed gradient (one launch, no concatenation); not with qkv_bias (the rotation would
    have to follow the bias add: run the GEMM with its bias). Other arguments as
    :func:`tachyon.kernels.attention.attention`.
    Returns the context [batch, seq, num_heads * head_dim] ([seq, batch, ...] for sbhd),
    contiguous, in qkv's dtype; its gradient flows back to qkv as one packed tensor.
    """
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if not isinstance(qkv, Tensor) or qkv.dim() != 3:
        got = tuple(qkv.shape) if isinstance(qkv, Tensor) else type(qkv).__name__
        raise ValueError(f"{OP}: qkv must be a 3-d tensor [batch, seq, (heads + 2 * kv_heads) * head_dim] (bshd) "
                         f"or [seq, batch, ...] (sbhd); got {got}")
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"{OP}: qkv_format={qkv_format!r} is not supported; allowed: {', '.join(map(repr, QKV_FORMATS))}")
    for name, n in (("num_heads", num_heads), ("num_kv_heads", kv_heads)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{OP}: {name} must be an int >= 1; got {n!r}")
    width = num_heads + 2 * kv_heads
    if qkv.shape[-1] % width:
        raise ValueError(f"{OP}: qkv's last dim {qkv.shape[-1]} is not (num_heads + 2 * num_kv_heads) * head_dim "
                         f"= {width} * head_dim for num_heads={num_heads}, num_kv_heads={kv_heads}")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    sbhd = qkv_format == "sbhd"
    q, k, v = _split(qkv, num_heads, kv_heads, sbhd)  # raises for strides that cannot be viewed per head
    if qkv_bias is not None:
        if not isinstance(qkv_bias, Tensor) or tuple(qkv_bias.shape) != (qkv.shape[-1],):
            got = tuple(qkv_bias.shape) if isinstance(qkv_bias, Tensor) else type(qkv_bias).__name__
            raise ValueError(f"{OP}: qkv_bias must be a 1-d tensor [{qkv.shape[-1]}] (qkv's last dim); got {got}")
        if qkv_bias.dtype != qkv.dtype:
            raise ValueError(f"{OP}: qkv_bias has dtype {qkv_bias.dtype} but qkv has {qkv.dtype}; they must match")
        check_same_device(OP, qkv=qkv, qkv_bias=qkv_bias)
        qkv_bias = qkv_bias.contiguous()
    _check_inputs(q, k, v, key_padding_bias, dropout_p, seed, softmax_scale, deterministic)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"{OP}: pass both rotary_cos and rotary_sin, or neither")
    if rotary_cos is not None:
        if qkv_bias is not None:
            raise ValueError(f"{OP}: rotary tables with qkv_bias are not supported (RoPE applies after the bias add); "
                             "run the QKV GEMM with its bias and pass qkv_bias=None")
        seq = qkv.shape[0] if qkv_format == "sbhd" else qkv.shape[1]
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, Tensor) or t.dim() != 2 or t.shape[0] != seq or t.dtype != torch.float32:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"{OP}: {name} must be fp32 [seq={seq}, rotary_dim]; got {got}")
        r = rotary_cos.shape[1]
        if rotary_sin.shape != rotary_cos.shape or r == 0 or r % 2 or r > q.shape[-1]:
            raise ValueError(f"{OP}: rotary tables must share one shape [seq, rotary_dim] with rotary_dim even and "
                             f"in [2, head_dim={q.shape[-1]}]; got {tuple(rotary_cos.shape)}, {tuple(rotary_sin.shape)}")
        check_same_device(OP, qkv=qkv, rotary_cos=rotary_cos, rotary_sin=rotary_sin)
        rotary_cos, rotary_sin = rotary_cos.contiguous(), rotary_sin.contiguous()
    chosen = resolve(qkv, backend)
    head_dim = q.shape[-1]
    if chosen == "triton" and head_dim > MAX_TRITON_HEAD_DIM:
        raise ValueError(f"{OP}: the Triton kernel supports head_dim up to {MAX_TRITON_HEAD_DIM}; got {head_dim} "
                         "(use backend='torch')")
    seed_int, seed_tensor = split_seed(seed) if dropout_p > 0.0 else (0, None)
    ctx, _, _ = _packed_fwd(
        qkv, qkv_bias, reference.masked_bias(key_padding_bias), num_heads, kv_heads, sbhd, bool(causal), float(dropout_p),
        seed_int, seed_tensor, reference.default_scale(head_dim, softmax_scale), deterministic,
        _check_flag(OP, "one_kernel_backward", one_kernel_backward), rotary_cos, rotary_sin,
        _check_flag(OP, "rotary_interleaved", rotary_interleaved), chosen,
    )
    return ctx


__all__ = ["QKV_FORMATS", "attention_qkvpacked"]

"""The attention op: validation, backend choice, torch.library registration and autograd.

    out = attention(q, k, v, causal=True)                                  # GPT / Llama
    out = attention(q, k, v, key_padding_bias=padding_bias_from_mask(m),   # BERT
                    dropout_p=0.1, seed=step_seed)

Both backends go through the same custom ops (``tachyon::attention_fwd`` /
``tachyon::attention_bwd``), so they keep the same tensors for backward and torch.compile traces
either through the fake implementations: q, k, v, out, the fp32 logsumexp [b, h, sq] and the
[b, sk] fp32 bias; never the [sq, sk] probabilities (backward recomputes them), never a dropout
mask (backward regenerates it from the seed).

The seed is an int or a 0-dim int64 tensor on q's device. Through the custom ops an int travels
as ``seed`` and a tensor as ``seed_tensor`` (a graph input under torch.compile, saved for
backward; 8 bytes), so a per-step tensor seed never forces a recompile.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tachyon.backend import auto_on_cuda, resolve
from tachyon.kernels import dispatch
from tachyon.kernels.attention import reference
from tachyon.kernels.common import check_dtype, check_same_device, lazy_module
from tachyon.kernels.random import check_seed, join_seed, split_seed
from tachyon.kernels.registry import fused_op

_triton = lazy_module("tachyon.kernels.attention.triton")  # imported on first use (it imports Triton)

OP = "attention"
MAX_TRITON_HEAD_DIM = 256


@fused_op("tachyon::attention_fwd", mutates_args=(), triton_op=True)
def _attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, key_padding_bias: Tensor | None, causal: bool, dropout_p: float,
    seed: int, seed_tensor: Tensor | None, softmax_scale: float, deterministic: bool, one_kernel_backward: bool,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """q: [b, h, sq, d], k, v: [b, kvh, sk, d] (unit stride in d), bias: fp32 [b, sk] or None.
    The Philox seed is ``seed_tensor`` (0-dim int64) when given, else ``seed``. ``deterministic``
    and ``one_kernel_backward`` only matter to the backward (setup_context keeps them).
    Returns (out [b, h, sq, d] in q's dtype and memory order (see :func:`empty_in_layout_of`),
    lse [b, h, sq] fp32)."""
    del deterministic, one_kernel_backward
    s = join_seed(seed, seed_tensor)
    out = empty_in_layout_of(q)
    if backend == "triton":
        tri = _triton()
        return tri.attention_fwd(q, k, v, key_padding_bias, causal, dropout_p, s, softmax_scale, out=out)
    return reference.attention_forward(q, k, v, key_padding_bias, causal, dropout_p, s, softmax_scale, out)


@_attention_fwd.register_fake
def _(q, k, v, key_padding_bias, causal, dropout_p, seed, seed_tensor, softmax_scale, deterministic, one_kernel_backward,
      backend):
    return empty_in_layout_of(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@fused_op("tachyon::attention_bwd", mutates_args=(), triton_op=True)
def _attention_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, key_padding_bias: Tensor | None,
    causal: bool, dropout_p: float, seed: int, seed_tensor: Tensor | None, softmax_scale: float,
    deterministic: bool, one_kernel_backward: bool, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (dq, dk, dv), contiguous, in the dtypes and shapes of q, k, v."""
    s = join_seed(seed, seed_tensor)
    if backend == "triton":
        tri = _triton()
        dq, dk, dv, _ = tri.attention_bwd(dout, q, k, v, out, lse, key_padding_bias, causal, dropout_p, s,
                                          softmax_scale, None, None, deterministic,
                                          **({"one_kernel": True} if one_kernel_backward else {}))
        return dq, dk, dv
    return reference.attention_backward(dout, q, k, v, out, lse, key_padding_bias, causal, dropout_p, s,
                                        softmax_scale)


@_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, key_padding_bias, causal, dropout_p, seed, seed_tensor, softmax_scale,
      deterministic, one_kernel_backward, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, bias, causal, dropout_p, seed, seed_tensor, softmax_scale, deterministic, one_kernel, backend = inputs
    out, lse = output
    ctx.set_materialize_grads(False)  # lse gets no gradient: None, not a zero fill
    ctx.causal, ctx.dropout_p, ctx.seed, ctx.softmax_scale = causal, dropout_p, seed, softmax_scale
    ctx.deterministic, ctx.one_kernel, ctx.backend = deterministic, one_kernel, backend
    ctx.save_for_backward(q, k, v, out, lse, bias, seed_tensor)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, bias, seed_tensor = ctx.saved_tensors
    dq, dk, dv = _attention_bwd(  # the kernels take dO's strides (as the output's, usually): no copy
        _unit_last_stride(dout), q, k, v, out, lse, bias, ctx.causal, ctx.dropout_p, ctx.seed, seed_tensor,
        ctx.softmax_scale, ctx.deterministic, ctx.one_kernel, ctx.backend,
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check_inputs(q, k, v, key_padding_bias, dropout_p, seed, softmax_scale, deterministic) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            what = f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            shape = "[batch, heads, seq_q, head_dim]" if name == "q" else "[batch, kv_heads, seq_k, head_dim]"
            raise ValueError(f"{OP}: {name} must be a 4-d tensor {shape}; got {what}")
        check_dtype(OP, name, t)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{OP}: {name} has dtype {t.dtype} but q has {q.dtype}; q, k and v must share one dtype")
    batch, heads, seq_q, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(
            f"{OP}: k has shape {tuple(k.shape)}; expected [batch={batch}, kv_heads, seq_k, head_dim={head_dim}] "
            f"to match q {tuple(q.shape)}"
        )
    if v.shape != k.shape:
        raise ValueError(f"{OP}: v has shape {tuple(v.shape)}; expected k's shape {tuple(k.shape)}")
    kv_heads, seq_k = k.shape[1], k.shape[2]
    if min(heads, seq_q, head_dim, kv_heads, seq_k) < 1:
        raise ValueError(f"{OP}: empty dims are not supported; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if heads % kv_heads != 0:
        raise ValueError(f"{OP}: q has {heads} heads and k/v {kv_heads}; heads must be a multiple of kv_heads (GQA)")
    if key_padding_bias is not None:
        if not isinstance(key_padding_bias, Tensor) or tuple(key_padding_bias.shape) != (batch, seq_k):
            got = tuple(key_padding_bias.shape) if isinstance(key_padding_bias, Tensor) else type(key_padding_bias).__name__
            raise ValueError(
                f"{OP}: key_padding_bias has shape {got}; expected [batch, seq_k] = {(batch, seq_k)} "
                "(use padding_bias_from_mask for HF [batch, 1, 1, seq] or bool masks)"
            )
        check_dtype(OP, "key_padding_bias", key_padding_bias)
    check_same_device(OP, q=q, k=k, v=v, key_padding_bias=key_padding_bias)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{OP}: dropout_p must be a float in [0, 1); got {dropout_p!r}")
    if dropout_p > 0.0:
        check_seed(OP, seed, q.device, f" (dropout_p={dropout_p} needs one)")
    if not isinstance(deterministic, bool):
        raise ValueError(f"{OP}: deterministic must be True or False; got {deterministic!r}")
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                                      or not math.isfinite(softmax_scale)):
        raise ValueError(f"{OP}: softmax_scale must be a finite float or None (1/sqrt(head_dim)); got {softmax_scale!r}")


def _check_flag(op: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{op}: {name} must be True or False; got {value!r}")
    return value


def _unit_last_stride(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def empty_in_layout_of(t: Tensor) -> Tensor:
    """A new dense tensor of t's shape and dtype whose dims lie in memory in the order of t's
    strides (outermost first; ties keep the dim order). For q = a [b, h, s, d] view of a
    [b, s, h, d] (or packed [b, s, 3, h, d]) projection, that is [b, s, h, d] memory: the caller's
    ``out.transpose(1, 2).reshape(b, s, h * d)`` is then a view, not a copy, and the gradient
    that comes back has the same strides, which the backward kernels read in place.
    (``torch.empty_like`` keeps the layout only of a dense tensor; a slice of a packed QKV is not.)"""
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))  # stable: ties keep the dim order
    return torch.empty_permuted(t.shape, order, dtype=t.dtype, device=t.device)


def attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, key_padding_bias: Tensor | None = None,
    dropout_p: float = 0.0, seed: int | Tensor | None = None, softmax_scale: float | None = None,
    deterministic: bool = True, one_kernel_backward: bool = False, backend: str | None = None,
) -> Tensor:
    """Scaled dot-product attention without materializing the [seq_q, seq_k] probabilities.

    q: [batch, heads, seq_q, head_dim]; k, v: [batch, kv_heads, seq_k, head_dim] with heads a
    multiple of kv_heads (query head h uses kv head h // (heads // kv_heads): GQA, MQA). Any
    strides. head_dim: any size from 1 (the Triton kernel: up to 256). Dtypes float32, float16,
    bfloat16, the same for q, k and v.

    - ``causal``: query i attends keys j <= i + (seq_k - seq_q) (bottom-right aligned, as in
      flash-attn; the usual lower triangle when seq_q == seq_k).
    - ``key_padding_bias``: [batch, seq_k] float, added to every query's scores for that key
      (0 = keep; -inf or any value <= -32752, e.g. HF's finfo.min, = masked; see
      :func:`padding_bias_from_mask`). It gets no gradient.
    - ``dropout_p`` on the attention probabilities, with ``seed`` (required when > 0): an int in
      [0, 2**63) or a 0-dim int64 tensor on q's device holding one (not read on the host: no
      sync, and under torch.compile a graph input, so a new seed per step does not recompile).
      keep[b, h, i, :] is row (b * heads + h) * seq_q + i of tachyon.kernels.random's dropout mask
      over seq_k keys (16-bit draws, dropped with probability round(dropout_p * 65536) / 65536),
      kept probabilities scaled by 1 / (1 - dropout_p); same seed value, same mask, whether int
      or tensor, on every backend. A tensor seed is saved for backward.
    - ``softmax_scale``: default 1 / sqrt(head_dim).
    - ``deterministic``: True (default) gives a bit-reproducible backward. False selects, on the
      Triton backend, the FlashAttention-2-style backward whose dK/dV kernel also accumulates dQ
      with fp32 atomics (probabilities recomputed once instead of twice; on a GPU dQ's summation
      order, hence its last bits, can vary run to run; out, dK and dV do not). The torch backend
      ignores it (its backward is always deterministic).
    - ``one_kernel_backward``: with ``deterministic`` on the Triton backend, the backward is one
      launch instead of two (program i computes dK/dV of key block i and dQ of query block i,
      recomputing delta = rowsum(dO * O) where it needs it instead of storing it): the same
      values bit for bit, one launch and delta's round trip fewer, O re-read per block pair by
      the dK/dV loop (a trade for small and medium sequences, where a launch costs more than
      those re-reads). Ignored otherwise.

    Rows whose keys are all masked (all -inf) return 0 with zero gradients, not NaN (HF's finfo.min
    masks give a uniform average there instead; rows with one real key agree).

    Returns out [batch, heads, seq_q, head_dim] in q's dtype, laid out in memory in q's order: for
    q a [b, h, s, d] view of a [b, s, h, d] projection (the usual split of a QKV GEMM's output),
    out is [b, s, h, d] memory, so ``out.transpose(1, 2).reshape(b, s, h * d)`` copies nothing; a
    contiguous q gives a contiguous out. Its gradient may come back with any strides (the kernels
    read it in place). :func:`attention_qkvpacked` also saves the copy of dq, dk, dv into the
    packed gradient. Saved for backward:
    q, k, v, out, the fp32 logsumexp [batch, heads, seq_q], the fp32 bias and a tensor seed; the probabilities
    are recomputed and the dropout mask regenerated in backward. Backend: "triton" (CUDA, or the
    CPU interpreter), "torch" (the memory-efficient PyTorch path), or None for tachyon's choice:
    on CUDA without dropout and padding, torch's scaled_dot_product_attention where a committed
    measurement found it faster than the Triton kernel (``tachyon.kernels.dispatch``; it saves
    what SDPA saves), else the Triton kernel.
    """
    _check_inputs(q, k, v, key_padding_bias, dropout_p, seed, softmax_scale, deterministic)
    chosen = resolve(q, backend)
    head_dim = q.shape[-1]
    seq_q, seq_k = q.shape[2], k.shape[2]
    # the torch twin (SDPA) where measured faster: only without dropout (tachyon's seeded mask) and
    # padding, and without causal rows that see no key (tachyon returns zeros there, SDPA need not)
    if chosen == "triton" and float(dropout_p) == 0.0 and key_padding_bias is None and not (causal and seq_q > seq_k) \
            and auto_on_cuda(q, backend) and dispatch.choose_by(
                "attention", q, dispatch.attention_class, (causal, seq_q, seq_k, head_dim),
                dispatch.needs_backward(q, k, v)) == dispatch.TWIN:
        return reference.sdpa_attention(q, k, v, causal=causal, softmax_scale=softmax_scale)
    if chosen == "triton" and head_dim > MAX_TRITON_HEAD_DIM:
        raise ValueError(
            f"{OP}: the Triton kernel supports head_dim up to {MAX_TRITON_HEAD_DIM}; got {head_dim} (use backend='torch')"
        )
    bias = reference.masked_bias(key_padding_bias)
    dropout_p = float(dropout_p)
    scale = reference.default_scale(head_dim, softmax_scale)
    seed_int, seed_tensor = split_seed(seed) if dropout_p > 0.0 else (0, None)
    out, _ = _attention_fwd(
        _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v), bias, bool(causal), dropout_p,
        seed_int, seed_tensor, scale, deterministic, _check_flag(OP, "one_kernel_backward", one_kernel_backward), chosen,
    )
    return out


__all__ = ["attention", "empty_in_layout_of"]

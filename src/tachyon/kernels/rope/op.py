"""Rotary position embedding on Q and K: validation, backend choice, torch.library op, autograd.

    cos, sin = rope_frequencies(seq_len, head_dim)                  # fp32 [seq, head_dim]
    q, k = apply_rotary(q, k, cos, sin)                             # q, k: [batch, seq, heads, head_dim]

One kernel launch rotates both q and k. Saved for backward: nothing but cos and sin (the backward
is the inverse rotation of the output gradients). cos and sin get no gradient. Both backends run
through the same custom op, so torch.compile traces either through the fake implementation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tachyon.backend import resolve
from tachyon.kernels.common import check_dtype, check_same_device
from tachyon.kernels.registry import fused_op
from tachyon.kernels.rope import reference
from tachyon.kernels.rope.reference import rope_frequencies


@fused_op("tachyon::rotary", mutates_args=(), triton_op=True)
def _rotary(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, inverse: bool, backend: str,
) -> tuple[Tensor, Tensor]:
    """q: [b, s, h, d], k: [b, s, hk, d] (unit last stride), cos/sin: fp32 [s, r]. ``inverse``: the backward."""
    if backend == "triton":
        from tachyon.kernels.rope import triton as tri

        return tri.rotary(q, k, cos, sin, interleaved, inverse)
    return (reference.rotary_forward(q, cos, sin, interleaved, inverse),
            reference.rotary_forward(k, cos, sin, interleaved, inverse))


@_rotary.register_fake
def _(q, k, cos, sin, interleaved, inverse, backend):
    return torch.empty_like(q), torch.empty_like(k)


def _setup(ctx, inputs, output) -> None:
    q, k, cos, sin, interleaved, inverse, backend = inputs
    ctx.interleaved, ctx.inverse, ctx.backend = interleaved, inverse, backend
    ctx.q_shape, ctx.q_dtype, ctx.k_shape, ctx.k_dtype = q.shape, q.dtype, k.shape, k.dtype
    ctx.save_for_backward(cos, sin)


def _unit_last_stride(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _backward(ctx, dq_out, dk_out):
    cos, sin = ctx.saved_tensors
    if dq_out is None:  # an output that took no part in the loss
        dq_out = dk_out.new_zeros(ctx.q_shape, dtype=ctx.q_dtype)
    if dk_out is None:
        dk_out = dq_out.new_zeros(ctx.k_shape, dtype=ctx.k_dtype)
    dq, dk = _rotary(_unit_last_stride(dq_out), _unit_last_stride(dk_out), cos, sin,
                     ctx.interleaved, not ctx.inverse, ctx.backend)
    return dq, dk, None, None, None, None, None


_rotary.register_autograd(_backward, setup_context=_setup)


def apply_rotary(
    q: Tensor, k: Tensor, freqs_cos: Tensor, freqs_sin: Tensor, *, interleaved: bool = False,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Rotary position embedding of q and k in one kernel launch: (q_out, k_out) in q's / k's dtype.

    q: [batch, seq, heads, head_dim], k: [batch, seq, kv_heads, head_dim] (any strides with a
    contiguous head_dim, e.g. an sbhd tensor transposed to bshd; outputs keep the layout).
    freqs_cos, freqs_sin: fp32 [seq, rotary_dim], rotary_dim even and <= head_dim; dims past
    rotary_dim pass through. Non-interleaved (default) is HF Llama's rotate_half convention with
    tables laid out as cat([f, f]) (what :func:`rope_frequencies` returns); ``interleaved`` is
    GPT-J's pairs (2i, 2i+1) with tables laid out as [f0, f0, f1, f1, ...]
    (``rope_frequencies(..., interleaved=True)``). Computed in fp32. Saves only cos and sin.
    """
    op = "apply_rotary"
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{op}: {name} must be a 4-d tensor [batch, seq, heads, head_dim]; got {shape}")
        check_dtype(op, name, t)
    bsz, seq, _, head_dim = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (bsz, seq, head_dim):
        raise ValueError(
            f"{op}: k has shape {tuple(k.shape)}; expected ({bsz}, {seq}, kv_heads, {head_dim}) to match q's "
            f"batch, seq and head_dim (q has shape {tuple(q.shape)})"
        )
    for name, t in (("freqs_cos", freqs_cos), ("freqs_sin", freqs_sin)):
        if not isinstance(t, Tensor) or t.dim() != 2 or t.shape[0] != seq:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{op}: {name} has shape {shape}; expected ({seq}, rotary_dim) for seq={seq}")
        check_dtype(op, name, t, (torch.float32,))
    rotary_dim = freqs_cos.shape[1]
    if freqs_sin.shape != freqs_cos.shape:
        raise ValueError(f"{op}: freqs_sin has shape {tuple(freqs_sin.shape)} but freqs_cos has {tuple(freqs_cos.shape)}")
    if rotary_dim == 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"{op}: rotary_dim (freqs' last dim) must be even and in [2, head_dim={head_dim}]; got {rotary_dim}")
    if not isinstance(interleaved, bool):
        raise ValueError(f"{op}: interleaved must be True or False; got {interleaved!r}")
    check_same_device(op, q=q, k=k, freqs_cos=freqs_cos, freqs_sin=freqs_sin)
    chosen = resolve(q, backend)
    return _rotary(_unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(freqs_cos),
                   _unit_last_stride(freqs_sin), interleaved, False, chosen)


__all__ = ["apply_rotary", "rope_frequencies"]

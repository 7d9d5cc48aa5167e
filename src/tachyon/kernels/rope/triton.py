"""Triton kernel for rotary position embedding on Q and K in one launch (no autograd; see op.py).

One program per (batch, position) token: it loads that position's cos/sin row once, then rotates
every head of q and then every head of k, BLOCK_H heads at a time, as a [BLOCK_H, BLOCK_D] tile.
Each output element is

    out[d] = x[d] * cos[d] + coef[d] * x[partner(d)]

    non-interleaved: partner(d) = d +- rotary_dim/2, interleaved: partner(d) = d xor 1
    forward:  coef[d] = sign(d) * sin[d]                     (sign = -1 for the first of a pair)
    inverse:  coef[d] = -sign(d) * sin[partner(d)]           (the backward: rot^T = -rot)

and for d >= rotary_dim, cos = 1 and coef = 0 (pass-through). q and k may have any strides over
batch, seq and heads (e.g. an sbhd tensor transposed to bshd) as long as head_dim is contiguous;
the outputs are written with the strides of the tensors allocated by the launcher's caller.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tachyon.kernels.ints import next_power_of_2
from tachyon.kernels.launch import fast_launch


@triton.jit
def _rotate_heads(
    X, O, x_base, o_base, stride_xh, stride_oh, H, D, cols, partner, in_rot, c, coef, BLOCK_H: tl.constexpr,
):
    for h0 in range(0, H, BLOCK_H):
        heads = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        h_ok = heads[:, None] < H
        mask = h_ok & (cols[None, :] < D)
        x_rows = X + x_base + heads[:, None] * stride_xh
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(x_rows + partner[None, :], mask=h_ok & in_rot[None, :], other=0.0).to(tl.float32)
        out = x * c[None, :] + coef[None, :] * xp
        tl.store(O + o_base + heads[:, None] * stride_oh + cols[None, :], out.to(O.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN, S, HQ, HK, D, R,
    sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sqo_b, sqo_s, sqo_h, sko_b, sko_s, sko_h, sc_s, ss_s,
    INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // S
    s = pid % S
    cols = tl.arange(0, BLOCK_D)
    in_rot = cols < R
    if INTERLEAVED:
        partner = cols ^ 1
        sign = tl.where(cols % 2 == 0, -1.0, 1.0)
    else:
        half = R // 2
        partner = tl.where(cols < half, cols + half, cols - half)
        sign = tl.where(cols < half, -1.0, 1.0)
    partner = tl.where(in_rot, partner, cols)
    c = tl.load(COS + s * sc_s + cols, mask=in_rot, other=1.0)
    if INVERSE:
        coef = -sign * tl.load(SIN + s * ss_s + partner, mask=in_rot, other=0.0)
    else:
        coef = sign * tl.load(SIN + s * ss_s + cols, mask=in_rot, other=0.0)
    _rotate_heads(Q, QO, b * sq_b + s * sq_s, b * sqo_b + s * sqo_s, sq_h, sqo_h, HQ, D,
                  cols, partner, in_rot, c, coef, BLOCK_H)
    _rotate_heads(K, KO, b * sk_b + s * sk_s, b * sko_b + s * sko_s, sk_h, sko_h, HK, D,
                  cols, partner, in_rot, c, coef, BLOCK_H)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, inverse: bool,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [b, s, h, d], k: [b, s, hk, d] (unit stride in d), cos/sin: fp32 [s, r] (unit stride in r).

    Returns (q_out, k_out) with q's and k's shapes, dtypes and dense strides, or ``out``: two
    tensors of those shapes and dtypes (unit stride in d) to write into, which may be q and k
    themselves (each program reads a token's elements before it writes them: in place is safe).
    """
    bsz, seq, hq, d = q.shape
    hk = k.shape[2]
    r = cos.shape[1]
    q_out, k_out = out if out is not None else (torch.empty_like(q), torch.empty_like(k))
    if bsz * seq == 0:
        return q_out, k_out
    block_d = next_power_of_2(d)
    block_h = max(1, min(next_power_of_2(max(hq, hk)), 4096 // block_d))
    num_warps = 4 if block_h * block_d <= 2048 else 8
    _rope_kernel[(bsz * seq,)](
        q, k, q_out, k_out, cos, sin, seq, hq, hk, d, r,
        *q.stride()[:3], *k.stride()[:3], *q_out.stride()[:3], *k_out.stride()[:3], cos.stride(0), sin.stride(0),
        INTERLEAVED=interleaved, INVERSE=inverse, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=num_warps,
    )
    return q_out, k_out

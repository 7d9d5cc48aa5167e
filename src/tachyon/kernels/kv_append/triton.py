"""Triton kernel: fused QKV split + RoPE at per-token positions + KV-cache append (no autograd).

One program per (sequence, new token): it loads the token's position and that row of the cos /
sin tables once, then for BLOCK_H heads at a time rotates the q heads into q_out, rotates the k
heads and writes them to the cache slot cache_lengths[b] + t, and copies the v heads there. Each
rotated element is out[d] = x[d] * cos[d] + sign(d) * sin[d] * x[partner(d)] (partner: d +- r/2
rotate-half, d xor 1 interleaved; sign -1 on the first of a pair), dims >= rotary_dim pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tachyon.kernels.ints import next_power_of_2
from tachyon.kernels.launch import fast_launch


@triton.jit
def _heads(SRC, DST, src_base, dst_base, src_head_stride, dst_head_stride, H, D, cols, partner, c, coef,
           ROTATE: tl.constexpr, BLOCK_H: tl.constexpr):
    for h0 in range(0, H, BLOCK_H):
        heads = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        mask = (heads[:, None] < H) & (cols[None, :] < D)
        src = SRC + src_base + heads[:, None] * src_head_stride
        x = tl.load(src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if ROTATE:
            xp = tl.load(src + partner[None, :], mask=mask, other=0.0).to(tl.float32)
            x = x * c[None, :] + coef[None, :] * xp
        tl.store(DST + dst_base + heads[:, None] * dst_head_stride + cols[None, :], x.to(DST.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _kv_append_kernel(
    QKV, POS, COS, SIN, KC, VC, LENS, QO, S, HQ, HK, D, R,
    stride_qkv_b, stride_qkv_s, stride_pos_b, stride_cos, stride_kc_b, stride_kc_h, stride_kc_s,
    stride_vc_b, stride_vc_h, stride_vc_s, stride_qo_b, stride_qo_h, stride_qo_s,
    ROTATE: tl.constexpr, INTERLEAVED: tl.constexpr, WRITE_Q: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // S
    t = pid % S
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
    c = tl.full([BLOCK_D], 1.0, dtype=tl.float32)
    coef = tl.zeros([BLOCK_D], dtype=tl.float32)
    if ROTATE:
        p = tl.load(POS + b * stride_pos_b + t).to(tl.int64)
        c = tl.load(COS + p * stride_cos + cols, mask=in_rot, other=1.0)
        coef = sign * tl.load(SIN + p * stride_cos + cols, mask=in_rot, other=0.0)
    slot = tl.load(LENS + b).to(tl.int64) + t
    src = b * stride_qkv_b + t * stride_qkv_s
    if WRITE_Q:
        _heads(QKV, QO, src, b * stride_qo_b + t * stride_qo_s, D, stride_qo_h, HQ, D, cols, partner, c, coef,
               ROTATE, BLOCK_H)
    _heads(QKV, KC, src + HQ * D, b * stride_kc_b + slot * stride_kc_s, D, stride_kc_h, HK, D, cols, partner, c,
           coef, ROTATE, BLOCK_H)
    _heads(QKV, VC, src + (HQ + HK) * D, b * stride_vc_b + slot * stride_vc_s, D, stride_vc_h, HK, D, cols,
           partner, c, coef, False, BLOCK_H)


def rotary_kv_append(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
    k_cache: torch.Tensor, v_cache: torch.Tensor, cache_lengths: torch.Tensor, heads: int, kv_heads: int,
    interleaved: bool, write_q: bool = True,
) -> torch.Tensor:
    """qkv [b, s, (h + 2 hk) d] (unit stride in the last dim), positions [b, s] int, cos/sin fp32
    [P, r] (unit stride) or None, caches [b, hk, S, d] (unit stride in d). Returns q_out [b, h, s, d]
    (without ``write_q``: q is not read or written, and q_out is [b, 0, s, d])."""
    batch, seq, _ = qkv.shape
    d = k_cache.shape[-1]
    q_out = torch.empty((batch, heads if write_q else 0, seq, d), dtype=qkv.dtype, device=qkv.device)
    if batch * seq == 0:
        return q_out
    rotate = cos is not None
    block_d = next_power_of_2(d)
    block_h = max(1, min(next_power_of_2(max(heads, kv_heads)), 4096 // block_d))
    _kv_append_kernel[(batch * seq,)](
        qkv, positions, cos if rotate else qkv, sin if rotate else qkv, k_cache, v_cache, cache_lengths, q_out,
        seq, heads, kv_heads, d, cos.shape[1] if rotate else 0,
        qkv.stride(0), qkv.stride(1), positions.stride(0), cos.stride(0) if rotate else 0,
        *k_cache.stride()[:3], *v_cache.stride()[:3], *q_out.stride()[:3],
        ROTATE=rotate, INTERLEAVED=interleaved, WRITE_Q=write_q, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )
    return q_out

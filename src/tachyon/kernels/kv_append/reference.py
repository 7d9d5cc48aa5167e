"""PyTorch reference for the fused QKV split + RoPE + KV-cache append: the CPU path and the oracle.

Input: the fused QKV projection of s new tokens per sequence, qkv [batch, s, (heads + 2 kv_heads)
* head_dim] laid out [q heads | k heads | v heads], and each token's position [batch, s] (HF's
position_ids: with left padding the positions of one row are shifted, so they differ per row and
the plain RoPE op, whose tables are per sequence index, cannot be used). Then

    q_out[b, h, t]                        = rope(q[b, t, h], positions[b, t])
    k_cache[b, g, cache_lengths[b] + t]   = rope(k[b, t, g], positions[b, t])
    v_cache[b, g, cache_lengths[b] + t]   = v[b, t, g]

rope(x, p) = x * cos[p] + rot(x) * sin[p] on the first rotary_dim dims (tachyon.kernels.rope's
rotate-half or interleaved conventions, tables from its rope_frequencies or a model's own), in
fp32, rounded to the cache dtype; with no tables (GPT-2, GPT-Neo) q, k pass unrotated.
cache_lengths are the slots already filled before this call; the caller advances them after.
"""

from __future__ import annotations

import torch

from tachyon.kernels.rope.reference import rotate


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [b, s, heads, d], cos/sin [b, s, r] fp32 -> x rotated on its first r dims, x's dtype."""
    r = cos.shape[-1]
    xr = x[..., :r].float()
    out = xr * cos[:, :, None] + rotate(xr, interleaved) * sin[:, :, None]
    return torch.cat((out.to(x.dtype), x[..., r:]), dim=-1) if r < x.shape[-1] else out.to(x.dtype)


def rotary_kv_append_reference(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
    k_cache: torch.Tensor, v_cache: torch.Tensor, cache_lengths: torch.Tensor, *, heads: int, kv_heads: int,
    interleaved: bool = False, write_q: bool = True, backend: str | None = None,
) -> torch.Tensor:
    """Returns q_out [batch, heads, s, head_dim] (contiguous, qkv's dtype; [batch, 0, s, head_dim]
    without ``write_q``); writes k_cache/v_cache in place (see the module docstring). ``backend``
    is ignored."""
    del backend
    batch, seq, _ = qkv.shape
    head_dim = k_cache.shape[-1]
    parts = qkv.view(batch, seq, heads + 2 * kv_heads, head_dim)
    q, k, v = parts[:, :, :heads], parts[:, :, heads:heads + kv_heads], parts[:, :, heads + kv_heads:]
    if cos is not None:
        c, s = cos[positions], sin[positions]
        q, k = _rope(q, c, s, interleaved), _rope(k, c, s, interleaved)
    slots = cache_lengths.to(torch.int64)[:, None] + torch.arange(seq, device=qkv.device)[None, :]
    rows = torch.arange(batch, device=qkv.device)[:, None].expand(batch, seq)
    # advanced indices around a slice: the indexed view is [batch, seq, kv_heads, head_dim]
    k_cache[rows, :, slots] = k.to(k_cache.dtype)
    v_cache[rows, :, slots] = v.to(v_cache.dtype)
    return q.transpose(1, 2).contiguous() if write_q else q.new_empty((batch, 0, seq, head_dim))

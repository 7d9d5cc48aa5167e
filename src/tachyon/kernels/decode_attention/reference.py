"""PyTorch reference for attention over a KV cache: the CPU path and the oracle for Triton.

A KV cache holds, for each sequence b, ``cache_lengths[b]`` valid slots (keys/values written in
slot order) of a preallocated capacity S. The ``seq_q`` newest of them belong to the queries:

    q        [batch, heads, seq_q, head_dim]       query i of sequence b sits at slot
                                                    p(b, i) = cache_lengths[b] - seq_q + i
    k_cache  [batch, kv_heads, S, head_dim]         query head h reads kv head h // (heads / kv_heads)
    v_cache  [batch, kv_heads, S, head_dim]

    s[b, h, i, j] = scale * <q_i, k_j> + bias[b, j]       for visible keys, else -inf
    visible(b, i, j) = j <= p(b, i)                        (causal; implies j < cache_lengths[b])
                       and j > p(b, i) - window            (sliding window, when window is given)
    out = softmax_j(s) @ v                                 (fp32 softmax; rows with no key: 0)

``key_padding_bias`` [batch, S] is the cache's per-slot bias: 0 for real tokens, -inf (or any
value <= -32752, HF's finfo.min) for padding slots, e.g. the left padding of a batch of prompts.
Decode is seq_q = 1; prefill of a whole prompt is seq_q = cache_lengths (with a window it is the
path for prompts longer than the window, which the flash-attention kernel cannot mask).
"""

from __future__ import annotations

import torch

from tachyon.kernels.attention.reference import default_scale, masked_bias


def visible_keys(cache_lengths: torch.Tensor, seq_q: int, capacity: int, window: int | None) -> torch.Tensor:
    """Bool [batch, seq_q, capacity]: True where query i of sequence b may attend slot j."""
    pos = cache_lengths.to(torch.int64)[:, None] - seq_q + torch.arange(seq_q, device=cache_lengths.device)[None, :]
    j = torch.arange(capacity, device=cache_lengths.device)[None, None, :]
    visible = j <= pos[:, :, None]
    if window is not None:
        visible &= j > pos[:, :, None] - window
    return visible


def decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_lengths: torch.Tensor, *,
    key_padding_bias: torch.Tensor | None = None, window: int | None = None, softmax_scale: float | None = None,
    num_splits: int | None = None, backend: str | None = None,
) -> torch.Tensor:
    """out [batch, heads, seq_q, head_dim] in q's dtype (see the module docstring), in fp32 math
    (fp64 for fp64 inputs). Same signature as the op; ``num_splits`` and ``backend`` are ignored.

    Keys are grouped per kv head ([b, kv_heads, group * seq_q, S] scores), so a GQA cache is never
    repeated. On CPU only the first max(cache_lengths) slots are read (a host read of the lengths).
    """
    del num_splits, backend
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    used = capacity
    if cache_lengths.device.type == "cpu":
        used = max(1, min(capacity, int(cache_lengths.max())))
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = default_scale(head_dim, softmax_scale)
    qg = q.to(acc).reshape(batch, kv_heads, group * seq_q, head_dim)
    k = k_cache[:, :, :used].to(acc)
    v = v_cache[:, :, :used].to(acc)
    s = (qg @ k.transpose(-1, -2)).view(batch, kv_heads, group, seq_q, used) * scale
    if key_padding_bias is not None:
        s = s + masked_bias(key_padding_bias[:, :used]).to(acc)[:, None, None, None, :]
    visible = visible_keys(cache_lengths, seq_q, used, window)[:, None, None]
    s = s.masked_fill(~visible, float("-inf"))
    dead = torch.isneginf(s).all(dim=-1, keepdim=True)
    p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    out = p.view(batch, kv_heads, group * seq_q, used) @ v
    return out.view(batch, heads, seq_q, head_dim).to(q.dtype)

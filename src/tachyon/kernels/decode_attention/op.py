"""The KV-cache attention op: validation, backend choice, torch.library registration.

    out = decode_attention(q, k_cache, v_cache, cache_lengths)                   # decode, seq_q = 1
    out = decode_attention(q, k_cache, v_cache, lengths, key_padding_bias=bias, window=4096)

An inference op: it has no backward (calling it on tensors that require grad raises). Both
backends run through one custom op (``tachyon::decode_attention``) with a fake implementation, so
torch.compile traces either; the cache lengths are a device tensor, never read on the host by the
Triton path (a decode step is capturable in a CUDA graph).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tachyon.backend import resolve
from tachyon.kernels.attention.reference import default_scale, masked_bias
from tachyon.kernels.common import check_dtype, check_same_device
from tachyon.kernels.decode_attention import reference
from tachyon.kernels.registry import fused_op

OP = "decode_attention"
MAX_TRITON_HEAD_DIM = 256


@fused_op("tachyon::decode_attention", mutates_args=())
def _decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_lengths: Tensor, bias: Tensor | None, window: int,
    softmax_scale: float, num_splits: int, backend: str,
) -> Tensor:
    """window 0 = none, num_splits 0 = automatic; bias fp32 [b, S] with -inf at masked slots."""
    win = window if window > 0 else None
    if backend == "triton":
        from tachyon.kernels.decode_attention import triton as tri

        return tri.decode_attention(q, k_cache, v_cache, cache_lengths, bias, win, softmax_scale, num_splits or None)
    return reference.decode_attention_reference(q, k_cache, v_cache, cache_lengths, key_padding_bias=bias,
                                                window=win, softmax_scale=softmax_scale)


@_decode_attention.register_fake
def _(q, k_cache, v_cache, cache_lengths, bias, window, softmax_scale, num_splits, backend):
    return q.new_empty(q.shape)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{OP}: {name} must be an int >= {minimum} or None; got {value!r}")


def _check(q, k_cache, v_cache, cache_lengths, key_padding_bias, window, softmax_scale, num_splits) -> None:
    for name, t, shape in (("q", q, "[batch, heads, seq_q, head_dim]"), ("k_cache", k_cache, "[batch, kv_heads, capacity, head_dim]"),
                           ("v_cache", v_cache, "[batch, kv_heads, capacity, head_dim]")):
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{OP}: {name} must be a 4-d tensor {shape}; got {got}")
        check_dtype(OP, name, t)
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"{OP}: q, k_cache and v_cache must share one dtype; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    batch, heads, seq_q, head_dim = q.shape
    if k_cache.shape[0] != batch or k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"{OP}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         f"[batch={batch}, kv_heads, capacity, head_dim={head_dim}] to match q {tuple(q.shape)}")
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    if min(batch, heads, seq_q, head_dim, kv_heads, capacity) < 1:
        raise ValueError(f"{OP}: empty dims are not supported; got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    if heads % kv_heads:
        raise ValueError(f"{OP}: q has {heads} heads and the cache {kv_heads}; heads must be a multiple of kv_heads (GQA)")
    if seq_q > capacity:
        raise ValueError(f"{OP}: seq_q={seq_q} queries do not fit a cache of capacity {capacity}")
    if (not isinstance(cache_lengths, Tensor) or tuple(cache_lengths.shape) != (batch,)
            or cache_lengths.dtype not in (torch.int32, torch.int64)):
        got = f"{tuple(cache_lengths.shape)} {cache_lengths.dtype}" if isinstance(cache_lengths, Tensor) else type(cache_lengths).__name__
        raise ValueError(f"{OP}: cache_lengths must be an int32/int64 tensor [batch={batch}] (valid slots per "
                         f"sequence, the new queries' included); got {got}")
    if key_padding_bias is not None:
        if not isinstance(key_padding_bias, Tensor) or tuple(key_padding_bias.shape) != (batch, capacity):
            got = tuple(key_padding_bias.shape) if isinstance(key_padding_bias, Tensor) else type(key_padding_bias).__name__
            raise ValueError(f"{OP}: key_padding_bias must be [batch, capacity] = {(batch, capacity)}; got {got}")
        check_dtype(OP, "key_padding_bias", key_padding_bias)
    check_same_device(OP, q=q, k_cache=k_cache, v_cache=v_cache, cache_lengths=cache_lengths,
                      key_padding_bias=key_padding_bias)
    if window is not None:
        _check_int("window", window, 1)
    if num_splits is not None:
        _check_int("num_splits", num_splits, 1)
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                                      or not math.isfinite(softmax_scale)):
        raise ValueError(f"{OP}: softmax_scale must be a finite float or None (1/sqrt(head_dim)); got {softmax_scale!r}")
    if any(t.requires_grad for t in (q, k_cache, v_cache) if torch.is_grad_enabled()):
        raise ValueError(f"{OP}: an inference op with no backward; call it under torch.no_grad() / inference_mode()")


def decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_lengths: Tensor, *, key_padding_bias: Tensor | None = None,
    window: int | None = None, softmax_scale: float | None = None, num_splits: int | None = None,
    backend: str | None = None,
) -> Tensor:
    """Attention of the newest ``seq_q`` tokens of each sequence over its KV cache.

    q: [batch, heads, seq_q, head_dim], query i of sequence b at cache slot
    ``cache_lengths[b] - seq_q + i`` (its own key and value already written there).
    k_cache, v_cache: [batch, kv_heads, capacity, head_dim] (unit stride in head_dim; GQA/MQA
    when kv_heads < heads). cache_lengths: int32/int64 [batch] on q's device, valid slots per
    sequence. key_padding_bias: [batch, capacity] float, 0 keep, -inf / <= -32752 masked (padding
    slots), or None. window: sliding window (keys j > p - window), or None. softmax_scale: default
    1/sqrt(head_dim). num_splits: split-K partitions of the cache on the Triton path (None: enough
    to fill the GPU). Dtypes float32, float16, bfloat16, one for q and the caches.

    Returns out [batch, heads, seq_q, head_dim] contiguous in q's dtype; rows with no visible key
    are 0. No gradient. Backend: "triton" (CUDA, or the CPU interpreter), "torch", None (auto).
    """
    _check(q, k_cache, v_cache, cache_lengths, key_padding_bias, window, softmax_scale, num_splits)
    chosen = resolve(q, backend)
    if chosen == "triton" and q.shape[-1] > MAX_TRITON_HEAD_DIM:
        raise ValueError(f"{OP}: the Triton kernel supports head_dim up to {MAX_TRITON_HEAD_DIM}; got {q.shape[-1]} "
                         "(use backend='torch')")
    if q.stride(-1) != 1:
        q = q.contiguous()
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{OP}: {name} must have unit stride in head_dim; got strides {t.stride()}")
    return _decode_attention(q, k_cache, v_cache, cache_lengths, masked_bias(key_padding_bias), window or 0,
                             default_scale(q.shape[-1], softmax_scale), num_splits or 0, chosen)


__all__ = ["decode_attention"]

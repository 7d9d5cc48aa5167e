"""The fused QKV split + RoPE + KV-cache append op: validation, backend choice, registration.

    q = rotary_kv_append(qkv, positions, cos, sin, k_cache, v_cache, cache_lengths, heads=32, kv_heads=8)
    cache_lengths += qkv.shape[1]                          # the caller advances the lengths

An inference op (no backward) that writes k_cache and v_cache in place: registered as the custom
op ``tachyon::rotary_kv_append`` with ``mutates_args=("k_cache", "v_cache")``, so torch.compile
knows about the writes. The slots come from the device tensor cache_lengths (no host read on
the Triton path: a decode step is capturable in a CUDA graph).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tachyon.backend import resolve
from tachyon.kernels.common import check_dtype, check_same_device
from tachyon.kernels.kv_append import reference
from tachyon.kernels.registry import fused_op

OP = "rotary_kv_append"


@fused_op("tachyon::rotary_kv_append", mutates_args=("k_cache", "v_cache"))
def _rotary_kv_append(
    qkv: Tensor, positions: Tensor, cos: Tensor | None, sin: Tensor | None, k_cache: Tensor, v_cache: Tensor,
    cache_lengths: Tensor, heads: int, kv_heads: int, interleaved: bool, write_q: bool, backend: str,
) -> Tensor:
    if backend == "triton":
        from tachyon.kernels.kv_append import triton as tri

        return tri.rotary_kv_append(qkv, positions, cos, sin, k_cache, v_cache, cache_lengths, heads, kv_heads,
                                    interleaved, write_q)
    return reference.rotary_kv_append_reference(qkv, positions, cos, sin, k_cache, v_cache, cache_lengths,
                                                heads=heads, kv_heads=kv_heads, interleaved=interleaved,
                                                write_q=write_q)


@_rotary_kv_append.register_fake
def _(qkv, positions, cos, sin, k_cache, v_cache, cache_lengths, heads, kv_heads, interleaved, write_q, backend):
    return qkv.new_empty((qkv.shape[0], heads if write_q else 0, qkv.shape[1], k_cache.shape[-1]))


def _shape(t: object) -> object:
    return tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__


def rotary_kv_append(
    qkv: Tensor, positions: Tensor, cos: Tensor | None, sin: Tensor | None, k_cache: Tensor, v_cache: Tensor,
    cache_lengths: Tensor, *, heads: int, kv_heads: int, interleaved: bool = False, q_in_place: bool = False,
    backend: str | None = None,
) -> Tensor:
    """Split qkv, rotate q and k at ``positions``, append k and v to the cache; returns rotated q.

    qkv: [batch, s, (heads + 2 kv_heads) * head_dim], [q | k | v] heads, float32/float16/bfloat16.
    positions: int32/int64 [batch, s], each below cos.shape[0]. cos, sin: fp32 [max_positions,
    rotary_dim] (rotary_dim even, <= head_dim; rotate-half layout cat([f, f]) or, with
    ``interleaved``, GPT-J's [f0, f0, f1, f1, ...]), or both None for no rotary. k_cache, v_cache:
    [batch, kv_heads, capacity, head_dim] in qkv's dtype, written at slots cache_lengths[b] + t;
    cache_lengths: int32/int64 [batch] with cache_lengths + s <= capacity (not checked on the
    device; the caller owns the lengths). Returns q [batch, heads, s, head_dim] contiguous. No gradient.
    ``q_in_place`` (no rotary only): q is neither read nor copied by the kernel; the returned q is a
    view of qkv's q heads ([batch, heads, s, head_dim] with qkv's strides, unit stride in
    head_dim), which the attention ops read in place: a decode step then moves q once, not three
    times.
    """
    if not isinstance(qkv, Tensor) or qkv.dim() != 3:
        raise ValueError(f"{OP}: qkv must be a 3-d tensor [batch, seq, (heads + 2 kv_heads) * head_dim]; got {_shape(qkv)}")
    check_dtype(OP, "qkv", qkv)
    for name, value in (("heads", heads), ("kv_heads", kv_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{OP}: {name} must be an int >= 1; got {value!r}")
    batch, seq, width = qkv.shape
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, Tensor) or t.dim() != 4 or t.shape[0] != batch or t.shape[1] != kv_heads:
            raise ValueError(f"{OP}: {name} must be [batch={batch}, kv_heads={kv_heads}, capacity, head_dim]; got {_shape(t)}")
        if t.dtype != qkv.dtype:
            raise ValueError(f"{OP}: {name} has dtype {t.dtype} but qkv has {qkv.dtype}; they must match")
        if t.stride(-1) != 1:
            raise ValueError(f"{OP}: {name} must have unit stride in head_dim; got strides {t.stride()}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{OP}: v_cache {tuple(v_cache.shape)} must have k_cache's shape {tuple(k_cache.shape)}")
    head_dim, capacity = k_cache.shape[3], k_cache.shape[2]
    if width != (heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"{OP}: qkv's last dim is {width}; expected (heads + 2 kv_heads) * head_dim = "
                         f"({heads} + 2 * {kv_heads}) * {head_dim} = {(heads + 2 * kv_heads) * head_dim}")
    if seq > capacity:
        raise ValueError(f"{OP}: {seq} new tokens do not fit a cache of capacity {capacity}")
    if (not isinstance(positions, Tensor) or tuple(positions.shape) != (batch, seq)
            or positions.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"{OP}: positions must be an int32/int64 tensor [batch, seq] = {(batch, seq)}; got {_shape(positions)}")
    if (not isinstance(cache_lengths, Tensor) or tuple(cache_lengths.shape) != (batch,)
            or cache_lengths.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"{OP}: cache_lengths must be an int32/int64 tensor [batch={batch}]; got {_shape(cache_lengths)}")
    if (cos is None) != (sin is None):
        raise ValueError(f"{OP}: give both cos and sin, or neither (no rotary)")
    if cos is not None:
        for name, t in (("cos", cos), ("sin", sin)):
            if not isinstance(t, Tensor) or t.dim() != 2 or t.dtype != torch.float32:
                raise ValueError(f"{OP}: {name} must be a float32 tensor [max_positions, rotary_dim]; got {_shape(t)}")
        r = cos.shape[1]
        if sin.shape != cos.shape or r < 2 or r % 2 or r > head_dim:
            raise ValueError(f"{OP}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must match with an even "
                             f"rotary_dim in [2, head_dim={head_dim}]")
    if not isinstance(interleaved, bool):
        raise ValueError(f"{OP}: interleaved must be True or False; got {interleaved!r}")
    if not isinstance(q_in_place, bool):
        raise ValueError(f"{OP}: q_in_place must be True or False; got {q_in_place!r}")
    if q_in_place and cos is not None:
        raise ValueError(f"{OP}: q_in_place=True returns q unrotated, as a view of qkv; it is allowed only "
                         "without rotary (cos=None, sin=None)")
    check_same_device(OP, qkv=qkv, positions=positions, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache,
                      cache_lengths=cache_lengths)
    if torch.is_grad_enabled() and qkv.requires_grad:
        raise ValueError(f"{OP}: an inference op with no backward; call it under torch.no_grad() / inference_mode()")
    chosen = resolve(qkv, backend)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q = _rotary_kv_append(qkv, positions.contiguous(), None if cos is None else cos.contiguous(),
                          None if sin is None else sin.contiguous(), k_cache, v_cache, cache_lengths,
                          heads, kv_heads, interleaved, not q_in_place, chosen)
    if q_in_place:
        return qkv[..., :heads * head_dim].unflatten(-1, (heads, head_dim)).transpose(1, 2)
    return q


__all__ = ["rotary_kv_append"]

"""Split a fused QKV projection, rotate q and k (RoPE at per-token positions) and append k, v to a
preallocated KV cache, in one pass: reference, Triton kernel, op."""

from tachyon.kernels.kv_append.op import rotary_kv_append
from tachyon.kernels.kv_append.reference import rotary_kv_append_reference

__all__ = ["rotary_kv_append", "rotary_kv_append_reference"]

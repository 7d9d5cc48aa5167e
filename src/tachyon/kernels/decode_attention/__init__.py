"""Attention of new query tokens over a preallocated KV cache (decode and windowed prefill):
reference, Triton kernel (split-K, GQA-grouped), op."""

from tachyon.kernels.decode_attention.op import decode_attention
from tachyon.kernels.decode_attention.reference import decode_attention_reference, visible_keys

__all__ = ["decode_attention", "decode_attention_reference", "visible_keys"]

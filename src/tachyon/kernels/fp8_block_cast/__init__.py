"""Fused block-scaled FP8 cast (amax per block, power-of-2 or fp32 scales, both directions in one
read): reference, Triton kernel and the op. Used by the Float8BlockScaling / MXFP8 recipes."""

from tachyon.kernels.fp8_block_cast.op import block_cast_to_fp8, scale_from_amax

__all__ = ["block_cast_to_fp8", "scale_from_amax"]

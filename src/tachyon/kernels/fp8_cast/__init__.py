"""Fused FP8 cast + amax (+ transpose) for delayed scaling: reference, Triton kernels and the op."""

from tachyon.kernels.fp8_cast.op import FP8_DTYPES, FP8_MAX, cast_to_fp8

__all__ = ["FP8_DTYPES", "FP8_MAX", "cast_to_fp8"]

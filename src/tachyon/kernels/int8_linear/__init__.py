"""Weight-only INT8 linear (per-channel or group-wise scales, dequantized in registers) and the
symmetric quantizer it shares with MoQ: reference, Triton kernel, op."""

from tachyon.kernels.int8_linear.op import int8_linear, norm_int8_linear
from tachyon.kernels.int8_linear.reference import (
    dequantize, fake_quantize, int8_linear_reference, quantize_symmetric, scale_group_size,
)

__all__ = ["dequantize", "fake_quantize", "int8_linear", "int8_linear_reference", "norm_int8_linear",
           "quantize_symmetric", "scale_group_size"]

"""GEMMs whose backward is fused with the sum of a residual branch's gradient."""

from tachyon.kernels.linear.op import linear_with_residual

__all__ = ["linear_with_residual"]

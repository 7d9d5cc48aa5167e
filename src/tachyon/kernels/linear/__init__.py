"""GEMMs fused with what sits beside them: the sum of a residual branch's gradient
(linear_with_residual) and an MLP's bias + activation, in the GEMM's epilogue (mlp)."""

from tachyon.kernels.linear.mlp import mlp
from tachyon.kernels.linear.op import linear_with_residual

__all__ = ["linear_with_residual", "mlp"]

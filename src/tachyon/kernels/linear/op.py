"""A linear layer whose input is also a residual branch: one GEMM in backward instead of a GEMM
and an add.

    y, x_res = linear_with_residual(x, weight)     # y = x @ weight^T; x_res: x itself, as a view
    out = layer_norm(x_res + dropout(f(y)), ...)   # x_res feeds the residual branch

Why: when x feeds a GEMM and a residual add, autograd gets two gradients for x, the GEMM's
dy @ W and the residual's dr, and adds them: a GEMM that writes [tokens, hidden], then an add
that reads it and dr and writes the sum. Here both uses of x belong to one autograd node, which
receives dy and dr separately and computes dx = dr + dy @ W as one ``addmm`` (cuBLAS accumulates
into dr's copy: beta = 1): the sum costs reading dr, and the intermediate GEMM result is never
written and read back. (torch has no op for this: F.linear's backward cannot see the other use.)

Shapes: x [..., in_features], weight [out_features, in_features] -> y [..., out_features] in x's
dtype, x_res: x's shape (a view of x; no copy). Saved for backward: x and weight (what F.linear
saves). The GEMMs are torch's (cuBLAS on GPU, any backend).
"""

from __future__ import annotations

import torch
from torch import Tensor

OP = "linear_with_residual"


class _LinearWithResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(x, weight)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not a zero fill
        return torch.nn.functional.linear(x, weight), x.view_as(x)

    @staticmethod
    def backward(ctx, dy: Tensor | None, dres: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        n_in = x.shape[-1]
        dx = dweight = None
        if dy is None:
            return dres, None
        dy2 = dy.reshape(-1, dy.shape[-1])
        if ctx.needs_input_grad[0]:
            if dres is None:
                dx = dy2.mm(weight).view(x.shape)
            else:  # the residual's gradient is the accumulator of the dX GEMM
                dx = torch.addmm(dres.reshape(-1, n_in), dy2, weight).view(x.shape)
        if ctx.needs_input_grad[1]:
            dweight = dy2.t().mm(x.reshape(-1, n_in))
        return dx, dweight


def linear_with_residual(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """(x @ weight^T, x as a view for the residual branch); see the module docstring.

    x: [..., in_features]; weight: [out_features, in_features], the same dtype and device."""
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise ValueError(f"{OP}: x must be a tensor [..., in_features]; got {type(x).__name__}")
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        got = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"{OP}: weight must be [out_features, in_features={x.shape[-1]}]; got {got}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"{OP}: weight is {weight.dtype} on {weight.device} but x is {x.dtype} on {x.device}; "
                         "they must match")
    return _LinearWithResidual.apply(x, weight)


__all__ = ["linear_with_residual"]

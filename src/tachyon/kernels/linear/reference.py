"""PyTorch reference for the GEMMs with an activation epilogue (the CPU path and the oracle for
kernels/linear/triton.py): the unfused chain, one op at a time.

    pre, y = gemm_bias_act(x, w1, b1, act)        pre = x w1^T + b1 (x's dtype), y = act(pre)
    dpre, db1 = gemm_act_grad(dout, w2, pre, act)  dpre = act'(pre) * (dout w2), db1 = column sums

The activation math (and the gated [gate | value] convention) is kernels/activation's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tachyon.kernels.activation.reference import bias_act_backward, bias_act_forward


def gemm_bias_act_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K], weight [R, K], bias [R] or None -> (pre [M, R], act(pre) [M, F]) in x's dtype."""
    with torch.no_grad():
        pre = F.linear(x, weight, bias)
        return pre, bias_act_forward(pre, None, activation)


def gemm_act_grad_reference(dout: torch.Tensor, weight2: torch.Tensor, pre: torch.Tensor, activation: str,
                            bias_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dout [M, O], weight2 [O, F], pre [M, R] -> (dpre [M, R], its column sums in bias_dtype or None)."""
    with torch.no_grad():
        dy = dout.mm(weight2)
        # a zero bias: bias_act_backward then sums the fp32 gradient of the pre-activation
        zero = None if bias_dtype is None else torch.zeros(pre.shape[1], dtype=bias_dtype, device=pre.device)
        return bias_act_backward(dy, pre, zero, activation)

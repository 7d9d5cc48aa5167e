"""The weight-only INT8 linear op: validation, backend choice, torch.library registration.

    qweight, scales = quantize_symmetric(linear.weight, 8, group_size=128)
    y = int8_linear(x, qweight, scales, linear.bias)          # ~ F.linear(x, linear.weight, linear.bias)

An inference op (no backward). Both backends go through one custom op
(``tachyon::int8_linear``) with a fake implementation, so torch.compile and CUDA graphs see one
opaque op. Accumulation is fp32; the output has x's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tachyon.backend import resolve
from tachyon.kernels.common import check_dtype, check_same_device
from tachyon.kernels.int8_linear import reference
from tachyon.kernels.registry import fused_op

OP = "int8_linear"


@fused_op("tachyon::int8_linear", mutates_args=())
def _int8_linear(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None, split_k: int, backend: str) -> Tensor:
    """x [M, K] contiguous -> [M, N]; split_k 0 = automatic (Triton only)."""
    if backend == "triton":
        from tachyon.kernels.int8_linear import triton as tri

        return tri.int8_linear(x, qweight, scales, bias, split_k or None)
    return reference.int8_linear_reference(x, qweight, scales, bias)


@_int8_linear.register_fake
def _(x, qweight, scales, bias, split_k, backend):
    return x.new_empty((x.shape[0], qweight.shape[0]))


def int8_linear(
    x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None = None, *, split_k: int | None = None,
    backend: str | None = None,
) -> Tensor:
    """y = x @ (qweight * scales)^T + bias, the weight dequantized in registers, fp32 accumulation.

    x: [..., K] float32/float16/bfloat16; qweight: int8 [N, K]; scales: float32 [N, G] with G
    dividing K (G = 1 per-channel; else groups of K/G columns, a multiple of 16 on the Triton
    path); bias: [N] or None. Returns [..., N] in x's dtype. ``split_k``: K partitions on the
    Triton path (None: enough programs to fill the GPU at decode). No gradient.
    """
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise ValueError(f"{OP}: x must be a tensor [..., in_features]; got {type(x).__name__}")
    check_dtype(OP, "x", x)
    if not isinstance(qweight, Tensor) or qweight.dim() != 2 or qweight.dtype != torch.int8:
        got = f"{tuple(qweight.shape)} {qweight.dtype}" if isinstance(qweight, Tensor) else type(qweight).__name__
        raise ValueError(f"{OP}: qweight must be an int8 tensor [out_features, in_features]; got {got}")
    n, k = qweight.shape
    if x.shape[-1] != k:
        raise ValueError(f"{OP}: x has {x.shape[-1]} features but qweight is [{n}, {k}] (expects {k})")
    if (not isinstance(scales, Tensor) or scales.dim() != 2 or scales.shape[0] != n or scales.shape[1] < 1
            or k % scales.shape[1] or scales.dtype != torch.float32):
        got = f"{tuple(scales.shape)} {scales.dtype}" if isinstance(scales, Tensor) else type(scales).__name__
        raise ValueError(f"{OP}: scales must be float32 [{n}, G] with G dividing in_features={k}; got {got}")
    if bias is not None:
        if not isinstance(bias, Tensor) or tuple(bias.shape) != (n,):
            got = tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
            raise ValueError(f"{OP}: bias must be [{n}] or None; got {got}")
        check_dtype(OP, "bias", bias)
    check_same_device(OP, x=x, qweight=qweight, scales=scales, bias=bias)
    if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"{OP}: split_k must be an int >= 1 or None; got {split_k!r}")
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError(f"{OP}: an inference op with no backward; call it under torch.no_grad() / inference_mode()")
    chosen = resolve(x, backend)
    g = scales.shape[1]
    if chosen == "triton" and g > 1 and (k // g) % 16:
        raise ValueError(f"{OP}: the Triton kernel needs scale groups of a multiple of 16 columns; got {k // g} "
                         "(use backend='torch')")
    y = _int8_linear(x.reshape(-1, k).contiguous(), qweight.contiguous(), scales.contiguous(), bias, split_k or 0, chosen)
    return y.view(*x.shape[:-1], n)


__all__ = ["int8_linear"]

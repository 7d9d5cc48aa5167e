"""The weight-only INT8 linear op: validation, backend choice, torch.library registration.

    qweight, scales = quantize_symmetric(linear.weight, 8, group_size=128)
    y = int8_linear(x, qweight, scales, linear.bias)          # ~ F.linear(x, linear.weight, linear.bias)
    h = int8_linear(x, q1, s1, fc1.bias, activation="gelu")   # ~ bias_act(F.linear(x, fc1.weight), fc1.bias, "gelu")

An inference op (no backward). Both backends go through one custom op
(``tachyon::int8_linear``) with a fake implementation, so torch.compile and CUDA graphs see one
opaque op. Accumulation is fp32; the output has x's dtype. With ``activation`` the bias and the
activation run in the GEMM's epilogue (fp32, no rounding between the GEMM and the activation), so
an MLP's [tokens, ffn] pre-activation is never written or read back. ``norm_int8_linear`` runs the
norm before the GEMM (LayerNorm or RMSNorm, with the residual add) in its prologue:

    qkv, z = norm_int8_linear(delta, ln.weight, ln.bias, q, s, b, residual=residual)   # z = delta + residual
"""

from __future__ import annotations

import torch
from torch import Tensor

from tachyon.backend import resolve
from tachyon.kernels.activation.reference import ACTIVATIONS, is_gated
from tachyon.kernels.common import check_dtype, check_same_device, check_shape
from tachyon.kernels.int8_linear import reference
from tachyon.kernels.layernorm.reference import norm_forward
from tachyon.kernels.registry import fused_op

OP = "int8_linear"


@fused_op("tachyon::int8_linear", mutates_args=())
def _int8_linear(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None, split_k: int, activation: str,
                 backend: str) -> Tensor:
    """x [M, K] contiguous -> [M, N]; split_k 0 = automatic (Triton only); activation "" = none."""
    act = activation or None
    if backend == "triton":
        from tachyon.kernels.int8_linear import triton as tri

        return tri.int8_linear(x, qweight, scales, bias, split_k or None, act)
    return reference.int8_linear_reference(x, qweight, scales, bias, activation=act)


@_int8_linear.register_fake
def _(x, qweight, scales, bias, split_k, activation, backend):
    rows = qweight.shape[0]
    return x.new_empty((x.shape[0], rows // 2 if activation and is_gated(activation) else rows))


@fused_op("tachyon::norm_int8_linear", mutates_args=())
def _norm_int8_linear(
    x: Tensor, residual: Tensor | None, norm_weight: Tensor, norm_bias: Tensor | None, eps: float, rms: bool,
    qweight: Tensor, scales: Tensor, bias: Tensor | None, split_k: int, activation: str, backend: str,
) -> tuple[Tensor, Tensor]:
    """x [M, K] contiguous -> (y [M, N], z = x + residual [M, K], or an empty tensor without a residual)."""
    act = activation or None
    if backend == "triton":
        from tachyon.kernels.int8_linear import triton as tri

        return tri.int8_linear(x, qweight, scales, bias, split_k or None, act, (residual, norm_weight, norm_bias, eps, rms))
    h, z, _, _ = norm_forward(x, norm_weight, norm_bias, residual, eps, rms)
    y = reference.int8_linear_reference(h, qweight, scales, bias, activation=act)
    return y, (z if residual is not None else x.new_empty(0))


@_norm_int8_linear.register_fake
def _(x, residual, norm_weight, norm_bias, eps, rms, qweight, scales, bias, split_k, activation, backend):
    rows = qweight.shape[0]
    y = x.new_empty((x.shape[0], rows // 2 if activation and is_gated(activation) else rows))
    return y, (torch.empty_like(x) if residual is not None else x.new_empty(0))


def int8_linear(
    x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None = None, *, activation: str | None = None,
    split_k: int | None = None, backend: str | None = None,
) -> Tensor:
    """y = act(x @ (qweight * scales)^T + bias), the weight dequantized in registers, fp32 accumulation.

    x: [..., K] float32/float16/bfloat16; qweight: int8 [N, K]; scales: float32 [N, G] with G
    dividing K (G = 1 per-channel; else groups of K/G columns, a multiple of 16 on the Triton
    path); bias: [N] or None. ``activation``: None, or one of kernels/activation's names
    ("gelu", "gelu_tanh", "relu", "silu", "qgelu"; gated "swiglu", "geglu", "geglu_tanh", which
    take qweight's rows as [gate | value] halves and return N / 2 columns), applied in fp32 after
    the bias as ``bias_act`` does. Returns [..., N] (or [..., N / 2]) in x's dtype. ``split_k``: K
    partitions on the Triton path (None: enough programs to fill the GPU at decode). No gradient.
    """
    chosen = _check(OP, x, qweight, scales, bias, activation, split_k, backend)
    k = qweight.shape[1]
    y = _int8_linear(x.reshape(-1, k).contiguous(), qweight.contiguous(), scales.contiguous(), bias, split_k or 0,
                     activation or "", chosen)
    return y.view(*x.shape[:-1], y.shape[-1])


def norm_int8_linear(
    x: Tensor, norm_weight: Tensor, norm_bias: Tensor | None, qweight: Tensor, scales: Tensor,
    bias: Tensor | None = None, *, residual: Tensor | None = None, rms: bool = False, eps: float = 1e-5,
    activation: str | None = None, split_k: int | None = None, backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """(int8_linear(norm(x + residual), ...), x + residual) with the norm inside the GEMM.

    The norm is kernels/layernorm's ``layer_norm`` (or ``rms_norm`` when ``rms``; then
    norm_bias must be None) of z = x + residual (x when residual is None), over the last dim K,
    weight norm_weight [K], bias norm_bias [K] or None, ``eps``; its output, rounded to x's dtype
    as that kernel returns it, is what the GEMM multiplies; it is never written to memory. The
    other arguments are :func:`int8_linear`'s. Returns (y [..., N or N / 2], z [..., K]) in x's
    dtype: z is the residual stream the next block adds to (x itself when residual is None).
    No gradient.
    """
    op = "norm_int8_linear"
    chosen = _check(op, x, qweight, scales, bias, activation, split_k, backend)
    k = qweight.shape[1]
    check_shape(op, "norm_weight", norm_weight, (k,))
    check_dtype(op, "norm_weight", norm_weight)
    if norm_bias is not None:
        if rms:
            raise ValueError(f"{op}: RMSNorm (rms=True) has no bias; norm_bias must be None")
        check_shape(op, "norm_bias", norm_bias, (k,))
        check_dtype(op, "norm_bias", norm_bias)
    if residual is not None:
        if not isinstance(residual, Tensor) or residual.shape != x.shape or residual.dtype != x.dtype:
            got = f"{tuple(residual.shape)} {residual.dtype}" if isinstance(residual, Tensor) else type(residual).__name__
            raise ValueError(f"{op}: residual must have x's shape {tuple(x.shape)} and dtype {x.dtype}; got {got}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{op}: eps must be a number >= 0; got {eps!r}")
    check_same_device(op, x=x, norm_weight=norm_weight, norm_bias=norm_bias, residual=residual)
    rows = x.reshape(-1, k).contiguous()
    y, z = _norm_int8_linear(rows, None if residual is None else residual.reshape(-1, k).contiguous(),
                             norm_weight.contiguous(), None if norm_bias is None else norm_bias.contiguous(),
                             float(eps), bool(rms), qweight.contiguous(), scales.contiguous(), bias, split_k or 0,
                             activation or "", chosen)
    return y.view(*x.shape[:-1], y.shape[-1]), (x if residual is None else z.view(x.shape))


def _check(op: str, x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None, activation: str | None,
           split_k: int | None, backend: str | None) -> str:
    """Validates the GEMM's arguments (see int8_linear); returns the backend."""
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise ValueError(f"{op}: x must be a tensor [..., in_features]; got {type(x).__name__}")
    check_dtype(op, "x", x)
    if not isinstance(qweight, Tensor) or qweight.dim() != 2 or qweight.dtype != torch.int8:
        got = f"{tuple(qweight.shape)} {qweight.dtype}" if isinstance(qweight, Tensor) else type(qweight).__name__
        raise ValueError(f"{op}: qweight must be an int8 tensor [out_features, in_features]; got {got}")
    n, k = qweight.shape
    if x.shape[-1] != k:
        raise ValueError(f"{op}: x has {x.shape[-1]} features but qweight is [{n}, {k}] (expects {k})")
    if (not isinstance(scales, Tensor) or scales.dim() != 2 or scales.shape[0] != n or scales.shape[1] < 1
            or k % scales.shape[1] or scales.dtype != torch.float32):
        got = f"{tuple(scales.shape)} {scales.dtype}" if isinstance(scales, Tensor) else type(scales).__name__
        raise ValueError(f"{op}: scales must be float32 [{n}, G] with G dividing in_features={k}; got {got}")
    if activation is not None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"{op}: activation={activation!r} is not supported; allowed: None, "
                             f"{', '.join(map(repr, ACTIVATIONS))}")
        if is_gated(activation) and n % 2:
            raise ValueError(f"{op}: activation={activation!r} is gated and splits qweight's {n} rows into "
                             "[gate | value] halves; the row count must be even")
    if bias is not None:
        if not isinstance(bias, Tensor) or tuple(bias.shape) != (n,):
            got = tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
            raise ValueError(f"{op}: bias must be [{n}] or None; got {got}")
        check_dtype(op, "bias", bias)
    check_same_device(op, x=x, qweight=qweight, scales=scales, bias=bias)
    if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"{op}: split_k must be an int >= 1 or None; got {split_k!r}")
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError(f"{op}: an inference op with no backward; call it under torch.no_grad() / inference_mode()")
    chosen = resolve(x, backend)
    g = scales.shape[1]
    if chosen == "triton" and g > 1 and (k // g) % 16:
        raise ValueError(f"{op}: the Triton kernel needs scale groups of a multiple of 16 columns; got {k // g} "
                         "(use backend='torch')")
    return chosen


__all__ = ["int8_linear", "norm_int8_linear"]

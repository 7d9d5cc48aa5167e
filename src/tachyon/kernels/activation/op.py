"""The fused bias + activation ops: validation, backend choice, torch.library registration, autograd.

    y = bias_act(x, bias, "gelu")                       # y = gelu(x + bias)
    y = bias_act(x, bias, "swiglu")                     # x: [..., 2F] -> y: [..., F]
    out = bias_act_linear(x, b1, "gelu", w2, b2, checkpoint_activation=True)

What is saved for backward:

- ``bias_act``: x and bias (the pre-activation's parts, no new tensor); y is NOT saved, the
  backward recomputes act'(x + bias). (There is no ``recompute`` flag: bias_act never keeps y, so
  such a flag would change nothing. Dropping the *next* layer's saved copy of y is what
  ``bias_act_linear`` does.)
- ``bias_act_linear`` (= linear(bias_act(x, bias), weight2, bias2) as one op): x, bias, weight2,
  and y (the second GEMM's input, which its weight gradient needs) unless
  ``checkpoint_activation=True``; then y is recomputed from x in backward (one extra elementwise
  pass) and the [..., F] activation is never kept: DeepSpeed's ``gelu_checkpoint``.

Both backends run through the same custom ops, so they save the same tensors and torch.compile
traces them through the fake implementations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tachyon.backend import resolve
from tachyon.kernels.activation import reference
from tachyon.kernels.activation.reference import ACTIVATIONS, is_gated
from tachyon.kernels.common import check_dtype, check_same_device, check_shape, lazy_module
from tachyon.kernels.registry import fused_op

_triton = lazy_module("tachyon.kernels.activation.triton")  # imported on first use (it imports Triton)


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


def _out_features(x: Tensor, activation: str) -> int:
    return x.shape[-1] // 2 if is_gated(activation) else x.shape[-1]


@fused_op("tachyon::bias_act_fwd", mutates_args=(), triton_op=True)
def _bias_act_fwd(x: Tensor, bias: Tensor | None, activation: str, backend: str) -> Tensor:
    """x: [M, K] contiguous, bias: [K] or None -> y: [M, F]."""
    if backend == "triton":
        tri = _triton()
        return tri.bias_act_fwd(x, bias, activation)
    return reference.bias_act_forward(x, bias, activation)


@_bias_act_fwd.register_fake
def _(x, bias, activation, backend):
    return x.new_empty((x.shape[0], _out_features(x, activation)))


@fused_op("tachyon::bias_act_bwd", mutates_args=(), triton_op=True)
def _bias_act_bwd(dy: Tensor, x: Tensor, bias: Tensor | None, activation: str, backend: str) -> tuple[Tensor, Tensor]:
    """dy: [M, F], x: [M, K]. Returns (dx [M, K], dbias [K] or an empty tensor)."""
    impl = reference.bias_act_backward
    if backend == "triton":
        tri = _triton()
        impl = tri.bias_act_bwd
    dx, db = impl(dy, x, bias, activation)
    return dx, (db if db is not None else _empty(x))


@_bias_act_bwd.register_fake
def _(dy, x, bias, activation, backend):
    return torch.empty_like(x), (torch.empty_like(bias) if bias is not None else _empty(x))


def _bias_act_setup(ctx, inputs, output) -> None:
    x, bias, activation, backend = inputs
    ctx.activation, ctx.backend, ctx.has_bias = activation, backend, bias is not None
    ctx.save_for_backward(x, bias)


def _bias_act_backward(ctx, dy):
    x, bias = ctx.saved_tensors
    dx, db = _bias_act_bwd(dy.contiguous(), x, bias, ctx.activation, ctx.backend)
    return dx, (db if ctx.has_bias else None), None, None


_bias_act_fwd.register_autograd(_bias_act_backward, setup_context=_bias_act_setup)


@fused_op("tachyon::bias_act_linear_fwd", mutates_args=())
def _bias_act_linear_fwd(
    x: Tensor, bias: Tensor | None, weight2: Tensor, bias2: Tensor | None, activation: str, keep_y: bool, backend: str,
) -> tuple[Tensor, Tensor]:
    """x: [M, K] contiguous -> (out [M, O], y [M, F] when keep_y else an empty tensor)."""
    y = _bias_act_fwd(x, bias, activation, backend)
    out = F.linear(y, weight2, bias2)
    return out, (y if keep_y else _empty(x))


@_bias_act_linear_fwd.register_fake
def _(x, bias, weight2, bias2, activation, keep_y, backend):
    y = x.new_empty((x.shape[0], _out_features(x, activation))) if keep_y else _empty(x)
    return x.new_empty((x.shape[0], weight2.shape[0])), y


def _bias_act_linear_setup(ctx, inputs, output) -> None:
    x, bias, weight2, bias2, activation, keep_y, backend = inputs
    ctx.set_materialize_grads(False)  # the kept y never gets a gradient: None, not a zero fill
    ctx.activation, ctx.backend, ctx.keep_y = activation, backend, keep_y
    ctx.has_bias, ctx.bias2_dtype = bias is not None, (bias2.dtype if bias2 is not None else None)
    ctx.save_for_backward(x, bias, weight2, output[1] if keep_y else None)


def _bias_act_linear_backward(ctx, dout, _dy):
    x, bias, weight2, y = ctx.saved_tensors
    if y is None:  # checkpoint_activation: recompute the second GEMM's input from the pre-activation
        y = _bias_act_fwd(x, bias, ctx.activation, ctx.backend)
    dout = dout.contiguous()
    dweight2 = dout.t().mm(y)
    dbias2 = dout.sum(0, dtype=torch.float32).to(ctx.bias2_dtype) if ctx.bias2_dtype is not None else None
    dy = dout.mm(weight2)
    dx, db = _bias_act_bwd(dy, x, bias, ctx.activation, ctx.backend)
    return dx, (db if ctx.has_bias else None), dweight2, dbias2, None, None, None


_bias_act_linear_fwd.register_autograd(_bias_act_linear_backward, setup_context=_bias_act_linear_setup)


def _check(op: str, x: Tensor, bias: Tensor | None, activation: str) -> None:
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise ValueError(f"{op}: x must be a tensor with at least one dimension; got {type(x).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation={activation!r} is not supported; allowed: {', '.join(map(repr, ACTIVATIONS))}")
    k = x.shape[-1]
    if is_gated(activation) and k % 2:
        raise ValueError(
            f"{op}: activation={activation!r} is gated and splits the last dim of x in halves [gate, value]; "
            f"x's last dim is {k}, which is odd"
        )
    check_dtype(op, "x", x)
    if bias is not None:
        check_dtype(op, "bias", bias)
        check_shape(op, "bias", bias, (k,))


def bias_act(x: Tensor, bias: Tensor | None = None, activation: str = "gelu", *, backend: str | None = None) -> Tensor:
    """y = act(x + bias), computed in fp32 and returned in x's dtype.

    x: [..., K]; bias: [K] or None. activation: "gelu" (erf), "gelu_tanh", "relu", "silu",
    "qgelu" (x * sigmoid(1.702 x)): y is [..., K]; or gated "swiglu" (silu(a) * b), "geglu"
    (gelu(a) * b), "geglu_tanh" (gelu_tanh(a) * b) with [a, b] = (x + bias).chunk(2, -1): y is
    [..., K / 2]. Saves x and bias for
    backward (not y); dbias comes back in bias's dtype. Dtypes: float32, float16, bfloat16.
    """
    op = "bias_act"
    _check(op, x, bias, activation)
    check_same_device(op, x=x, bias=bias)
    chosen = resolve(x, backend)
    k = x.shape[-1]
    y = _bias_act_fwd(x.reshape(-1, k).contiguous(), bias, activation, chosen)
    return y.view(*x.shape[:-1], y.shape[-1])


def bias_act_linear(
    x: Tensor, bias: Tensor | None, activation: str, weight2: Tensor, bias2: Tensor | None = None, *,
    checkpoint_activation: bool, backend: str | None = None,
) -> Tensor:
    """out = linear(bias_act(x, bias, activation), weight2, bias2) as one autograd op.

    x: [..., K]; bias: [K] or None; weight2: [O, F] (F = K, or K / 2 for gated activations);
    bias2: [O] or None; out: [..., O] in x's dtype (weight2 and bias2 must have x's dtype, as for
    F.linear). Saved for backward: x, bias, weight2, plus the activation y [..., F] unless
    ``checkpoint_activation``, in which case y is recomputed from x in backward. Gradients are the
    same either way (the recomputation is deterministic).
    """
    op = "bias_act_linear"
    _check(op, x, bias, activation)
    f = _out_features(x, activation)
    if not isinstance(weight2, Tensor) or weight2.dim() != 2 or weight2.shape[1] != f:
        shape = tuple(weight2.shape) if isinstance(weight2, Tensor) else type(weight2).__name__
        raise ValueError(f"{op}: weight2 has shape {shape}; expected (out_features, {f}) for activation={activation!r}")
    for name, t in (("weight2", weight2), ("bias2", bias2)):
        if t is not None and t.dtype != x.dtype:
            raise ValueError(f"{op}: {name} has dtype {t.dtype} but x has {x.dtype}; they must match (as in F.linear)")
    if bias2 is not None:
        check_shape(op, "bias2", bias2, (weight2.shape[0],))
    if not isinstance(checkpoint_activation, bool):
        raise ValueError(f"{op}: checkpoint_activation must be True or False; got {checkpoint_activation!r}")
    check_same_device(op, x=x, bias=bias, weight2=weight2, bias2=bias2)
    chosen = resolve(x, backend)
    k = x.shape[-1]
    out, _ = _bias_act_linear_fwd(
        x.reshape(-1, k).contiguous(), bias, weight2, bias2, activation, not checkpoint_activation, chosen,
    )
    return out.view(*x.shape[:-1], weight2.shape[0])


__all__ = ["ACTIVATIONS", "bias_act", "bias_act_linear"]

"""An MLP block as one autograd op, its activation fused into the GEMMs around it.

    out = mlp(x, w1, b1, "gelu", w2, b2)                      # act(x @ w1^T + b1) @ w2^T + b2
    out, x_res = mlp(x, w1, b1, "gelu", w2, None, return_residual=True)   # x_res: x, for a residual

Forward: ``gemm_bias_act`` (Triton: ONE GEMM whose epilogue adds b1, stores the pre-activation
for backward and stores y = act(pre); torch: F.linear, then bias_act), then y @ w2^T (cuBLAS).
Backward: dW2 = dout^T y and db2 (cuBLAS / a column sum); ``gemm_act_grad`` (Triton: ONE GEMM
dout @ w2 whose epilogue multiplies by act'(pre) and writes dpre, plus b1's gradient as fp32
column sums of partial rows; torch: the GEMM, then bias_act's backward); dW1 = dpre^T x and
dx = dpre @ w1 (cuBLAS). Against cuBLAS GEMMs with a separate bias + activation kernel, the
[tokens, ffn] GEMM output is not written and read back, in either direction: per step that is
four [tokens, ffn] passes less (kernels/linear/triton.py).

With ``return_residual`` x also feeds a residual branch (post-LN BERT: y1 feeds the MLP and
LN_out's residual): its gradient arrives at this op, and dx = dres + dpre @ w1 is one addmm (as
``linear_with_residual``): no separate add.

Saved for backward: x, w1, w2, pre [..., R] and y [..., F] (R = F, or 2F for a gated activation),
unless ``checkpoint_activation``: then y is not kept and is recomputed from pre in backward (one
elementwise pass; DeepSpeed's ``gelu_checkpoint``). Gradients are identical either way.
Activations: kernels/activation's names (gelu, gelu_tanh, relu, silu, qgelu; gated swiglu,
geglu, geglu_tanh with w1's rows as [gate | value] halves).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tachyon.backend import auto_on_cuda, resolve
from tachyon.kernels import dispatch
from tachyon.kernels.activation.op import _bias_act_fwd
from tachyon.kernels.activation.reference import ACTIVATIONS, is_gated
from tachyon.kernels.common import check_dtype, check_same_device, check_shape, lazy_module
from tachyon.kernels.linear import reference
from tachyon.kernels.registry import fused_op

_triton = lazy_module("tachyon.kernels.linear.triton")  # imported on first use (it imports Triton)
_activation_triton = lazy_module("tachyon.kernels.activation.triton")

OP = "mlp"
CUBLAS = "cublas"  # the block's GEMM ops: torch's GEMM + tachyon's bias-activation kernel (dispatch's twin)


def gemm_backend(x: Tensor, backend: str | None, features: int, *params: Tensor | None) -> str:
    """The backend of the block's two GEMM ops for an [.., K] input ``x``: resolve()'s choice, except
    that under "auto" on CUDA the dispatch table may pick "cublas" (measured faster there). ``params``:
    the block's (or layer's) parameters, which decide with x whether the call will be differentiated;
    looked at only when the table is consulted."""
    chosen = resolve(x, backend)
    if chosen == "triton" and auto_on_cuda(x, backend) and dispatch.choose_by(
            OP, x, dispatch.mlp_class, (x.numel() // max(x.shape[-1], 1), x.shape[-1], features),
            dispatch.needs_backward(x, *params)) == dispatch.TWIN:
        return CUBLAS
    return chosen


@fused_op("tachyon::gemm_bias_act", mutates_args=(), triton_op=True)
def _gemm_bias_act(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str, backend: str) -> tuple[Tensor, Tensor]:
    """x [M, K] contiguous -> (pre [M, R], y [M, F]). backend "cublas": torch's GEMM (with the bias),
    then tachyon's bias-activation kernel writing y (the dispatch table's twin on CUDA)."""
    if backend == "triton":
        tri = _triton()
        return tri.gemm_bias_act(x, weight, bias, activation)
    if backend == CUBLAS:
        pre = F.linear(x, weight, bias)
        return pre, _activation_triton().bias_act_fwd(pre, None, activation)
    return reference.gemm_bias_act_reference(x, weight, bias, activation)


@_gemm_bias_act.register_fake
def _(x, weight, bias, activation, backend):
    rows = weight.shape[0]
    return x.new_empty((x.shape[0], rows)), x.new_empty((x.shape[0], rows // 2 if is_gated(activation) else rows))


@fused_op("tachyon::gemm_act_grad", mutates_args=(), triton_op=True)
def _gemm_act_grad(dout: Tensor, weight2: Tensor, pre: Tensor, activation: str, want_dbias: bool,
                   backend: str) -> tuple[Tensor, Tensor]:
    """dout [M, O] contiguous -> (dpre [M, R], dbias [R] in pre's dtype or an empty tensor). backend
    "cublas": torch's GEMM, then tachyon's bias-activation backward kernel (dpre and its column sums)."""
    if backend == CUBLAS:
        # a zero bias adds nothing to pre and makes the kernel sum dpre's columns (b1's gradient)
        zero = torch.zeros(pre.shape[1], dtype=pre.dtype, device=pre.device) if want_dbias else None
        dpre, dbias = _activation_triton().bias_act_bwd(dout.mm(weight2), pre, zero, activation)
        return dpre, (dbias if dbias is not None else pre.new_empty(0))
    impl = reference.gemm_act_grad_reference
    if backend == "triton":
        tri = _triton()
        impl = tri.gemm_act_grad
    dpre, dbias = impl(dout, weight2, pre, activation, pre.dtype if want_dbias else None)
    return dpre, (dbias if dbias is not None else pre.new_empty(0))


@_gemm_act_grad.register_fake
def _(dout, weight2, pre, activation, want_dbias, backend):
    return torch.empty_like(pre), (pre.new_empty(pre.shape[1]) if want_dbias else pre.new_empty(0))


class _MLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None, activation: str,
                keep_y: bool, backend: str) -> tuple[Tensor, Tensor]:
        k = x.shape[-1]
        pre, y = _gemm_bias_act(x.reshape(-1, k).contiguous(), w1, b1, activation, backend)
        out = F.linear(y, w2, b2)
        ctx.activation, ctx.backend = activation, backend
        ctx.has_b1, ctx.b2_dtype = b1 is not None, (b2.dtype if b2 is not None else None)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not a zero fill
        ctx.save_for_backward(x, w1, w2, pre, y if keep_y else None)
        return out.view(*x.shape[:-1], w2.shape[0]), x.view_as(x)

    @staticmethod
    def backward(ctx, dout: Tensor | None, dres: Tensor | None):
        x, w1, w2, pre, y = ctx.saved_tensors
        if dout is None:
            return dres, None, None, None, None, None, None, None
        dout2 = dout.reshape(-1, dout.shape[-1]).contiguous()
        dw2 = db2 = None
        if ctx.needs_input_grad[3]:
            if y is None:  # checkpoint_activation: y from the kept pre-activation
                y = _bias_act_fwd(pre, None, ctx.activation, "triton" if ctx.backend == CUBLAS else ctx.backend)
            dw2 = dout2.t().mm(y)
        if ctx.b2_dtype is not None and ctx.needs_input_grad[4]:
            db2 = dout2.sum(0, dtype=torch.float32).to(ctx.b2_dtype)
        dpre, db1 = _gemm_act_grad(dout2, w2, pre, ctx.activation, ctx.has_b1, ctx.backend)
        k = x.shape[-1]
        dx = None
        if ctx.needs_input_grad[0]:
            if dres is None:
                dx = dpre.mm(w1).view(*x.shape)
            else:  # the residual branch's gradient is the accumulator of the dX GEMM
                dx = torch.addmm(dres.reshape(-1, k), dpre, w1).view(*x.shape)
        dw1 = dpre.t().mm(x.reshape(-1, k)) if ctx.needs_input_grad[1] else None
        return dx, dw1, (db1 if ctx.has_b1 else None), dw2, db2, None, None, None


def mlp(
    x: Tensor, weight1: Tensor, bias1: Tensor | None, activation: str, weight2: Tensor, bias2: Tensor | None = None, *,
    checkpoint_activation: bool = False, return_residual: bool = False, backend: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """act(x @ weight1^T + bias1) @ weight2^T + bias2 as one autograd op (see the module docstring).

    x: [..., K]; weight1: [R, K] (R = F, or 2F for a gated activation: [gate | value] rows);
    bias1: [R] or None; weight2: [O, F]; bias2: [O] or None; all in x's dtype (float32, float16,
    bfloat16) and on its device. Returns out [..., O] in x's dtype, or (out, x as a view) when
    ``return_residual``. Saved for backward: x, the weights, the pre-activation [..., R] and, unless
    ``checkpoint_activation``, the activation [..., F].
    """
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise ValueError(f"{OP}: x must be a tensor [..., in_features]; got {type(x).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{OP}: activation={activation!r} is not supported; allowed: {', '.join(map(repr, ACTIVATIONS))}")
    check_dtype(OP, "x", x)
    k = x.shape[-1]
    for name, w in (("weight1", weight1), ("weight2", weight2)):
        if not isinstance(w, Tensor) or w.dim() != 2:
            raise ValueError(f"{OP}: {name} must be a 2-d tensor; got {type(w).__name__ if not isinstance(w, Tensor) else tuple(w.shape)}")
    rows = weight1.shape[0]
    if weight1.shape[1] != k:
        raise ValueError(f"{OP}: weight1 has shape {tuple(weight1.shape)}; expected (ffn_rows, {k}) for x's {k} features")
    if is_gated(activation) and rows % 2:
        raise ValueError(f"{OP}: activation={activation!r} is gated and splits weight1's {rows} rows into [gate | value] "
                         "halves; the row count must be even")
    f = rows // 2 if is_gated(activation) else rows
    if weight2.shape[1] != f:
        raise ValueError(f"{OP}: weight2 has shape {tuple(weight2.shape)}; expected (out_features, {f}) for "
                         f"activation={activation!r} and weight1 {tuple(weight1.shape)}")
    for name, t in (("weight1", weight1), ("bias1", bias1), ("weight2", weight2), ("bias2", bias2)):
        if t is not None and t.dtype != x.dtype:
            raise ValueError(f"{OP}: {name} has dtype {t.dtype} but x has {x.dtype}; they must match (as in F.linear)")
    if bias1 is not None:
        check_shape(OP, "bias1", bias1, (rows,))
    if bias2 is not None:
        check_shape(OP, "bias2", bias2, (weight2.shape[0],))
    for name, flag in (("checkpoint_activation", checkpoint_activation), ("return_residual", return_residual)):
        if not isinstance(flag, bool):
            raise ValueError(f"{OP}: {name} must be True or False; got {flag!r}")
    check_same_device(OP, x=x, weight1=weight1, bias1=bias1, weight2=weight2, bias2=bias2)
    be = gemm_backend(x, backend, f, weight1, bias1, weight2, bias2)
    out, x_res = _MLP.apply(x, weight1, bias1, weight2, bias2, activation, not checkpoint_activation, be)
    return (out, x_res) if return_residual else out


__all__ = ["CUBLAS", "gemm_backend", "mlp"]

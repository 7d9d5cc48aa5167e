"""The fused norm ops: validation, backend choice, torch.library registration and autograd.

    y = layer_norm(x, weight, bias, residual=None, eps=1e-5)
    y, z = layer_norm(x, weight, bias, residual=r, return_residual=True)    # z = x + r
    y = rms_norm(x, weight, eps=1e-6)

Both backends go through the same custom op (``tachyon::norm_fwd`` / ``tachyon::norm_bwd``) so
that they save the same tensors for backward and torch.compile traces either through the fake
implementations. What is saved for backward: z (the norm input; x itself when there is no
residual) and the fp32 row statistics, or with ``invertible=True`` the output y instead of z
(the backward recomputes the normalized input from y, bias and weight; weight must have no zeros).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tachyon.backend import auto_on_cuda, resolve
from tachyon.kernels import dispatch
from tachyon.kernels.common import SUPPORTED_DTYPES, check_dtype, check_same_device, check_shape, lazy_module
from tachyon.kernels.layernorm import reference
from tachyon.kernels.registry import fused_op

_triton = lazy_module("tachyon.kernels.layernorm.triton")  # imported on first use (it imports Triton)

MAX_TRITON_N = 65536  # one row is one Triton block
_PLAIN = (Tensor, torch.nn.Parameter)
_choose, norm_class, TWIN, _grad_enabled = dispatch.choose_by, dispatch.norm_class, dispatch.TWIN, torch.is_grad_enabled  # other tensor types take the detailed checks (which accept subclasses)


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


@fused_op("tachyon::norm_fwd", mutates_args=(), triton_op=True)
def _norm_fwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None,
    eps: float, is_rms: bool, invertible: bool, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x, residual: [M, N] contiguous. Returns (y, z or an empty tensor, mean or an empty tensor,
    rstd): the mean is neither written nor returned where the backward does not read it (RMSNorm,
    the invertible form)."""
    store_mean = not (is_rms or invertible)
    if backend == "triton":
        tri = _triton()
        y, z, mean, rstd = tri.norm_fwd(x, weight, bias, residual, eps, is_rms, store_mean)
    else:
        y, z, mean, rstd = reference.norm_forward(x, weight, bias, residual, eps, is_rms)
    return y, (z if residual is not None else _empty(x)), (mean if store_mean else _empty(rstd)), rstd


@_norm_fwd.register_fake
def _(x, weight, bias, residual, eps, is_rms, invertible, backend):
    stats = x.new_empty(x.shape[0], dtype=torch.float32)
    z = torch.empty_like(x) if residual is not None else _empty(x)
    return torch.empty_like(x), z, (_empty(stats) if is_rms or invertible else stats), torch.empty_like(stats)


@fused_op("tachyon::norm_bwd", mutates_args=(), triton_op=True)
def _norm_bwd(
    dy: Tensor, saved: Tensor, dz_out: Tensor | None, weight: Tensor, bias: Tensor | None,
    mean: Tensor, rstd: Tensor, is_rms: bool, from_output: bool, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (dx, dweight, dbias or an empty tensor); dx is also the residual's gradient."""
    impl = reference.norm_backward
    if backend == "triton":
        tri = _triton()
        impl = tri.norm_bwd
    dx, dw, db = impl(dy, saved, dz_out, weight, bias, mean, rstd, is_rms, from_output, saved.dtype)
    return dx, dw, (db if db is not None else _empty(weight))


@_norm_bwd.register_fake
def _(dy, saved, dz_out, weight, bias, mean, rstd, is_rms, from_output, backend):
    db = torch.empty_like(bias) if bias is not None else _empty(weight)
    return torch.empty_like(saved), torch.empty_like(weight), db


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, residual, _eps, is_rms, invertible, backend = inputs
    y, z, mean, rstd = output
    ctx.set_materialize_grads(False)  # outputs without a gradient (z, mean, rstd) come as None, no zero fill
    ctx.is_rms, ctx.invertible, ctx.backend = is_rms, invertible, backend
    ctx.has_residual, ctx.has_bias = residual is not None, bias is not None
    if invertible:
        ctx.save_for_backward(y, weight, bias, None, rstd)
    else:
        saved = z if residual is not None else x
        ctx.save_for_backward(saved, weight, bias, None if is_rms else mean, rstd)


def _backward(ctx, dy, dz_out, _dmean, _drstd):
    saved, weight, bias, mean, rstd = ctx.saved_tensors
    if mean is None:
        mean = rstd  # not read by the kernels (RMSNorm, or invertible)
    if dy is None:  # only the returned sum z took part in the loss
        dy = torch.zeros_like(saved)
    use_dz = ctx.has_residual and dz_out is not None and dz_out.numel() > 0
    dx, dw, db = _norm_bwd(
        dy.contiguous(), saved, dz_out.contiguous() if use_dz else None, weight, bias, mean, rstd,
        ctx.is_rms, ctx.invertible, ctx.backend,
    )
    return dx, dw, (db if ctx.has_bias else None), (dx if ctx.has_residual else None), None, None, None, None


_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


class _NormWithInputBranch(torch.autograd.Function):
    """(y = norm(x), x as a view) for a caller that also adds x to a residual branch (a pre-LN
    block: y feeds the block, x the residual). Autograd would get two gradients for x, the norm's
    dx and the branch's, and add them in a separate pass; here both belong to this node, and the
    norm's backward kernel adds the branch's gradient as its ``dz_out`` (read once, no extra
    write). Saves what the norm op saves."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms, invertible, backend):
        y, _, mean, rstd = _norm_fwd(x, weight, bias, None, eps, is_rms, invertible, backend)
        ctx.set_materialize_grads(False)
        ctx.is_rms, ctx.invertible, ctx.backend, ctx.has_bias = is_rms, invertible, backend, bias is not None
        ctx.save_for_backward(y if invertible else x, weight, bias, None if is_rms or invertible else mean, rstd)
        return y, x.view_as(x)

    @staticmethod
    def backward(ctx, dy, dx_branch):
        saved, weight, bias, mean, rstd = ctx.saved_tensors
        if dy is None:  # only the branch took part in the loss
            return dx_branch, None, None, None, None, None, None
        dx, dw, db = _norm_bwd(
            dy.contiguous(), saved, dx_branch.contiguous() if dx_branch is not None else None, weight, bias,
            rstd if mean is None else mean, rstd, ctx.is_rms, ctx.invertible, ctx.backend,
        )
        return dx, dw, (db if ctx.has_bias else None), None, None, None, None


def _twin_applies(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None) -> bool:
    """torch's norms take one dtype for input and parameters (tachyon's kernels also take fp32
    parameters with half inputs: those stay on Triton)."""
    return weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype)


def _torch_twin(x, weight, bias, residual, eps, is_rms, return_residual):
    """The norm through torch's own op (the measured choice of ``backend="auto"`` on CUDA where it
    was faster; see tachyon.kernels.dispatch): the residual added first, statistics in fp32 inside
    torch's kernel, autograd's backward. ``invertible`` has no effect here (torch saves the input)."""
    z = x if residual is None else x + residual
    shape = (x.shape[-1],)
    # torch.layer_norm / torch.rms_norm: what F.layer_norm / F.rms_norm call, without their Python
    # wrappers (the C functions handle __torch_function__ overrides themselves). F.layer_norm's last
    # argument, torch.backends.cudnn.enabled, is left at its default: ATen's layer_norm ignores it
    # (deprecated), and reading it via torch._C._get_cudnn_enabled() breaks torch.compile's graph
    y = torch.rms_norm(z, shape, weight, eps) if is_rms else torch.layer_norm(z, shape, weight, bias, eps)
    return (y, z) if return_residual else y


def _check_norm_args(op: str, x, weight: Tensor, bias: Tensor | None, residual: Tensor | None, eps: float) -> None:
    """Raises the error for the first thing wrong with a norm call's arguments (nothing when they are valid)."""
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise ValueError(f"{op}: x must be a tensor with at least one dimension; got {type(x).__name__}")
    n = x.shape[-1]
    check_dtype(op, "x", x)
    check_dtype(op, "weight", weight)
    check_shape(op, "weight", weight, (n,))
    if bias is not None:
        check_dtype(op, "bias", bias)
        check_shape(op, "bias", bias, (n,))
    if residual is not None:
        check_shape(op, "residual", residual, tuple(x.shape))
        if residual.dtype != x.dtype:
            raise ValueError(f"{op}: residual has dtype {residual.dtype} but x has {x.dtype}; they must match")
    check_same_device(op, x=x, weight=weight, bias=bias, residual=residual)
    if not eps >= 0:
        raise ValueError(f"{op}: eps must be >= 0; got {eps}")


def _fused_norm(
    op: str, x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None, eps: float,
    is_rms: bool, return_residual: bool, invertible: bool, backend: str | None,
):
    # the valid case in one expression, each attribute read once (host time: no call per check);
    # anything else gets the named error
    if not (type(x) in _PLAIN and x.dim() and (dtype := x.dtype) in SUPPORTED_DTYPES and type(weight) in _PLAIN
            and weight.dtype in SUPPORTED_DTYPES and weight.shape == (n := x.shape[-1],)
            and weight.device == (device := x.device)
            and (bias is None or (type(bias) in _PLAIN and bias.dtype in SUPPORTED_DTYPES
                                  and bias.shape == (n,) and bias.device == device))
            and (residual is None or (type(residual) in _PLAIN and residual.shape == x.shape
                                      and residual.dtype == dtype and residual.device == device))
            and eps >= 0):
        _check_norm_args(op, x, weight, bias, residual, eps)  # raises, or passes another tensor type
        n, dtype = x.shape[-1], x.dtype  # (the expression stopped before assigning them)
    chosen = resolve(x, backend)
    if chosen == "triton" and auto_on_cuda(x, backend) and weight.dtype == dtype \
            and (bias is None or bias.dtype == dtype) \
            and _choose(op, x, norm_class, (n,), _grad_enabled() and (
                x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
                or (residual is not None and residual.requires_grad))) == TWIN:
        # (the condition of _twin_applies and dispatch.needs_backward, inline: host time)
        if residual is None and not return_residual:  # _torch_twin's plain case, without its call
            return torch.rms_norm(x, (n,), weight, eps) if is_rms else torch.layer_norm(x, (n,), weight, bias, eps)
        return _torch_twin(x, weight, bias, residual, eps, is_rms, return_residual)
    if chosen == "triton" and n > MAX_TRITON_N:
        raise ValueError(f"{op}: the Triton kernel handles rows of up to {MAX_TRITON_N} elements; got {n} (use backend='torch')")
    shape = x.shape  # views below take *shape: from ints a view costs ~2 us less host time than from a torch.Size
    x2 = x.reshape(-1, n).contiguous()
    r2 = residual.reshape(-1, n).contiguous() if residual is not None else None
    if return_residual and residual is None:  # z = x: its branch's gradient joins the norm's backward
        y, x_branch = _NormWithInputBranch.apply(x2, weight, bias, float(eps), is_rms, invertible, chosen)
        return y.view(*shape), x_branch.view(*shape)
    y, z, _, _ = _norm_fwd(x2, weight, bias, r2, float(eps), is_rms, invertible, chosen)
    y = y.view(*shape)
    if not return_residual:
        return y
    return y, z.view(*shape)


def layer_norm(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None,
    eps: float = 1e-5, *, return_residual: bool = False, invertible: bool = False,
    backend: str | None = None,
):
    """LayerNorm over the last dim of ``x`` [..., N], optionally of ``x + residual``.

    weight, bias: [N] (bias may be None). Returns y in x's dtype, or (y, z) with z = x + residual
    when ``return_residual`` (the sum the next block adds to; without a residual, z is x itself,
    as a view whose gradient the norm's backward kernel adds to x's: no separate add).
    ``invertible`` saves the output instead of the input for backward. Dtypes: float32, float16,
    bfloat16.
    """
    return _fused_norm("layer_norm", x, weight, bias, residual, eps, False, return_residual, invertible, backend)


def rms_norm(
    x: Tensor, weight: Tensor, residual: Tensor | None = None, eps: float = 1e-6, *,
    return_residual: bool = False, invertible: bool = False, backend: str | None = None,
):
    """RMSNorm over the last dim: y = z / sqrt(mean(z^2) + eps) * weight, z = x (+ residual)."""
    return _fused_norm("rms_norm", x, weight, None, residual, eps, True, return_residual, invertible, backend)


__all__ = ["layer_norm", "rms_norm", "SUPPORTED_DTYPES"]

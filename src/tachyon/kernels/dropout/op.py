"""Fused bias + dropout + residual (+ LayerNorm/RMSNorm) ops: validation, backend choice, autograd.

    out = bias_dropout_add(x, bias, residual, p=0.1, seed=step_seed)
    y, z = bias_dropout_add_layer_norm(x, bias, residual, ln_w, ln_b, 1e-5, 0.1, seed)

The dropout mask is tachyon.kernels.random's over the rows of x viewed as [M, N] (16-bit draws,
eight per Philox call; dropped with probability round(p * 65536) / 65536), identical on both
backends, and it is never stored: the backward regenerates it from the seed.
The seed is an int, or a 0-dim int64 tensor on x's device (never read on the host; under
torch.compile a graph input, so a per-step seed does not recompile). Through the custom ops an
int travels as ``seed`` and a tensor as ``seed_tensor``; the same value gives the same mask.

What is saved for backward:

- ``bias_dropout_add``: nothing of x's size (p, an int seed and which inputs were given, as
  Python values; a tensor seed, 8 bytes): dx = where(keep, dout / (1 - p), 0), dbias = its row
  sum, dresidual = dout.
- ``bias_dropout_add_layer_norm``: z (the norm's input), weight, ln_bias and the fp32 row
  statistics; with ``invertible=True`` the output y instead of z (the backward recomputes the
  normalized value as (y - ln_bias) / weight, so weight must have no zeros); and a tensor seed.

Both backends run through the same custom ops, so they save the same tensors and torch.compile
traces them through the fake implementations.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tachyon.backend import resolve
from tachyon.kernels.common import check_dtype, check_same_device, check_shape, lazy_module
from tachyon.kernels.dropout import reference
from tachyon.kernels.random import check_seed, join_seed, split_seed
from tachyon.kernels.registry import fused_op

MAX_TRITON_N = 65536  # rows of the fused LayerNorm kernel are one Triton block


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


_tri = lazy_module("tachyon.kernels.dropout.triton")  # imported on first use (it imports Triton)


# --- bias + dropout + residual ------------------------------------------------------------------

@fused_op("tachyon::bias_dropout_add_fwd", mutates_args=(), triton_op=True)
def _bda_fwd(x: Tensor, bias: Tensor | None, residual: Tensor | None, p: float, seed: int, seed_tensor: Tensor | None,
             backend: str) -> Tensor:
    """x, residual: [M, N] contiguous; p == 0 means no dropout. Returns out [M, N] in x's dtype."""
    impl = _tri().bias_dropout_add_fwd if backend == "triton" else reference.bias_dropout_add_forward
    return impl(x, bias, residual, p, join_seed(seed, seed_tensor))


@_bda_fwd.register_fake
def _(x, bias, residual, p, seed, seed_tensor, backend):
    return torch.empty_like(x)


@fused_op("tachyon::dropout_bwd", mutates_args=(), triton_op=True)
def _dropout_bwd(dout: Tensor, p: float, seed: int, seed_tensor: Tensor | None, want_dbias: bool,
                 dbias_dtype: torch.dtype, backend: str) -> tuple[Tensor, Tensor]:
    """dout: [M, N]. Returns (dx = where(keep, dout / (1 - p), 0), the row sum of dx (summed in fp32,
    stored in dbias_dtype) or an empty tensor)."""
    if backend == "triton":
        dx, db = _tri().dropout_bwd(dout, p, join_seed(seed, seed_tensor), want_dbias, dout.dtype, dbias_dtype)
    else:
        dx, db = reference.bias_dropout_backward(dout, p, join_seed(seed, seed_tensor), want_dbias, dout.dtype)
        db = db.to(dbias_dtype) if db is not None else None
    return dx, (db if db is not None else _empty(dout))


@_dropout_bwd.register_fake
def _(dout, p, seed, seed_tensor, want_dbias, dbias_dtype, backend):
    db = dout.new_empty(dout.shape[1], dtype=dbias_dtype) if want_dbias else _empty(dout)
    return torch.empty_like(dout), db


def _bda_setup(ctx, inputs, output) -> None:
    x, bias, residual, p, seed, seed_tensor, backend = inputs
    ctx.p, ctx.seed, ctx.backend = p, seed, backend
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.has_residual = residual is not None
    ctx.save_for_backward(seed_tensor)


def _bda_backward(ctx, dout):
    (seed_tensor,) = ctx.saved_tensors
    dout = dout.contiguous()
    want_dbias = ctx.bias_dtype is not None
    if ctx.p > 0:
        dx, dbias = _dropout_bwd(dout, ctx.p, ctx.seed, seed_tensor, want_dbias, ctx.bias_dtype or dout.dtype,
                                 ctx.backend)
    else:  # no dropout: out = x + bias + residual; one reduction, summed in fp32
        dx, dbias = dout, (dout.sum(0, dtype=torch.float32).to(ctx.bias_dtype) if want_dbias else None)
    if not want_dbias:
        dbias = None
    return dx, dbias, (dout if ctx.has_residual else None), None, None, None, None


_bda_fwd.register_autograd(_bda_backward, setup_context=_bda_setup)


# --- bias + dropout + residual + LayerNorm/RMSNorm ----------------------------------------------

@fused_op("tachyon::bias_dropout_add_norm_fwd", mutates_args=(), triton_op=True)
def _bdan_fwd(
    x: Tensor, bias: Tensor | None, residual: Tensor | None, weight: Tensor, ln_bias: Tensor | None,
    eps: float, p: float, seed: int, seed_tensor: Tensor | None, rms: bool, invertible: bool, store_z: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x, residual: [M, N] contiguous. Returns (y, z, mean, rstd); mean, rstd fp32 [M]. z is
    written only when ``store_z`` or the backward reads it (not invertible); the mean only where
    the backward reads it (neither RMSNorm nor invertible): otherwise empty tensors."""
    store_z, store_mean = store_z or not invertible, not (rms or invertible)
    s = join_seed(seed, seed_tensor)
    if backend == "triton":
        return _tri().bias_dropout_add_norm_fwd(x, bias, residual, weight, ln_bias, eps, p, s, rms, store_z, store_mean)
    y, z, mean, rstd = reference.bias_dropout_add_norm_forward(x, bias, residual, weight, ln_bias, eps, p, s, rms)
    return y, (z if store_z else _empty(x)), (mean if store_mean else _empty(rstd)), rstd


@_bdan_fwd.register_fake
def _(x, bias, residual, weight, ln_bias, eps, p, seed, seed_tensor, rms, invertible, store_z, backend):
    stats = x.new_empty(x.shape[0], dtype=torch.float32)
    z = torch.empty_like(x) if store_z or not invertible else _empty(x)
    return torch.empty_like(x), z, (_empty(stats) if rms or invertible else stats), torch.empty_like(stats)


@fused_op("tachyon::bias_dropout_add_norm_bwd", mutates_args=(), triton_op=True)
def _bdan_bwd(
    dy: Tensor, saved: Tensor, dz_out: Tensor | None, weight: Tensor, ln_bias: Tensor | None, mean: Tensor,
    rstd: Tensor, p: float, seed: int, seed_tensor: Tensor | None, rms: bool, from_output: bool, want_dbias: bool,
    dbias_dtype: torch.dtype, want_dres: bool, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (dx, dresidual or empty, dbias (summed in fp32, stored in dbias_dtype) or empty,
    dweight, dln_bias or empty).

    dresidual is only computed when ``want_dres`` and p > 0; otherwise it equals dx.
    """
    s = join_seed(seed, seed_tensor)
    if backend == "triton":
        dx, dres, db, dw, dlnb = _tri().bias_dropout_add_norm_bwd(
            dy, saved, dz_out, weight, ln_bias, mean, rstd, p, s, rms, from_output, want_dbias, want_dres, dbias_dtype)
    else:
        dx, dres, db, dw, dlnb = reference.bias_dropout_add_norm_backward(
            dy, saved, dz_out, weight, ln_bias, mean, rstd, p, s, rms, from_output, want_dbias, want_dres)
        db = db.to(dbias_dtype) if db is not None else None
    return (dx, dres if dres is not None else _empty(dy), db if db is not None else _empty(dy), dw,
            dlnb if dlnb is not None else _empty(weight))


@_bdan_bwd.register_fake
def _(dy, saved, dz_out, weight, ln_bias, mean, rstd, p, seed, seed_tensor, rms, from_output, want_dbias,
      dbias_dtype, want_dres, backend):
    dres = torch.empty_like(dy) if want_dres and p > 0 else _empty(dy)
    db = dy.new_empty(dy.shape[1], dtype=dbias_dtype) if want_dbias else _empty(dy)
    dlnb = torch.empty_like(ln_bias) if ln_bias is not None else _empty(weight)
    return torch.empty_like(dy), dres, db, torch.empty_like(weight), dlnb


def _bdan_setup(ctx, inputs, output) -> None:
    x, bias, residual, weight, ln_bias, _eps, p, seed, seed_tensor, rms, invertible, _store_z, backend = inputs
    y, z, mean, rstd = output
    ctx.set_materialize_grads(False)  # outputs without a gradient (z, mean, rstd) come as None, no zero fill
    ctx.p, ctx.seed, ctx.rms, ctx.invertible, ctx.backend = p, seed, rms, invertible, backend
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.has_residual, ctx.has_ln_bias = residual is not None, ln_bias is not None
    if invertible:
        ctx.save_for_backward(y, weight, ln_bias, None, rstd, seed_tensor)
    else:
        ctx.save_for_backward(z, weight, ln_bias, None if rms else mean, rstd, seed_tensor)


def _bdan_backward(ctx, dy, dz_out, _dmean, _drstd):
    saved, weight, ln_bias, mean, rstd, seed_tensor = ctx.saved_tensors
    if mean is None:
        mean = rstd  # not read (RMSNorm, or the invertible form)
    if dy is None:  # only the returned sum z took part in the loss
        dy = torch.zeros_like(saved)
    use_dz = dz_out is not None and dz_out.numel() > 0
    want_dbias = ctx.bias_dtype is not None
    dx, dres, db, dw, dlnb = _bdan_bwd(
        dy.contiguous(), saved, dz_out.contiguous() if use_dz else None, weight, ln_bias, mean, rstd, ctx.p,
        ctx.seed, seed_tensor, ctx.rms, ctx.invertible, want_dbias, ctx.bias_dtype or dy.dtype, ctx.has_residual,
        ctx.backend,
    )
    dresidual = None
    if ctx.has_residual:
        dresidual = dres if ctx.p > 0 else dx
    dbias = db if want_dbias else None
    return (dx, dbias, dresidual, dw, (dlnb if ctx.has_ln_bias else None)) + (None,) * 8


_bdan_fwd.register_autograd(_bdan_backward, setup_context=_bdan_setup)


# --- public API ----------------------------------------------------------------------------------

def _check_common(
    op: str, x: Tensor, bias: Tensor | None, residual: Tensor | None, p: float, seed: int | Tensor | None,
    training: bool,
) -> tuple[float, int, Tensor | None]:
    """Validates the shared arguments; returns (effective p, int seed, tensor seed or None) as
    the custom ops take them."""
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise ValueError(f"{op}: x must be a tensor with at least one dimension; got {type(x).__name__}")
    n = x.shape[-1]
    check_dtype(op, "x", x)
    if bias is not None:
        check_dtype(op, "bias", bias)
        check_shape(op, "bias", bias, (n,))
    if residual is not None:
        check_shape(op, "residual", residual, tuple(x.shape))
        if residual.dtype != x.dtype:
            raise ValueError(f"{op}: residual has dtype {residual.dtype} but x has {x.dtype}; they must match")
    if not isinstance(training, bool):
        raise ValueError(f"{op}: training must be True or False; got {training!r}")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise ValueError(f"{op}: p is the dropout probability and must be a number in [0, 1]; got {p!r}")
    p = float(p) if training else 0.0
    if p == 0.0:
        return 0.0, 0, None
    seed = check_seed(op, seed, x.device, f" when dropout is active (p={p}, training=True)")
    return (p, *split_seed(seed))


def bias_dropout_add(
    x: Tensor, bias: Tensor | None, residual: Tensor | None, p: float, seed: int | Tensor | None, *,
    training: bool = True, backend: str | None = None,
) -> Tensor:
    """out = residual + dropout(x + bias), computed in fp32 and returned in x's dtype.

    x: [..., N]; bias: [N] or None; residual: x's shape and dtype, or None (then out is
    dropout(x + bias)). Element (row, col) of x viewed as [M, N] is kept by tachyon.kernels.random's
    mask (tachyon.kernels.random.dropout_keep_mask(seed, x.shape, p)) and scaled by 1 / (1 - p). seed: an int in [0, 2**63) or a 0-dim int64 tensor on x's device holding one
    (same value, same mask). p == 0 or training=False: no dropout, seed may be None. Saves
    nothing of x's size for backward (a tensor seed, 8 bytes); dbias comes back in bias's dtype.
    Dtypes: float32, float16, bfloat16.
    """
    op = "bias_dropout_add"
    p, seed, seed_tensor = _check_common(op, x, bias, residual, p, seed, training)
    check_same_device(op, x=x, bias=bias, residual=residual)
    chosen = resolve(x, backend)
    n = x.shape[-1]
    r2 = residual.reshape(-1, n).contiguous() if residual is not None else None
    out = _bda_fwd(x.reshape(-1, n).contiguous(), bias, r2, p, seed, seed_tensor, chosen)
    return out.view(*x.shape)


def bias_dropout_add_layer_norm(
    x: Tensor, bias: Tensor | None, residual: Tensor | None, weight: Tensor, ln_bias: Tensor | None, eps: float,
    p: float, seed: int | Tensor | None, *, training: bool = True, invertible: bool = False, rms: bool = False,
    return_residual: bool = True, backend: str | None = None,
) -> tuple[Tensor, Tensor] | Tensor:
    """(y, z): z = residual + dropout(x + bias), y = LayerNorm(z) * weight + ln_bias (RMSNorm if ``rms``).

    ``return_residual=False`` returns y alone, for a caller that does not add z to anything (a
    post-LN layer): with ``invertible`` z is then never written (the backward reads y).

    x, residual: [..., N] (residual may be None); bias, weight, ln_bias: [N] (bias, ln_bias may be
    None). Dropout as in :func:`bias_dropout_add`. z and y are in x's dtype; statistics in fp32,
    from z as stored. One Triton kernel forward (one row per program) and one fused backward giving
    dx, dbias, dresidual, dweight, dln_bias. Saved for backward: z, or y with ``invertible=True``
    (weight must then have no zeros), plus weight, ln_bias, the fp32 row statistics and a tensor seed.
    """
    op = "bias_dropout_add_layer_norm"
    p, seed, seed_tensor = _check_common(op, x, bias, residual, p, seed, training)
    n = x.shape[-1]
    check_dtype(op, "weight", weight)
    check_shape(op, "weight", weight, (n,))
    if ln_bias is not None:
        check_dtype(op, "ln_bias", ln_bias)
        check_shape(op, "ln_bias", ln_bias, (n,))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{op}: eps must be a number >= 0; got {eps!r}")
    check_same_device(op, x=x, bias=bias, residual=residual, weight=weight, ln_bias=ln_bias)
    chosen = resolve(x, backend)
    if chosen == "triton" and n > MAX_TRITON_N:
        raise ValueError(f"{op}: the Triton kernel handles rows of up to {MAX_TRITON_N} elements; got {n} (use backend='torch')")
    r2 = residual.reshape(-1, n).contiguous() if residual is not None else None
    if not isinstance(return_residual, bool):
        raise ValueError(f"{op}: return_residual must be True or False; got {return_residual!r}")
    y, z, _, _ = _bdan_fwd(
        x.reshape(-1, n).contiguous(), bias, r2, weight, ln_bias, float(eps), p, seed, seed_tensor, bool(rms),
        bool(invertible), return_residual, chosen,
    )
    return (y.view(*x.shape), z.view(*x.shape)) if return_residual else y.view(*x.shape)


__all__ = ["bias_dropout_add", "bias_dropout_add_layer_norm"]

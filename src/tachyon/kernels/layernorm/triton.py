"""Triton kernels for the fused norms (no autograd here; see op.py).

Forward, one program per row of z = x (+ residual):
    mean, rstd in fp32; y = (z - mean) * rstd * w (+ b); stores y, z (when a residual is added),
    mean and rstd.
Backward, each program walks a contiguous block of rows, with xhat = (z - mean) * rstd, or,
for the invertible form, xhat = (y - b) / w recomputed from the output (so the input z need not
be kept for backward):
    g   = dy * w
    dz  = rstd * (g - xhat * mean(g * xhat) - mean(g))       (LayerNorm)
    dz  = rstd * (g - xhat * mean(g * xhat))                 (RMSNorm)
    dz += dz_out                                             (gradient of the returned z, if any)
and accumulates per-program partial sums of dy * xhat (dgamma) and dy (dbeta) in fp32, which the
launcher sums over programs in one more launch (kernels/tiling.py ``sum_partials``). dx and dresidual are both dz.

The row math (:func:`row_stats`, :func:`row_grad`) is shared with the fused
bias + dropout + residual + norm kernels of kernels/dropout.

Traced by torch.compile, a pointer the kernel does not touch (no residual, no bias, ...) is a
tensor of its own instead of another argument (kernels/launch.py: a traced launch passes no
aliasing arguments), and the backward's partial sums of dweight and dbias go to two buffers summed with torch (a
reduction the compiler handles) instead of one buffer summed by ``tiling.sum_partials``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tachyon.kernels import launch, tiling
from tachyon.kernels.tiling import partials, sum_partials
from tachyon.kernels.ints import cdiv, next_power_of_2
from tachyon.kernels.launch import fast_launch


@triton.jit
def row_stats(z, mask, N, eps, IS_RMS: tl.constexpr):
    """(mean, rstd, centered) of one row z: fp32 [BLOCK_N], 0 where not ``mask`` (cols >= N).
    mean is 0 for RMSNorm; centered = z - mean, 0 past N."""
    if IS_RMS:
        mean = 0.0
        centered = z
    else:
        mean = tl.sum(z, axis=0) / N
        centered = tl.where(mask, z - mean, 0.0)
    var = tl.sum(centered * centered, axis=0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    return mean, rstd, centered


@triton.jit
def row_grad(dy, saved, w, b, MEAN, row, rstd, mask, N,
             IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, FROM_OUTPUT: tl.constexpr):
    """(dz, xhat) of one row, fp32 [BLOCK_N], without the gradient of the returned z.

    saved is z, or y when FROM_OUTPUT (then xhat = (y - b) / w); w, b: the loaded affine
    parameters (b read only when HAS_BIAS); MEAN + row is read only for LayerNorm from z."""
    if FROM_OUTPUT:
        if HAS_BIAS:
            saved = saved - b
        xhat = tl.where(mask, saved / tl.where(mask, w, 1.0), 0.0)
    elif IS_RMS:
        xhat = saved * rstd
    else:
        mean = tl.load(MEAN + row)
        xhat = tl.where(mask, (saved - mean) * rstd, 0.0)
    g = dy * w
    c1 = tl.sum(xhat * g, axis=0) / N
    if IS_RMS:
        dz = (g - xhat * c1) * rstd
    else:
        c2 = tl.sum(g, axis=0) / N
        dz = (g - xhat * c1 - c2) * rstd
    return dz, xhat


@fast_launch
@triton.jit
def _norm_fwd_kernel(
    X, R, W, B, Y, Z, MEAN, RSTD,
    stride_x, stride_r, stride_y, stride_z,
    N, eps,
    IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_Z: tl.constexpr,
    STORE_MEAN: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    z = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        z += tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    if STORE_Z:
        # round to the storage dtype so y is computed from exactly the z the caller gets back
        z = z.to(Z.dtype.element_ty)
        tl.store(Z + row * stride_z + cols, z, mask=mask)
        z = z.to(tl.float32)
    mean, rstd, centered = row_stats(z, mask, N, eps, IS_RMS)
    if STORE_MEAN:
        tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = centered * rstd * w
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _norm_bwd_kernel(
    DY, SAVED, DZ_OUT, W, B, MEAN, RSTD, DX, DW_PART, DB_PART,
    stride_dy, stride_saved, stride_dzo, stride_dx, stride_part,
    M, N, rows_per_program,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DZ_OUT: tl.constexpr,
    FROM_OUTPUT: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    b = w  # placeholder, read only when HAS_BIAS
    if HAS_BIAS:
        b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for row32 in range(row_start, row_end):
        row = tl.cast(row32, tl.int64)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        saved = tl.load(SAVED + row * stride_saved + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        dz, xhat = row_grad(dy, saved, w, b, MEAN, row, rstd, mask, N, IS_RMS, HAS_BIAS, FROM_OUTPUT)
        if HAS_DZ_OUT:
            dz += tl.load(DZ_OUT + row * stride_dzo + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, dz.to(DX.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy
    tl.store(DW_PART + pid * stride_part + cols, dw_acc, mask=mask)
    if HAS_BIAS:
        tl.store(DB_PART + pid * stride_part + cols, db_acc, mask=mask)


@functools.lru_cache(maxsize=256)  # launch host time: a C-level cache hit instead of the arithmetic
def row_config(n: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of a kernel whose program holds one whole row of n elements."""
    block_n = next_power_of_2(n)
    num_warps = min(max(block_n // 256, 1), 16)
    return block_n, num_warps


def norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    is_rms: bool,
    store_mean: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """x, residual: [M, N] with unit stride in the last dim. Returns (y, z or None, mean, rstd);
    mean is an empty tensor unless ``store_mean`` (a backward from rstd alone, RMSNorm or the
    invertible form, does not read it)."""
    m, n = x.shape
    y = torch.empty_like(x)
    z = torch.empty_like(x) if residual is not None else None
    mean = torch.empty(m if store_mean else 0, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    block_n, num_warps = row_config(n)
    # an unused pointer: another argument eagerly (no allocation), a tensor of its own when traced
    # (module docstring)
    x_, w_, y_, r_ = (t.new_empty(0) for t in (x, weight, y, rstd)) if launch._wrapping else (x, weight, y, rstd)
    _norm_fwd_kernel[(m,)](
        x, residual if residual is not None else x_, weight, bias if bias is not None else w_,
        y, z if z is not None else y_, mean if store_mean else r_, rstd,
        x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
        z.stride(0) if z is not None else 0,
        n, eps,
        IS_RMS=is_rms, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        STORE_Z=residual is not None, STORE_MEAN=store_mean, BLOCK_N=block_n, num_warps=num_warps,
    )
    return y, z, mean, rstd


def norm_bwd(
    dy: torch.Tensor,
    saved: torch.Tensor,
    dz_out: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    is_rms: bool,
    from_output: bool,
    dx_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dy, saved (z, or y when from_output), dz_out: [M, N]. Returns (dz, dweight, dbias)."""
    m, n = dy.shape
    dx = torch.empty((m, n), dtype=dx_dtype, device=dy.device)
    programs = tiling.row_programs(m, dy.device, 8)  # interpreter: 8 (each program costs milliseconds)
    rows_per_program = cdiv(m, programs)
    programs = cdiv(m, rows_per_program)
    block_n, num_warps = row_config(n)
    if launch._wrapping:  # traced (module docstring)
        return _norm_bwd_traced(dy, saved, dz_out, weight, bias, mean, rstd, is_rms, from_output, dx, programs,
                                rows_per_program, block_n, num_warps)
    # partial sums of dweight (and dbias): group 0 (and 1) of one buffer, summed in one launch
    part = partials(programs, 1 if bias is None else 2, n, dy.device)
    _norm_bwd_kernel[(programs,)](
        dy, saved, dz_out if dz_out is not None else dy, weight, bias if bias is not None else weight,
        mean, rstd, dx, part, part[:, n:] if bias is not None else part,
        dy.stride(0), saved.stride(0), dz_out.stride(0) if dz_out is not None else 0, dx.stride(0), part.stride(0),
        m, n, rows_per_program,
        IS_RMS=is_rms, HAS_BIAS=bias is not None, HAS_DZ_OUT=dz_out is not None,
        FROM_OUTPUT=from_output, BLOCK_N=block_n, num_warps=num_warps,
    )
    if bias is None:
        (dw,) = sum_partials(part, [weight.dtype])
        return dx, dw, None
    dw, db = sum_partials(part, [weight.dtype, bias.dtype])
    return dx, dw, db


def _norm_bwd_traced(dy, saved, dz_out, weight, bias, mean, rstd, is_rms, from_output, dx, programs,
                     rows_per_program, block_n, num_warps):
    """norm_bwd's launch as torch.compile traces it: no aliasing arguments, partial sums in two
    buffers reduced by torch (in fp32, then cast, as ``sum_partials`` does)."""
    m, n = dy.shape
    dw_part = torch.empty((programs, n), dtype=torch.float32, device=dy.device)
    db_part = torch.empty((programs, n) if bias is not None else (0,), dtype=torch.float32, device=dy.device)
    _norm_bwd_kernel[(programs,)](
        dy, saved, dz_out if dz_out is not None else dy.new_empty(0), weight,
        bias if bias is not None else weight.new_empty(0), mean if mean is not rstd else rstd.new_empty(0), rstd, dx,
        dw_part, db_part,
        dy.stride(0), saved.stride(0), dz_out.stride(0) if dz_out is not None else 0, dx.stride(0), dw_part.stride(0),
        m, n, rows_per_program,
        IS_RMS=is_rms, HAS_BIAS=bias is not None, HAS_DZ_OUT=dz_out is not None,
        FROM_OUTPUT=from_output, BLOCK_N=block_n, num_warps=num_warps,
    )
    dw = dw_part.sum(0).to(weight.dtype)
    return dx, dw, (db_part.sum(0).to(bias.dtype) if bias is not None else None)

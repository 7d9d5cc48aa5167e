"""Triton kernels for bias + dropout + residual (+ LayerNorm/RMSNorm) (no autograd here; see op.py).

The dropout mask is tachyon.kernels.random's over the rows of the [M, N] input (16-bit draws, eight
per Philox call: ``keep_tile`` / ``keep_row``, against the integer threshold ``drop_t``), so it is
regenerated in backward instead of stored, and tachyon.kernels.random.dropout_keep_rows (the PyTorch
Philox) gives the torch path the same mask bit for bit. The seed is a scalar
argument (an int) or loaded from a 0-dim int64 tensor (SEED_FROM_PTR); same value, same mask.

bias_dropout_add: 2-D tiles, out = residual + where(keep, (x + b) * scale, 0) in fp32, stored in
x's dtype. Backward: each program owns a column block and walks a range of rows, writing
dx = where(keep, dout * scale, 0) and summing dx over its rows for the bias gradient (fp32
partials per program, summed in one more launch by kernels/tiling.py ``sum_partials``). dresidual is dout itself (no kernel).

bias_dropout_add_layer_norm, one row per program: z = residual + dropout(x + b), stored, then
rounded to its storage dtype so y is normalized from exactly the z the caller gets; then
mean/rstd (fp32, stored) and y = (z - mean) * rstd * w (+ ln_b). The backward is one fused pass
per row (instead of kernels/layernorm's norm_bwd followed by a dropout kernel, which would write
dz and read it again: one [M, N] round trip more): with xhat from z, or from y for the invertible
form ((y - ln_b) / w),

    g = dy * w;  dz = rstd * (g - xhat * mean(g * xhat) - mean(g))   (no mean(g) term for RMSNorm)
    dz += dz_out;  dresidual = dz;  dx = where(keep, dz * scale, 0)

accumulating dweight (dy * xhat), dln_bias (dy) and dbias (dx) partials per program, all three
summed by one more launch (``sum_partials``). The norm's
row math (statistics; xhat and dz) is kernels/layernorm's ``row_stats`` / ``row_grad``.

Traced by torch.compile, a pointer the kernel does not touch (no bias, no residual, the seed
pointer of an int seed, ...) is a tensor of its own instead of another argument, and the fused
norm backward's partial sums go to one buffer per sum instead of column groups (views) of one
buffer (kernels/launch.py: a traced launch passes no aliasing arguments).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tachyon.kernels.dropout.reference import dropout_scale
from tachyon.kernels.layernorm.triton import row_config, row_grad, row_stats
from tachyon.kernels.random.reference import dropout_threshold
from tachyon.kernels.random.triton import keep_row, keep_tile, load_seed, seed_args
from tachyon.kernels.tiling import max_programs, partials, row_programs, row_split, sum_partials, tiles
from tachyon.kernels.ints import cdiv
from tachyon.kernels import launch
from tachyon.kernels.launch import fast_launch


@fast_launch
@triton.jit
def _bda_fwd_kernel(
    X, B, R, OUT, M, N, stride_x, stride_r, stride_o, seed, SEED_PTR, drop_t, scale,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, DROPOUT: tl.constexpr, SEED_FROM_PTR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seed = load_seed(seed, SEED_PTR, SEED_FROM_PTR)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    mask = (rows[:, None] < M) & col_ok[None, :]
    h = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        h += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if DROPOUT:
        keep = keep_tile(seed, rows * ((N + 7) // 8), tl.program_id(1) * BLOCK_N, drop_t, BLOCK_M, BLOCK_N)
        h = tl.where(keep, h * scale, 0.0)
    if HAS_RES:
        h += tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + rows[:, None] * stride_o + cols[None, :], h.to(OUT.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _bda_bwd_kernel(
    DOUT, DX, DB_PART, M, N, stride_d, stride_dx, rows_per_program, seed, SEED_PTR, drop_t, scale,
    HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, SEED_FROM_PTR: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seed = load_seed(seed, SEED_PTR, SEED_FROM_PTR)
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid_m * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for r in range(row_start, row_end, BLOCK_M):
        rows = (r + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows[:, None] < row_end) & col_ok[None, :]
        g = tl.load(DOUT + rows[:, None] * stride_d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if DROPOUT:
            keep = keep_tile(seed, rows * ((N + 7) // 8), tl.program_id(1) * BLOCK_N, drop_t, BLOCK_M, BLOCK_N)
            g = tl.where(keep, g * scale, 0.0)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], g.to(DX.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            db += tl.sum(g, axis=0)
    if HAS_BIAS:
        tl.store(DB_PART + pid_m * N + cols, db, mask=col_ok)


@fast_launch
@triton.jit
def _bda_norm_fwd_kernel(
    X, B, R, W, LNB, Y, Z, MEAN, RSTD, N, stride_x, stride_r, stride_y, stride_z, eps, seed, SEED_PTR, drop_t, scale,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_LNB: tl.constexpr, DROPOUT: tl.constexpr,
    SEED_FROM_PTR: tl.constexpr, IS_RMS: tl.constexpr, STORE_Z: tl.constexpr, STORE_MEAN: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seed = load_seed(seed, SEED_PTR, SEED_FROM_PTR)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    h = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        h += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    if DROPOUT:
        keep = keep_row(seed, row * ((N + 7) // 8), drop_t, BLOCK_N)
        h = tl.where(keep, h * scale, 0.0)
    if HAS_RES:
        h += tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    z = h.to(Z.dtype.element_ty)  # rounded to its storage dtype whether stored or not
    if STORE_Z:
        tl.store(Z + row * stride_z + cols, z, mask=mask)
    z = z.to(tl.float32)  # 0 past N, like every term summed into it
    mean, rstd, centered = row_stats(z, mask, N, eps, IS_RMS)
    if STORE_MEAN:
        tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)
    y = centered * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_LNB:
        y += tl.load(LNB + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _bda_norm_bwd_kernel(
    DY, SAVED, DZ_OUT, W, LNB, MEAN, RSTD, DX, DRES, DW_PART, DLNB_PART, DB_PART,
    M, N, stride_dy, stride_s, stride_dzo, stride_dx, stride_dr, stride_part, rows_per_program, seed, SEED_PTR, drop_t, scale,
    HAS_LNB: tl.constexpr, HAS_DZ_OUT: tl.constexpr, STORE_DRES: tl.constexpr, HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr, SEED_FROM_PTR: tl.constexpr, IS_RMS: tl.constexpr, FROM_OUTPUT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seed = load_seed(seed, SEED_PTR, SEED_FROM_PTR)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    lnb = w  # placeholder, read only when HAS_LNB
    if HAS_LNB:
        lnb = tl.load(LNB + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    dlnb = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for row32 in range(row_start, row_end):
        row = tl.cast(row32, tl.int64)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        saved = tl.load(SAVED + row * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        dz, xhat = row_grad(dy, saved, w, lnb, MEAN, row, rstd, mask, N, IS_RMS, HAS_LNB, FROM_OUTPUT)
        if HAS_DZ_OUT:
            dz += tl.load(DZ_OUT + row * stride_dzo + cols, mask=mask, other=0.0).to(tl.float32)
        if STORE_DRES:
            tl.store(DRES + row * stride_dr + cols, dz.to(DRES.dtype.element_ty), mask=mask)
        dx = dz
        if DROPOUT:
            keep = keep_row(seed, row * ((N + 7) // 8), drop_t, BLOCK_N)
            dx = tl.where(keep, dz * scale, 0.0)
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        if HAS_LNB:
            dlnb += dy
        if HAS_BIAS:
            db += tl.where(mask, dx, 0.0)
    tl.store(DW_PART + pid * stride_part + cols, dw, mask=mask)
    if HAS_LNB:
        tl.store(DLNB_PART + pid * stride_part + cols, dlnb, mask=mask)
    if HAS_BIAS:
        tl.store(DB_PART + pid * stride_part + cols, db, mask=mask)


def bias_dropout_add_fwd(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None, p: float, seed: int | torch.Tensor,
) -> torch.Tensor:
    """x, residual: [M, N] with unit last stride; p == 0 means no dropout; seed: an int or a 0-dim
    int64 tensor on x's device. Returns out in x's dtype."""
    m, n = x.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_m, block_n, num_warps = tiles(n)
    block_n = max(block_n, 8)  # the dropout mask takes column tiles of whole 8-column groups
    seed_int, seed_ptr, seed_from_ptr = seed_args(seed, out)
    ub = ur = x  # the unused pointers' stand-in
    if launch._wrapping:  # traced: a tensor of its own each (module docstring)
        ub, ur = x.new_empty(0), x.new_empty(0)
        seed_ptr = seed_ptr if seed_from_ptr else x.new_empty(0)
    _bda_fwd_kernel[(cdiv(m, block_m), cdiv(n, block_n))](
        x, bias if bias is not None else ub, residual if residual is not None else ur, out,
        m, n, x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), seed_int, seed_ptr,
        dropout_threshold(p), dropout_scale(p), HAS_BIAS=bias is not None, HAS_RES=residual is not None, DROPOUT=p > 0,
        SEED_FROM_PTR=seed_from_ptr, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return out


def dropout_bwd(
    dout: torch.Tensor, p: float, seed: int | torch.Tensor, want_dbias: bool, dx_dtype: torch.dtype,
    dbias_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dout: [M, N]. Returns (dx = where(keep, dout * scale, 0) in dx_dtype, the column sums of dx
    (fp32 sums stored in dbias_dtype) or None)."""
    m, n = dout.shape
    dx = torch.empty((m, n), dtype=dx_dtype, device=dout.device)
    if dx.numel() == 0:
        return dx, (torch.zeros(n, dtype=dbias_dtype, device=dout.device) if want_dbias else None)
    block_m, block_n, num_warps = tiles(n)
    block_n = max(block_n, 8)  # the dropout mask takes column tiles of whole 8-column groups
    col_blocks = cdiv(n, block_n)
    programs, rows_per_program = row_split(m, block_m, col_blocks, dout.device)
    db_part = partials(programs, 1, n, dout.device) if want_dbias else None
    seed_int, seed_ptr, seed_from_ptr = seed_args(seed, dx)
    up = dx  # the unused pointers' stand-in
    if launch._wrapping:  # traced: a tensor of its own each (module docstring)
        up = dx.new_empty(0, dtype=torch.float32)
        seed_ptr = seed_ptr if seed_from_ptr else dx.new_empty(0)
    _bda_bwd_kernel[(programs, col_blocks)](
        dout, dx, db_part if db_part is not None else up, m, n, dout.stride(0), dx.stride(0), rows_per_program,
        seed_int, seed_ptr, dropout_threshold(p), dropout_scale(p), HAS_BIAS=want_dbias, DROPOUT=p > 0,
        SEED_FROM_PTR=seed_from_ptr, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return dx, (sum_partials(db_part, [dbias_dtype])[0] if db_part is not None else None)


def bias_dropout_add_norm_fwd(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None, weight: torch.Tensor,
    ln_bias: torch.Tensor | None, eps: float, p: float, seed: int | torch.Tensor, rms: bool,
    store_z: bool = True, store_mean: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual: [M, N] with unit last stride. Returns (y, z, mean, rstd); stats fp32 [M]. z
    and mean are empty tensors, never written, unless ``store_z`` / ``store_mean``."""
    m, n = x.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    z = torch.empty((m if store_z else 0, n), dtype=x.dtype, device=x.device)
    mean = torch.empty(m if store_mean else 0, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0:
        return y, z, mean, rstd
    block_n, num_warps = row_config(n)
    block_n = max(block_n, 8)  # the dropout mask takes whole 8-column groups
    seed_int, seed_ptr, seed_from_ptr = seed_args(seed, rstd)
    ub, ur, ul, uz, um = x, x, weight, y, rstd  # the unused pointers' stand-ins
    if launch._wrapping:  # traced: a tensor of its own each (module docstring)
        ub, ur, ul, uz, um = (t.new_empty(0) for t in (x, x, weight, y, rstd))
        seed_ptr = seed_ptr if seed_from_ptr else rstd.new_empty(0)
    _bda_norm_fwd_kernel[(m,)](
        x, bias if bias is not None else ub, residual if residual is not None else ur, weight,
        ln_bias if ln_bias is not None else ul, y, z if store_z else uz, mean if store_mean else um, rstd,
        n, x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0), z.stride(0),
        eps, seed_int, seed_ptr, dropout_threshold(p), dropout_scale(p),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, HAS_LNB=ln_bias is not None, DROPOUT=p > 0,
        SEED_FROM_PTR=seed_from_ptr, IS_RMS=rms, STORE_Z=store_z, STORE_MEAN=store_mean, BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return y, z, mean, rstd


def bias_dropout_add_norm_bwd(
    dy: torch.Tensor, saved: torch.Tensor, dz_out: torch.Tensor | None, weight: torch.Tensor,
    ln_bias: torch.Tensor | None, mean: torch.Tensor, rstd: torch.Tensor, p: float, seed: int | torch.Tensor,
    rms: bool, from_output: bool, want_dbias: bool, want_dres: bool, dbias_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """dy, saved (z, or y when from_output), dz_out: [M, N].

    Returns (dx, dresidual or None, dbias (fp32 sums stored in dbias_dtype) or None, dweight,
    dln_bias or None). dresidual is
    written only when ``want_dres`` and there is dropout (without dropout it equals dx).
    """
    m, n = dy.shape
    dx = torch.empty((m, n), dtype=dy.dtype, device=dy.device)
    store_dres = want_dres and p > 0
    dres = torch.empty_like(dx) if store_dres else None
    if m == 0:
        zeros = lambda t: torch.zeros(n, dtype=t.dtype, device=dy.device)  # noqa: E731
        return (dx, dres, torch.zeros(n, dtype=dbias_dtype, device=dy.device) if want_dbias else None,
                zeros(weight), zeros(ln_bias) if ln_bias is not None else None)
    programs = row_programs(m, dy.device, max_programs(dy.device) // 2)
    rows_per_program = cdiv(m, programs)
    programs = cdiv(m, rows_per_program)
    groups = [weight.dtype] + ([ln_bias.dtype] if ln_bias is not None else []) + ([dbias_dtype] if want_dbias else [])
    if launch._wrapping:  # traced: a partial-sum buffer per sum, each unused pointer a tensor of its own (module docstring)
        part = None
        dw_part, dlnb_part, db_part = (partials(programs, 1, n, dy.device) if wanted else dy.new_empty(0, dtype=torch.float32)
                                       for wanted in (True, ln_bias is not None, want_dbias))
        udz, ulnb, ures, useed = dy.new_empty(0), weight.new_empty(0), dx.new_empty(0), rstd.new_empty(0)
        if rms or from_output:  # the caller's mean may be rstd itself
            mean = rstd.new_empty(0)
    else:  # the partial sums of dweight, dln_bias, dbias (those wanted): groups of one buffer, one launch to sum
        part = partials(programs, len(groups), n, dy.device)
        dw_part = part[:, :n]
        dlnb_part = part[:, n:2 * n] if ln_bias is not None else dw_part
        db_part = part[:, (len(groups) - 1) * n:] if want_dbias else dw_part
        udz, ulnb, ures, useed = dy, weight, dx, rstd  # the unused pointers' stand-ins
    block_n, num_warps = row_config(n)
    block_n = max(block_n, 8)  # the dropout mask takes whole 8-column groups
    seed_int, seed_ptr, seed_from_ptr = seed_args(seed, useed)
    _bda_norm_bwd_kernel[(programs,)](
        dy, saved, dz_out if dz_out is not None else udz, weight, ln_bias if ln_bias is not None else ulnb,
        mean, rstd, dx, dres if dres is not None else ures, dw_part, dlnb_part, db_part,
        m, n, dy.stride(0), saved.stride(0), dz_out.stride(0) if dz_out is not None else 0, dx.stride(0),
        dres.stride(0) if dres is not None else 0, dw_part.stride(0), rows_per_program, seed_int, seed_ptr,
        dropout_threshold(p), dropout_scale(p),
        HAS_LNB=ln_bias is not None, HAS_DZ_OUT=dz_out is not None, STORE_DRES=store_dres, HAS_BIAS=want_dbias,
        DROPOUT=p > 0, SEED_FROM_PTR=seed_from_ptr, IS_RMS=rms, FROM_OUTPUT=from_output, BLOCK_N=block_n, num_warps=num_warps,
    )
    if part is None:  # traced: one reduction per sum wanted, in the groups' order
        wanted = [t for t, w in zip((dw_part, dlnb_part, db_part), (True, ln_bias is not None, want_dbias)) if w]
        sums = [sum_partials(t, [dt])[0] for t, dt in zip(wanted, groups)]
    else:
        sums = sum_partials(part, groups)
    dw = sums[0]
    dlnb = sums[1] if ln_bias is not None else None
    return dx, dres, (sums[-1] if want_dbias else None), dw, dlnb

"""Triton kernels for the fused bias + activation (no autograd here; see op.py).

Forward: 2-D tiles [BLOCK_M rows, BLOCK_N output columns] of y = act(x + b), or for the gated
forms y = act(a + b_a) * (g + b_g) with a = x[:, :F] and g = x[:, F:]. Everything in fp32, y
stored in x's dtype. Nothing but y is written: the pre-activation x + b is never materialized.

Backward: each program owns a column block and walks a contiguous range of rows, recomputing
act'(h) from x and the bias (y is never read), writing dx = dy * act'(h) (gated: d_a = dy * g *
act'(a), d_g = dy * act(a)) and accumulating the column sums of dx in fp32 into a per-program row
of partial bias gradients that the launcher sums. The activations' closed forms are in reference.py.

Traced by torch.compile, a pointer the kernel does not touch (no bias) is a tensor of its own
instead of another argument (kernels/launch.py: a traced launch passes no aliasing arguments).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tachyon.kernels.activation.reference import GATED
from tachyon.kernels.tiling import partials, row_split, sum_partials, tiles
from tachyon.kernels.ints import cdiv
from tachyon.kernels import launch
from tachyon.kernels.launch import fast_launch

# activation name -> the constexpr code the kernels switch on (gated names use their gate's code)
_CODES = {"gelu": 0, "gelu_tanh": 1, "relu": 2, "silu": 3, "qgelu": 4}


def _code(activation: str) -> int:
    return _CODES[GATED.get(activation, activation)]


@triton.jit
def _sigmoid(h):
    return 1.0 / (1.0 + tl.exp(-h))


@triton.jit
def _one_plus_tanh(u):
    """(1 + tanh(u), 1 - tanh(u)^2) from e = exp(-2|u|) <= 1: no overflow, and no cancellation
    where tanh(u) is near -1 or +1 (no libdevice tanh under the interpreter)."""
    e = tl.exp(-2.0 * tl.abs(u))
    one_plus_t = tl.where(u >= 0.0, 2.0, 2.0 * e) / (1.0 + e)
    return one_plus_t, 4.0 * e / ((1.0 + e) * (1.0 + e))


@triton.jit
def _act_fwd(h, ACT: tl.constexpr):
    if ACT == 0:  # gelu (erf)
        y = 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))
    elif ACT == 1:  # gelu (tanh)
        one_plus_t, _ = _one_plus_tanh(0.7978845608028654 * (h + 0.044715 * h * h * h))
        y = 0.5 * h * one_plus_t
    elif ACT == 2:  # relu
        y = tl.maximum(h, 0.0)
    elif ACT == 3:  # silu
        y = h * _sigmoid(h)
    else:  # quick gelu
        y = h * _sigmoid(1.702 * h)
    return y


@triton.jit
def _act_fwd_grad(h, ACT: tl.constexpr):
    """(act(h), act'(h))."""
    if ACT == 0:
        cdf = 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))
        y = h * cdf
        d = cdf + h * tl.exp(-0.5 * h * h) * 0.3989422804014327
    elif ACT == 1:
        one_plus_t, one_minus_t2 = _one_plus_tanh(0.7978845608028654 * (h + 0.044715 * h * h * h))
        y = 0.5 * h * one_plus_t
        d = 0.5 * one_plus_t + 0.5 * h * one_minus_t2 * 0.7978845608028654 * (1.0 + 0.134145 * h * h)
    elif ACT == 2:
        y = tl.maximum(h, 0.0)
        d = tl.where(h > 0.0, 1.0, 0.0)
    elif ACT == 3:
        s = _sigmoid(h)
        y = h * s
        d = s * (1.0 + h * (1.0 - s))
    else:
        s = _sigmoid(1.702 * h)
        y = h * s
        d = s * (1.0 + 1.702 * h * (1.0 - s))
    return y, d


@fast_launch
@triton.jit
def _bias_act_fwd_kernel(
    X, B, Y, M, F, stride_x, stride_y,
    ACT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < F
    mask = (rows[:, None] < M) & col_ok[None, :]
    x_ptrs = X + rows.to(tl.int64)[:, None] * stride_x + cols[None, :]
    a = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = _act_fwd(a, ACT)
    if GATED:
        g = tl.load(x_ptrs + F, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            g += tl.load(B + F + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        y = y * g
    y_ptrs = Y + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
    tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _bias_act_bwd_kernel(
    DY, X, B, DX, DB_PART, M, F, K, stride_dy, stride_x, stride_dx, rows_per_program,
    ACT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < F
    if HAS_BIAS:
        b_a = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            b_g = tl.load(B + F + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    db_a = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid_m * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for r in range(row_start, row_end, BLOCK_M):
        rows = (r + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows[:, None] < row_end) & col_ok[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x_ptrs = X + rows[:, None] * stride_x + cols[None, :]
        dx_ptrs = DX + rows[:, None] * stride_dx + cols[None, :]
        a = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            a += b_a
        act_a, dact_a = _act_fwd_grad(a, ACT)
        if GATED:
            g = tl.load(x_ptrs + F, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                g += b_g
            da = tl.where(mask, dy * g * dact_a, 0.0)
            dg = tl.where(mask, dy * act_a, 0.0)
            tl.store(dx_ptrs + F, dg.to(DX.dtype.element_ty), mask=mask)
            db_g += tl.sum(dg, axis=0)
        else:
            da = tl.where(mask, dy * dact_a, 0.0)
        tl.store(dx_ptrs, da.to(DX.dtype.element_ty), mask=mask)
        db_a += tl.sum(da, axis=0)
    if HAS_BIAS:
        tl.store(DB_PART + pid_m * K + cols, db_a, mask=col_ok)
        if GATED:
            tl.store(DB_PART + pid_m * K + F + cols, db_g, mask=col_ok)


def bias_act_fwd(x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """x: [M, K] with unit stride in the last dim, bias: [K] or None -> y: [M, F] in x's dtype."""
    gated = activation in GATED
    m, k = x.shape
    f = k // 2 if gated else k
    y = torch.empty((m, f), dtype=x.dtype, device=x.device)
    if m == 0 or f == 0:
        return y
    block_m, block_n, num_warps = tiles(f)
    grid = (cdiv(m, block_m), cdiv(f, block_n))
    if bias is None:  # an unused pointer: x eagerly, a tensor of its own when traced (module docstring)
        bias = x.new_empty(0) if launch._wrapping else x
        has_bias = False
    else:
        has_bias = True
    _bias_act_fwd_kernel[grid](
        x, bias, y, m, f, x.stride(0), y.stride(0),
        ACT=_code(activation), GATED=gated, HAS_BIAS=has_bias,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return y


def bias_act_bwd(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, activation: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dy: [M, F], x: [M, K]. Returns (dx [M, K] in x's dtype, dbias [K] in bias's dtype or None)."""
    gated = activation in GATED
    m, k = x.shape
    f = k // 2 if gated else k
    dx = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m == 0 or f == 0:
        return dx, (torch.zeros_like(bias) if bias is not None else None)
    block_m, block_n, num_warps = tiles(f)
    col_blocks = cdiv(f, block_n)
    programs, rows_per_program = row_split(m, block_m, col_blocks, x.device)
    db_part = partials(programs, 1, k, x.device) if bias is not None else None
    if bias is None and launch._wrapping:  # traced: the unused pointers as tensors of their own (module docstring)
        b_arg, part_arg = x.new_empty(0), dx.new_empty(0)
    else:
        b_arg, part_arg = (bias, db_part) if bias is not None else (x, dx)
    _bias_act_bwd_kernel[(programs, col_blocks)](
        dy, x, b_arg, dx, part_arg,
        m, f, k, dy.stride(0), x.stride(0), dx.stride(0), rows_per_program,
        ACT=_code(activation), GATED=gated, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    dbias = sum_partials(db_part, [bias.dtype])[0] if bias is not None else None
    return dx, dbias

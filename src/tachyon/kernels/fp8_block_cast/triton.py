"""Triton kernel of the block-scaled FP8 cast (no autograd; see op.py and reference.py).

One program per S x S tile of x [R, C] (S = 128 or 32) reads the tile once and writes what was
asked: rows (a scale per 1 x S row segment; data [R, C] and scale_inv [R, ceil(C/S)]), columns
(a scale per S x 1 column segment; data_t [C, R] transposed and scale_inv_t [C, ceil(R/S)]), or
one S x S square (data, scale_inv [ceil(R/S), ceil(C/S)], and with columns its transpose). An
input that both GEMM directions need (the forward's input, the backward's output gradient) is
thus read once for both, where the PyTorch path reads it per direction and per op.

Amax: the integer max of |x|'s fp32 bit patterns (a NaN, whose bits exceed inf's, wins, as
torch.amax propagates it). Scale: the reference's rule with a correctly rounded division
(``tl.div_rn``), so the bits equal the PyTorch path's. The FP8 conversion is tachyon.kernels.
fp8_cast's integer one (``_fp8_codes``), bit-identical to torch's cast.

Traced by torch.compile, an output pointer the kernel does not write is a tensor of its own
instead of x (kernels/launch.py: a traced launch passes no aliasing arguments). Constexprs are computed without tensors
(``_fp32``), which a traced implementation sees as fake tensors without values.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from tachyon.kernels.fp8_cast.reference import FP8_MAX, fp8_format
from tachyon.kernels.fp8_cast.triton import _fp8_codes
from tachyon.kernels.ints import cdiv
from tachyon.kernels import launch
from tachyon.kernels.launch import fast_launch


@triton.jit
def _scale_of(amax, FP8_MAX: tl.constexpr, EPS: tl.constexpr, VFI: tl.constexpr, POW2: tl.constexpr):
    """fp32 scales of fp32 amaxes (any shape): Transformer Engine's compute_scale_from_amax."""
    a = tl.where(amax < EPS, EPS, amax)  # NaN compares false: stays NaN
    valid = (a > 0.0) & (a < float("inf"))
    candidate = tl.div_rn(tl.full(a.shape, FP8_MAX, tl.float32), tl.where(valid, a, 1.0))
    candidate = tl.where(candidate > VFI, VFI, candidate)
    scale = tl.where(valid, candidate, 1.0)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
    return scale


@fast_launch
@triton.jit
def _block_cast_kernel(
    X, OUT, SINV, OUT_T, SINV_T, R, C, stride_xr, stride_xc, sinv_cols, sinv_t_cols,
    S: tl.constexpr, SQUARE: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
    FP8_MAX: tl.constexpr, EPS: tl.constexpr, VFI: tl.constexpr, POW2: tl.constexpr,
    MANT_BITS: tl.constexpr, EXP_BIAS: tl.constexpr, MAX_BITS: tl.constexpr,
):
    bi = tl.program_id(0)
    bj = tl.program_id(1)
    rr = bi.to(tl.int64) * S + tl.arange(0, S)
    cc = bj.to(tl.int64) * S + tl.arange(0, S)
    row_ok = rr < R
    col_ok = cc < C
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + rr[:, None] * stride_xr + cc[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    mask_t = col_ok[:, None] & row_ok[None, :]
    if SQUARE:
        amax = tl.max(tl.max(bits, axis=1), axis=0).to(tl.float32, bitcast=True)
        scale = _scale_of(amax, FP8_MAX, EPS, VFI, POW2)
        inv = tl.div_rn(1.0, scale)
        codes = _fp8_codes(x * scale, MANT_BITS, EXP_BIAS, MAX_BITS).to(tl.uint8)
        tl.store(OUT + rr[:, None] * C + cc[None, :], codes, mask=mask)
        tl.store(SINV + bi * sinv_cols + bj, inv)
        if COLS:
            tl.store(OUT_T + cc[:, None] * R + rr[None, :], tl.trans(codes), mask=mask_t)
            tl.store(SINV_T + bj * sinv_t_cols + bi, inv)
    else:
        if ROWS:
            amax_r = tl.max(bits, axis=1).to(tl.float32, bitcast=True)  # [S], one per row
            scale_r = _scale_of(amax_r, FP8_MAX, EPS, VFI, POW2)
            codes = _fp8_codes(x * scale_r[:, None], MANT_BITS, EXP_BIAS, MAX_BITS).to(tl.uint8)
            tl.store(OUT + rr[:, None] * C + cc[None, :], codes, mask=mask)
            tl.store(SINV + rr * sinv_cols + bj, tl.div_rn(tl.full(scale_r.shape, 1.0, tl.float32), scale_r),
                     mask=row_ok)
        if COLS:
            amax_c = tl.max(bits, axis=0).to(tl.float32, bitcast=True)  # [S], one per column
            scale_c = _scale_of(amax_c, FP8_MAX, EPS, VFI, POW2)
            codes_c = _fp8_codes(x * scale_c[None, :], MANT_BITS, EXP_BIAS, MAX_BITS).to(tl.uint8)
            tl.store(OUT_T + cc[:, None] * R + rr[None, :], tl.trans(codes_c), mask=mask_t)
            tl.store(SINV_T + cc * sinv_t_cols + bi, tl.div_rn(tl.full(scale_c.shape, 1.0, tl.float32), scale_c),
                     mask=col_ok)


@fast_launch
@triton.jit
def _scale_from_amax_kernel(AMAX, SCALE, SCALE_INV, FP8_MAX: tl.constexpr, EPS: tl.constexpr, VFI: tl.constexpr,
                            POW2: tl.constexpr):
    """One program: scale and 1 / scale of the 0-dim fp32 amax (per-tensor current scaling)."""
    scale = _scale_of(tl.load(AMAX), FP8_MAX, EPS, VFI, POW2)
    tl.store(SCALE, scale)
    tl.store(SCALE_INV, tl.div_rn(1.0, scale))


def scale_from_amax(amax: torch.Tensor, fp8_max: float, power_2_scale: bool, amax_epsilon: float,
                    value_for_inf: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv), fp32 0-dim, of the fp32 0-dim ``amax`` in one launch."""
    scale = torch.empty((), dtype=torch.float32, device=amax.device)
    scale_inv = torch.empty((), dtype=torch.float32, device=amax.device)
    _scale_from_amax_kernel[(1,)](amax, scale, scale_inv, FP8_MAX=fp8_max, EPS=_fp32(amax_epsilon), VFI=value_for_inf,
                                  POW2=power_2_scale, num_warps=1)
    return scale, scale_inv


def _fp32(value: float) -> float:
    """``value`` rounded to fp32 (as a Python float; no tensor, see the module docstring)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # beyond fp32's range: inf, as the tensor cast gives
        return float("inf") if value > 0 else float("-inf")


def block_cast(x: torch.Tensor, fp8_dtype: torch.dtype, block_size: int, square: bool, rows: bool, cols: bool,
               power_2_scale: bool, amax_epsilon: float) -> tuple[torch.Tensor, ...]:
    """Launch the kernel (one program per block_size x block_size tile). x: 2-D, any strides."""
    r, c = x.shape
    s = block_size
    nr, nc = cdiv(r, s), cdiv(c, s)
    device = x.device
    empty8 = torch.empty(0, dtype=fp8_dtype, device=device)
    empty32 = torch.empty(0, dtype=torch.float32, device=device)
    want_rows = rows or square
    data = torch.empty((r, c), dtype=fp8_dtype, device=device) if want_rows else empty8
    scale_inv = (torch.empty((nr, nc) if square else (r, nc), dtype=torch.float32, device=device)
                 if want_rows else empty32)
    data_t = torch.empty((c, r), dtype=fp8_dtype, device=device) if cols else empty8
    scale_inv_t = (torch.empty((nc, nr) if square else (c, nr), dtype=torch.float32, device=device)
                   if cols else empty32)
    if r and c:
        fmt = fp8_format(fp8_dtype)
        # a placeholder pointer where an output is not written (the kernel never touches it)
        ux = ut = us = ust = x
        if launch._wrapping:  # traced: a tensor of its own each (module docstring)
            ux, ut, us, ust = (x.new_empty(0) for _ in range(4))
        out = data.view(torch.uint8) if want_rows else ux
        out_t = data_t.view(torch.uint8) if cols else ut
        _block_cast_kernel[(nr, nc)](
            x, out, scale_inv if want_rows else us, out_t, scale_inv_t if cols else ust, r, c, x.stride(0), x.stride(1),
            nc, nr, S=s, SQUARE=square, ROWS=rows, COLS=cols, FP8_MAX=FP8_MAX[fp8_dtype],
            EPS=_fp32(amax_epsilon), VFI=torch.finfo(x.dtype).max, POW2=power_2_scale,
            MANT_BITS=fmt.mantissa_bits, EXP_BIAS=fmt.exponent_bias, MAX_BITS=fmt.max_bits,
            num_warps=8 if device.type == "cuda" else 1,
        )
    return data, scale_inv, data_t, scale_inv_t

"""Triton kernels for the fused FP8 cast + amax (+ transpose) (no autograd; see op.py).

One pass over x does what the PyTorch path does in three or four:

    y     = x.float() * scale                    scale read from a device pointer (no host sync)
    code  = _fp8_codes(y)                        saturating RNE, integer math on y's bits
    store code through a uint8 view of the FP8 output (and of its transpose)
    amax  = max(amax, max |x|)                   one atomic per program

FP8 conversion: in integer arithmetic (the same steps as ``reference.fp8_codes``, which documents
them), never ``.to(tl.float8e4nv)``: Triton 3.7.1's interpreter converts fp32 -> float8e4nv wrongly
when rounding carries into the exponent, and the software conversion lets the CPU interpreter
tests check the very code the GPU runs.

Amax: |x| is non-negative, and for non-negative floats the order of their int32 bit patterns is
the order of the values, with every NaN (bits > 0x7F800000) above +inf. So each program takes the
integer max of |x|'s bits over its block and ``tl.atomic_max``-es it into the int32 view of amax:
NaN propagates, and the result does not depend on the order the programs run in (deterministic).
One case needs care: an amax that already holds a NaN with the sign bit set is a negative int32,
which the max would overwrite; the one program whose atomic returns that old value writes a
positive NaN after it, so a NaN amax stays NaN (as torch.maximum keeps it).

Traced by torch.compile, the amax pointer without an amax is a tensor of its own instead of a
view of scale (kernels/launch.py: a traced launch passes no aliasing arguments; the atomic's
target would be written back into scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tachyon.kernels.fp8_cast.reference import fp8_format
from tachyon.kernels.ints import cdiv
from tachyon.kernels import launch
from tachyon.kernels.launch import fast_launch


@triton.jit
def _fp8_codes(y, MANT_BITS: tl.constexpr, EXP_BIAS: tl.constexpr, MAX_BITS: tl.constexpr):
    """fp32 tensor y -> int32 tensor of FP8 codes (0..255) of clamp(y, +-fp8_max), RNE."""
    SHIFT: tl.constexpr = 23 - MANT_BITS
    MIN_NORMAL_EXP: tl.constexpr = 128 - EXP_BIAS
    REBIAS: tl.constexpr = (127 - EXP_BIAS) << MANT_BITS
    HALF_MINUS_ONE: tl.constexpr = (1 << (SHIFT - 1)) - 1
    u = y.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    is_nan = a > 0x7F800000
    a = tl.minimum(a, MAX_BITS)  # saturate (inf too); NaN is handled below
    normal = ((a + HALF_MINUS_ONE + ((a >> SHIFT) & 1)) >> SHIFT) - REBIAS
    exp = a >> 23
    mant = (a & 0x7FFFFF) | 0x800000
    s = tl.minimum(tl.maximum(SHIFT + MIN_NORMAL_EXP - exp, 1), 25)  # >= 25 rounds to 0 anyway
    q = mant >> s
    rem = mant - (q << s)
    half = tl.full(s.shape, 1, tl.int32) << (s - 1)
    round_up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    q = q + round_up.to(tl.int32)
    code = tl.where(exp >= MIN_NORMAL_EXP, normal, q)
    code = tl.where(is_nan, 0x7F, code)
    return code | sign


@triton.jit
def _fold_amax(AMAX, block_max_bits):
    """atomic max of |x|'s bits into amax's int32 view; keeps a sign-bit NaN already there NaN."""
    prev = tl.atomic_max(AMAX, block_max_bits)
    was_negative_nan = (prev < 0) & ((prev & 0x7FFFFFFF) > 0x7F800000)
    tl.atomic_max(AMAX, tl.full((), 0x7FC00000, tl.int32), mask=was_negative_nan)


@fast_launch
@triton.jit
def _cast_flat_kernel(
    X, SCALE, OUT, AMAX, numel,
    MANT_BITS: tl.constexpr, EXP_BIAS: tl.constexpr, MAX_BITS: tl.constexpr,
    HAS_AMAX: tl.constexpr, BLOCK: tl.constexpr,
):
    """x: [numel] contiguous -> OUT: uint8 codes [numel]; program p covers [p*BLOCK, (p+1)*BLOCK)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(SCALE)
    code = _fp8_codes(x * scale, MANT_BITS, EXP_BIAS, MAX_BITS)
    tl.store(OUT + offs, code.to(tl.uint8), mask=mask)
    if HAS_AMAX:
        abs_bits = tl.where(mask, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
        _fold_amax(AMAX, tl.max(abs_bits, axis=0))


@fast_launch
@triton.jit
def _cast_transpose_kernel(
    X, SCALE, OUT, OUT_T, AMAX, M, N, stride_xm, stride_xn,
    MANT_BITS: tl.constexpr, EXP_BIAS: tl.constexpr, MAX_BITS: tl.constexpr,
    HAS_AMAX: tl.constexpr, ROW_CONTIGUOUS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """x: [M, N] (any strides; ROW_CONTIGUOUS when stride_xn == 1, so loads vectorize) -> OUT [M, N]
    and OUT_T [N, M], contiguous uint8 codes; one BLOCK_M x BLOCK_N tile per program."""
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if ROW_CONTIGUOUS:
        x_ptrs = X + rm[:, None] * stride_xm + rn[None, :]
    else:
        x_ptrs = X + rm[:, None] * stride_xm + rn[None, :] * stride_xn
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(SCALE)
    code = _fp8_codes(x * scale, MANT_BITS, EXP_BIAS, MAX_BITS).to(tl.uint8)
    tl.store(OUT + rm[:, None] * N + rn[None, :], code, mask=mask)
    mask_t = (rn[:, None] < N) & (rm[None, :] < M)
    tl.store(OUT_T + rn[:, None] * M + rm[None, :], tl.trans(code), mask=mask_t)
    if HAS_AMAX:
        abs_bits = tl.where(mask, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
        _fold_amax(AMAX, tl.max(tl.max(abs_bits, axis=1), axis=0))


def _format_constexprs(fp8_dtype: torch.dtype) -> dict[str, int]:
    fmt = fp8_format(fp8_dtype)
    return dict(MANT_BITS=fmt.mantissa_bits, EXP_BIAS=fmt.exponent_bias, MAX_BITS=fmt.max_bits)


def flat_config(device: torch.device) -> tuple[int, int]:
    """(BLOCK, num_warps) of the flat kernel: 4096 elements per program on a GPU (16 B of bf16 per
    thread per load at 8 warps); 1024 under the interpreter (small test tensors, few programs)."""
    return (4096, 8) if device.type == "cuda" else (1024, 1)


MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension: N / BLOCK_N tiles


def tile_config(device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the transposing kernel."""
    return (64, 64, 4) if device.type == "cuda" else (32, 32, 1)


def cast_to_fp8(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, amax: torch.Tensor | None, transpose: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the fused cast. x: contiguous (any shape) or, with ``transpose``, 2-D with any strides;
    scale, amax: fp32 0-dim on x's device (amax updated in place). Returns (x8, x8_t or None)."""
    consts = _format_constexprs(fp8_dtype)
    x8 = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    if amax is not None:
        amax_bits = amax.view(torch.int32)
    else:  # not touched (HAS_AMAX): scale eagerly, a tensor of its own when traced (module docstring)
        amax_bits = scale.new_empty(0, dtype=torch.int32) if launch._wrapping else scale.view(torch.int32)
    if not transpose:
        x8_t = None
        numel = x.numel()
        if numel:
            block, num_warps = flat_config(x.device)
            _cast_flat_kernel[(cdiv(numel, block),)](
                x, scale, x8.view(torch.uint8), amax_bits, numel,
                HAS_AMAX=amax is not None, BLOCK=block, num_warps=num_warps, **consts,
            )
        return x8, x8_t
    m, n = x.shape
    x8_t = torch.empty((n, m), dtype=fp8_dtype, device=x.device)
    if m and n:
        block_m, block_n, num_warps = tile_config(x.device)
        _cast_transpose_kernel[(cdiv(m, block_m), cdiv(n, block_n))](
            x, scale, x8.view(torch.uint8), x8_t.view(torch.uint8), amax_bits, m, n, x.stride(0), x.stride(1),
            HAS_AMAX=amax is not None, ROW_CONTIGUOUS=x.stride(1) == 1, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps, **consts,
        )
    return x8, x8_t


__all__ = ["MAX_GRID_Y", "cast_to_fp8", "flat_config", "tile_config"]

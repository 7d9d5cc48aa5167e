"""An independent reference of the FP8 recipes' arithmetic, in plain Python floats (float64).

Nothing here calls tachyon or torch's FP8 conversion: the FP8 values are enumerated from their
bit layout, a value is rounded to the nearest one (ties to the even code) after saturation, fp32
rounding is struct's, and each scale follows Transformer Engine's compute_scale_from_amax as its
source reads (amax floored at epsilon; 0, inf or NaN give 1; fp8_max / amax, replaced by
value_for_inf where it overflows fp32; power of 2 by clearing the mantissa, i.e. 2**floor(log2)).

    values, scale_inv = quantize(rows, "e4m3", (1, 128), pow2=True)   # dequantized values, per-block 1/scale
"""

from __future__ import annotations

import bisect
import math
import struct

FP32_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]
BF16_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7F0000))[0]


def f32(value: float) -> float:
    """``value`` rounded to the nearest fp32 (ties to even); overflow gives +-inf."""
    if math.isnan(value) or math.isinf(value):
        return value
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        # struct refuses values beyond FLT_MAX: those at or past FLT_MAX + half an ulp round to inf
        limit = FP32_MAX + 2.0 ** (127 - 24)
        if abs(value) >= limit:
            return math.copysign(math.inf, value)
        return math.copysign(FP32_MAX, value)


def _table(fmt: str) -> tuple[list[float], list[int], float]:
    """(sorted non-negative finite values, their codes, max) of an FP8 format from its bits."""
    exp_bits, man_bits, bias = {"e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}[fmt]
    pairs = []
    for e in range(2 ** exp_bits):
        for m in range(2 ** man_bits):
            code = (e << man_bits) | m
            if fmt == "e4m3" and e == 15 and m == 7:
                continue  # NaN (e4m3fn has no inf)
            if fmt == "e5m2" and e == 31:
                continue  # inf and NaN
            if e == 0:
                value = (m / 2 ** man_bits) * 2.0 ** (1 - bias)
            else:
                value = (1 + m / 2 ** man_bits) * 2.0 ** (e - bias)
            pairs.append((value, code))
    pairs.sort()
    return [v for v, _ in pairs], [c for _, c in pairs], pairs[-1][0]


TABLES = {fmt: _table(fmt) for fmt in ("e4m3", "e5m2")}
FP8_MAX = {fmt: TABLES[fmt][2] for fmt in TABLES}


def round_fp8(value: float, fmt: str) -> float:
    """Saturate to +-max, then round to the nearest FP8 value, ties to the even code; NaN stays."""
    if math.isnan(value):
        return math.nan
    values, codes, top = TABLES[fmt]
    a = min(abs(value), top)
    i = bisect.bisect_left(values, a)
    if values[i] == a:
        chosen = a
    else:
        lo, hi = values[i - 1], values[i]
        if a - lo < hi - a:
            chosen = lo
        elif hi - a < a - lo:
            chosen = hi
        else:
            chosen = lo if codes[i - 1] % 2 == 0 else hi
    return math.copysign(chosen, value)


def scale_of(amax: float, fmt: str, *, pow2: bool, eps: float = 0.0, value_for_inf: float = FP32_MAX) -> float:
    """Transformer Engine's compute_scale_from_amax (module docstring), as an fp32 value (its
    epsilon is an fp32 value too)."""
    eps = f32(eps)
    if not math.isnan(amax) and amax < eps:
        amax = eps
    if amax == 0 or math.isinf(amax) or math.isnan(amax):
        return 1.0
    scale = f32(FP8_MAX[fmt] / amax)  # a float64 quotient rounded to fp32 is the fp32 quotient
    if math.isinf(scale):
        scale = value_for_inf
    if pow2:
        mantissa, exponent = math.frexp(scale)
        scale = 2.0 ** (exponent - 1)
    return scale


def quantize(rows: list[list[float]], fmt: str, block: tuple[int, int], *, pow2: bool, eps: float = 0.0,
             value_for_inf: float = FP32_MAX) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
    """(FP8 values, dequantized values fp32(q * scale_inv), scale_inv per block [R/br][C/bc]) of
    ``rows`` (fp32-exact floats) with one scale per ``block`` = (br, bc)."""
    n_rows, n_cols = len(rows), len(rows[0])
    br, bc = block
    q = [[0.0] * n_cols for _ in range(n_rows)]
    deq = [[0.0] * n_cols for _ in range(n_rows)]
    scale_inv = [[0.0] * -(-n_cols // bc) for _ in range(-(-n_rows // br))]
    for bi in range(-(-n_rows // br)):
        for bj in range(-(-n_cols // bc)):
            cells = [(i, j) for i in range(bi * br, min((bi + 1) * br, n_rows))
                     for j in range(bj * bc, min((bj + 1) * bc, n_cols))]
            amax = 0.0
            for i, j in cells:
                v = abs(rows[i][j])
                amax = math.nan if math.isnan(v) or math.isnan(amax) else max(amax, v)
            scale = scale_of(amax, fmt, pow2=pow2, eps=eps, value_for_inf=value_for_inf)
            inv = f32(1.0 / scale)
            scale_inv[bi][bj] = inv
            for i, j in cells:
                q[i][j] = round_fp8(f32(rows[i][j] * scale), fmt)
                deq[i][j] = f32(q[i][j] * inv)
    return q, deq, scale_inv


def transpose(rows: list[list[float]]) -> list[list[float]]:
    return [list(col) for col in zip(*rows)]


def matmul_nt(a: list[list[float]], b: list[list[float]]):
    """a [M, K] @ b [N, K].T in float64 (a torch float64 matmul: the GEMM itself is not what is
    under test, the operands are), and the same product of the magnitudes: (value, bound), the
    bound scaling the error fp32 accumulation may make."""
    import torch

    at, bt = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return at @ bt.t(), at.abs() @ bt.abs().t()

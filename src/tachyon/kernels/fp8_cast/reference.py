"""PyTorch reference for the fused FP8 cast + amax (+ transpose): the CPU path and the oracle.

    x8 = cast_to_fp8(x, scale, fp8_dtype, amax)                    # amax updated in place
    x8, x8_t = cast_to_fp8(x, scale, fp8_dtype, amax, transpose=True)

What it computes, for x of any float dtype (fp32/fp16/bf16):

    y    = x.float() * scale                       (one fp32 multiply, rounded to nearest even)
    x8   = fp8(clamp(y, -fp8_max, fp8_max))        saturating; round to nearest, ties to even
    amax = max(amax, max |x|)                      in place; NaN anywhere makes it NaN
    x8_t = x8.T, contiguous                        (x 2-D; the column-major operand _scaled_mm wants)

That is bit for bit ``(x.float() * scale).clamp(-m, m).to(fp8_dtype)``, but the conversion to FP8
is done here in integer arithmetic on the fp32 bit pattern (:func:`fp8_codes`), the same steps the
Triton kernel takes, so the CPU tests exercise exactly the GPU algorithm (Triton 3.7.1's
interpreter rounds fp32 -> float8e4nv wrongly when the rounding carries into the exponent, so the
kernel cannot use the hardware conversion and be checked on CPU).

FP8 formats (sign, exponent, mantissa bits; exponent bias):

    float8_e4m3fn  1.4.3, bias 7,  max 448   = 1.75 * 2^8,  min normal 2^-6,  min subnormal 2^-9,
                   no inf; NaN = S.1111.111 (0x7F / 0xFF)
    float8_e5m2    1.5.2, bias 15, max 57344 = 1.75 * 2^15, min normal 2^-14, min subnormal 2^-16,
                   inf = S.11111.00 (never produced here: the cast saturates); NaN 0x7F / 0xFF
"""

from __future__ import annotations

import dataclasses

import torch

FP8_MAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8_DTYPES = tuple(FP8_MAX)

FP32_INF_BITS = 0x7F800000
FP32_ABS_MASK = 0x7FFFFFFF
FP8_NAN_CODE = 0x7F  # | 0x80 for a NaN with the sign bit set, as torch's cast does


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """The constants of the integer conversion from fp32 bits to an FP8 code."""

    mantissa_bits: int  # 3 (E4M3) or 2 (E5M2)
    exponent_bias: int  # 7 or 15
    max_bits: int  # fp32 bit pattern of fp8_max: |y| is clamped to this before rounding

    @property
    def shift(self) -> int:
        """fp32 mantissa bits dropped: 23 - mantissa_bits."""
        return 23 - self.mantissa_bits

    @property
    def min_normal_exp(self) -> int:
        """Biased fp32 exponent of FP8's smallest normal number 2^(1 - bias)."""
        return 127 + 1 - self.exponent_bias

    @property
    def rebias(self) -> int:
        """Subtracted from (fp32 bits >> shift) to turn fp32's exponent bias into FP8's."""
        return (127 - self.exponent_bias) << self.mantissa_bits


def _fp32_bits(value: float) -> int:
    return int(torch.tensor(value, dtype=torch.float32).view(torch.int32))


FORMATS: dict[torch.dtype, Fp8Format] = {
    torch.float8_e4m3fn: Fp8Format(3, 7, _fp32_bits(FP8_MAX[torch.float8_e4m3fn])),
    torch.float8_e5m2: Fp8Format(2, 15, _fp32_bits(FP8_MAX[torch.float8_e5m2])),
}


def fp8_format(fp8_dtype: torch.dtype) -> Fp8Format:
    """The conversion constants of ``fp8_dtype``; ValueError for any other dtype."""
    if fp8_dtype not in FORMATS:
        allowed = ", ".join(str(d) for d in FP8_DTYPES)
        raise ValueError(f"fp8_dtype={fp8_dtype} is not an FP8 dtype this cast supports; allowed: {allowed}")
    return FORMATS[fp8_dtype]


def fp8_codes(y: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The FP8 bit patterns of clamp(y, -fp8_max, fp8_max), rounded to nearest even, as uint8.

    y: fp32, any shape. Returns uint8 of y's shape; ``.view(fp8_dtype)`` makes it the FP8 tensor.
    Integer steps on the bits u of y (the Triton kernel's ``_fp8_codes`` does the same):

    1. a = u & 0x7FFFFFFF (|y|); NaN if a > 0x7F800000 -> code 0x7F; else a = min(a, bits(fp8_max))
       (saturation, inf included: for non-negative floats, integer order is float order).
    2. Normal FP8 range (exponent >= 2^(1-bias)): add half an FP8 ulp minus one plus the lowest
       kept bit (round half to even), drop ``shift`` bits, re-bias the exponent. A carry out of the
       mantissa moves into the exponent, which is the right result (e.g. 1.9375 -> 2.0 in E4M3).
    3. Subnormal range: the mantissa with its implicit 1 is shifted right by shift + (distance
       below the normal range), rounding half to even by hand; a result of 2^mantissa_bits is the
       smallest normal code, also right.
    4. The sign bit is or-ed back in (so -0.0 and negative values that round to 0 give 0x80).
    """
    fmt = fp8_format(fp8_dtype)
    u = y.to(torch.float32).contiguous().view(torch.int32)
    sign = (u >> 24) & 0x80
    a = u & FP32_ABS_MASK
    is_nan = a > FP32_INF_BITS
    a = torch.clamp_max(a, fmt.max_bits)
    # normal range
    half_minus_one = (1 << (fmt.shift - 1)) - 1
    normal = ((a + half_minus_one + ((a >> fmt.shift) & 1)) >> fmt.shift) - fmt.rebias
    # subnormal range (and zero, and fp32 subnormals, which all round to zero)
    exp = a >> 23
    mant = (a & 0x7FFFFF) | 0x800000
    s = torch.clamp_max(fmt.shift + fmt.min_normal_exp - exp, 25)  # >= 25 always gives 0
    s = torch.clamp_min(s, 1)  # only matters where the normal branch is taken; keeps shifts valid
    q = mant >> s
    rem = mant - (q << s)
    half = 1 << (s - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(torch.int32)
    code = torch.where(exp >= fmt.min_normal_exp, normal, q)
    code = torch.where(is_nan, torch.full_like(code, FP8_NAN_CODE), code)
    return (code | sign).to(torch.uint8)


def update_amax(amax: torch.Tensor, x: torch.Tensor) -> None:
    """amax (fp32 0-dim) = max(amax, max |x|) in place; NaN propagates; an empty x changes nothing."""
    if x.numel() == 0:
        return
    amax.copy_(torch.maximum(amax, x.detach().abs().amax().to(torch.float32)))


def cast_to_fp8(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    amax: torch.Tensor | None = None,
    *,
    transpose: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fp8(clamp(x.float() * scale, +-fp8_max)), and amax updated in place (see the module docstring).

    x: [...] fp32/fp16/bf16 ([M, N] when ``transpose``); scale, amax: fp32 0-dim.
    Returns x8 (``fp8_dtype``, x's shape, contiguous), or (x8, x8_t [N, M] contiguous) when
    ``transpose``. No autograd: nothing is saved.
    """
    y = x.detach().to(torch.float32) * scale
    x8 = fp8_codes(y, fp8_dtype).view(fp8_dtype)
    if amax is not None:
        update_amax(amax, x)
    if transpose:  # clone, not .contiguous(): for [1, N] or empty x the transposed view is already
        return x8, x8.t().clone(memory_format=torch.contiguous_format)  # "contiguous" and would alias x8
    return x8


def cast_to_fp8_torch(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The same cast with PyTorch's own conversion: the oracle :func:`fp8_codes` is tested against."""
    m = FP8_MAX[fp8_dtype]
    return (x.to(torch.float32) * scale).clamp(-m, m).to(fp8_dtype)

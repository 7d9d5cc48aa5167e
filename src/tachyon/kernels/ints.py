"""Integer helpers for launchers' host code: grid sizes and block widths.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions usable inside kernels; called
from Python they cost several microseconds each (a wrapper), against about 0.1 us for these, and
a layer's launchers call them dozens of times per step.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (0 for n <= 0, as triton.next_power_of_2)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def next_power_of_2_by_comparison(n) -> int:
    """next_power_of_2 by comparisons only: for a symbolic size under torch.compile, which then
    guards on the range the power of two covers (n in (b/2, b]) instead of on n's exact value."""
    b = 1
    while b < n:
        b *= 2
    return 0 if n <= 0 else b


__all__ = ["cdiv", "next_power_of_2", "next_power_of_2_by_comparison"]

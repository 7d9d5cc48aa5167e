"""FP8 recipes as values: the formats and the delayed-scaling recipe (Transformer Engine's names).

    from tachyon.fp8 import DelayedScaling, Format
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")

A recipe is a small frozen dataclass: it says *how* to scale, it holds no state. The state (amax
histories and scales) lives with each FP8 GEMM of a module (:mod:`tachyon.fp8.scaling`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

import torch

# FP8_MAX: the largest finite value of each FP8 dtype (e4m3fn has no inf; 448 = 1.75 * 2**8),
# the table the FP8 cast kernel clamps with
from tachyon.kernels.fp8_cast.reference import FP8_MAX

FP8_E4M3 = torch.float8_e4m3fn
FP8_E5M2 = torch.float8_e5m2

AMAX_ALGOS = ("max", "most_recent")


class Format(enum.Enum):
    """Which FP8 dtype each GEMM operand uses.

    E4M3: everything in E4M3 (3 mantissa bits, max 448). E5M2: everything in E5M2 (2 mantissa
    bits, max 57344; refused by :class:`DelayedScaling`, forward tensors need E4M3's precision).
    HYBRID: E4M3 in the forward (inputs, weights), E5M2 for gradients, whose range matters more.
    """

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    @property
    def forward_dtype(self) -> torch.dtype:
        """FP8 dtype of the forward operands (inputs and weights)."""
        return FP8_E5M2 if self is Format.E5M2 else FP8_E4M3

    @property
    def backward_dtype(self) -> torch.dtype:
        """FP8 dtype of the gradients (grad_output) in the backward GEMMs."""
        return FP8_E4M3 if self is Format.E4M3 else FP8_E5M2


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """The delayed-scaling recipe: each tensor is scaled by a factor from its past amaxes.

    margin: scale = fp8_max / amax / 2**margin (a margin of m keeps 2**m of headroom).
    fp8_format: Format.HYBRID (default) or Format.E4M3.
    amax_history_len: how many steps of amax each tensor remembers (>= 1).
    amax_compute_algo: "max" (max over the history), "most_recent" (the last step's amax), or a
        callable taking the fp32 history tensor [amax_history_len] (newest first) and returning
        the amax as a 0-dim tensor.
    reduce_amax: all-reduce (MAX) the amaxes over the autocast's fp8_group before computing the
        scales, so every rank of a data/tensor-parallel group casts with the same scale.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 16
    amax_compute_algo: str | Callable[[torch.Tensor], torch.Tensor] = "max"
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.fp8_format, Format):
            raise ValueError(f"DelayedScaling: fp8_format must be a tachyon.fp8.Format; got {self.fp8_format!r}")
        if self.fp8_format is Format.E5M2:
            raise ValueError(
                "DelayedScaling: fp8_format=Format.E5M2 is not supported: forward tensors (inputs and "
                "weights) need E4M3's extra mantissa bit; allowed: Format.HYBRID (E4M3 forward, E5M2 "
                "gradients) or Format.E4M3"
            )
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"DelayedScaling: margin must be an int >= 0; got {self.margin!r}")
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"DelayedScaling: amax_history_len must be an int >= 1; got {self.amax_history_len!r}")
        algo = self.amax_compute_algo
        if not callable(algo) and algo not in AMAX_ALGOS:
            raise ValueError(
                f"DelayedScaling: amax_compute_algo={algo!r} is not allowed; use 'max', 'most_recent' "
                "or a callable(amax_history) -> amax"
            )
        if not isinstance(self.reduce_amax, bool):
            raise ValueError(f"DelayedScaling: reduce_amax must be a bool; got {self.reduce_amax!r}")

    @property
    def forward_max(self) -> float:
        return FP8_MAX[self.fp8_format.forward_dtype]

    @property
    def backward_max(self) -> float:
        return FP8_MAX[self.fp8_format.backward_dtype]


__all__ = ["AMAX_ALGOS", "FP8_E4M3", "FP8_E5M2", "FP8_MAX", "DelayedScaling", "Format"]

"""FP8 recipes as values, under Transformer Engine 2.x's names, fields and defaults.

    from tachyon.fp8 import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format
    recipe = Float8CurrentScaling()                        # HYBRID: E4M3 forward, E5M2 gradients
    recipe = Float8BlockScaling()                          # E4M3 everywhere, 1x128 / 128x128 blocks
    recipe = DelayedScaling(amax_history_len=16, amax_compute_algo="max")

A recipe is a small frozen dataclass: it says *how* to scale and holds no state. Delayed scaling
keeps state per GEMM operand (amax histories and scales, :mod:`tachyon.fp8.scaling`); the other
recipes compute every scale from the tensor being cast and keep none.

    recipe                  scale of a tensor from             granularity               state
    DelayedScaling          amax of previous steps (history)   one per tensor            yes
    Float8CurrentScaling    this tensor's amax                 one per tensor            no
    Float8BlockScaling      each block's amax, power of 2      1x128 (inputs, grads),    no
                                                               128x128 (weights)
    MXFP8BlockScaling       each block's amax, power of 2      1x32 everywhere           no
                            (E8M0)                             (compute capability 10.x only)

The scale of a tensor (or block) with amax a, for an FP8 format with largest value m, is
Transformer Engine's ``compute_scale_from_amax``: a is raised to ``amax_epsilon``; a of 0, inf
or NaN gives scale 1; else scale = m / a, replaced by the input dtype's largest finite value
where that overflows (fp32's for current scaling), and with ``power_2_scale`` rounded down to a
power of 2 (its mantissa bits cleared), which makes dequantization exact.
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
BACKWARD_OVERRIDES = (None,)


class Format(enum.Enum):
    """Which FP8 dtype each GEMM operand uses.

    E4M3: everything in E4M3 (3 mantissa bits, max 448). E5M2: everything in E5M2 (2 mantissa
    bits, max 57344; refused by every recipe, as in Transformer Engine: forward tensors need
    E4M3's precision). HYBRID: E4M3 in the forward (inputs, weights), E5M2 for gradients, whose
    range matters more.
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
class QParams:
    """How one operand role is quantized (Transformer Engine's QParams): ``power_2_scale`` rounds
    every scale down to a power of 2; ``amax_epsilon`` is the smallest amax a scale is computed
    from (0: none)."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.power_2_scale, bool):
            raise ValueError(f"QParams: power_2_scale must be a bool; got {self.power_2_scale!r}")
        if isinstance(self.amax_epsilon, bool) or not isinstance(self.amax_epsilon, (int, float)) or not self.amax_epsilon >= 0:
            raise ValueError(f"QParams: amax_epsilon must be a float >= 0; got {self.amax_epsilon!r}")


@dataclasses.dataclass(frozen=True)
class MMParams:
    """Options of one FP8 GEMM (Transformer Engine's MMParams). ``use_split_accumulator=False``
    lets torch._scaled_mm accumulate in FP8 tensor cores' fast mode (``use_fast_accum``); True
    (the default) promotes to fp32 regularly. The emulation always accumulates in fp32."""

    use_split_accumulator: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.use_split_accumulator, bool):
            raise ValueError(f"MMParams: use_split_accumulator must be a bool; got {self.use_split_accumulator!r}")


class Recipe:
    """Base of the FP8 recipes, with Transformer Engine's kind tests (class methods, so
    ``recipe.delayed()`` and ``DelayedScaling.delayed()`` both work)."""

    name = "recipe"
    stateful = False  # keeps per-GEMM state (amax histories, scales): delayed scaling only
    blockwise = False  # block-scaled operands (Float8BlockScaling, MXFP8BlockScaling)

    @classmethod
    def delayed(cls) -> bool:
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        return issubclass(cls, (DelayedScaling, Float8CurrentScaling))

    @classmethod
    def float8_block_scaling(cls) -> bool:
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def mxfp8(cls) -> bool:
        return issubclass(cls, MXFP8BlockScaling)

    @property
    def forward_max(self) -> float:
        return FP8_MAX[self.fp8_format.forward_dtype]

    @property
    def backward_max(self) -> float:
        return FP8_MAX[self.fp8_format.backward_dtype]


def _check_common(recipe: Recipe) -> None:
    """The checks every recipe shares: its format, FP8 attention, backward_override."""
    name = type(recipe).__name__
    if not isinstance(recipe.fp8_format, Format):
        raise ValueError(f"{name}: fp8_format must be a tachyon.fp8.Format; got {recipe.fp8_format!r}")
    if recipe.fp8_format is Format.E5M2:
        raise ValueError(
            f"{name}: fp8_format=Format.E5M2 is not supported: forward tensors (inputs and weights) need "
            "E4M3's extra mantissa bit; allowed: Format.HYBRID (E4M3 forward, E5M2 gradients) or Format.E4M3"
        )
    for flag in ("fp8_dpa", "fp8_mha"):
        value = getattr(recipe, flag)
        if not isinstance(value, bool):
            raise ValueError(f"{name}: {flag} must be a bool; got {value!r}")
        if value:
            raise ValueError(f"{name}: {flag}=True (FP8 attention) is not implemented by tachyon: attention runs in "
                             "the activations' dtype; leave it False")
    if recipe.backward_override not in BACKWARD_OVERRIDES:
        raise ValueError(f"{name}: backward_override={recipe.backward_override!r} is not implemented by tachyon; "
                         "allowed: None (the backward GEMMs run in FP8 like the forward)")


def _check_bool(recipe: Recipe, field: str) -> None:
    value = getattr(recipe, field)
    if not isinstance(value, bool):
        raise ValueError(f"{type(recipe).__name__}: {field} must be a bool; got {value!r}")


def _set_qparams(recipe: Recipe, power_2_scale: bool) -> None:
    """Fill the QParams fields left None with ``QParams(power_2_scale)``; check the others."""
    for field in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
        value = getattr(recipe, field)
        if value is None:
            object.__setattr__(recipe, field, QParams(power_2_scale=power_2_scale))
        elif not isinstance(value, QParams):
            raise ValueError(f"{type(recipe).__name__}: {field} must be a tachyon.fp8.QParams; got {value!r}")
    for field in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
        value = getattr(recipe, field)
        if not isinstance(value, MMParams):
            raise ValueError(f"{type(recipe).__name__}: {field} must be a tachyon.fp8.MMParams; got {value!r}")


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
    """The delayed-scaling recipe: each tensor is scaled by a factor from its past amaxes.

    margin: scale = fp8_max / amax / 2**margin (a margin of m keeps 2**m of headroom).
    fp8_format: Format.HYBRID (default) or Format.E4M3.
    amax_history_len: how many steps of amax each tensor remembers (>= 1).
    amax_compute_algo: "max" (max over the history), "most_recent" (the last step's amax), or a
        callable taking the fp32 history tensor [amax_history_len] (newest first) and returning
        the amax as a 0-dim tensor.
    reduce_amax: all-reduce (MAX) the amaxes over the autocast's amax_reduction_group before
        computing the scales, so every rank of a data/tensor-parallel group casts with the same scale.
    fp8_dpa, fp8_mha: FP8 attention; only False (not implemented). backward_override: only None.
    """

    name = "delayed"
    stateful = True

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 16
    amax_compute_algo: str | Callable[[torch.Tensor], torch.Tensor] = "max"
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.fp8_format, Format):
            raise ValueError(f"DelayedScaling: fp8_format must be a tachyon.fp8.Format; got {self.fp8_format!r}")
        _check_common(self)
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
        _check_bool(self, "reduce_amax")


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor current scaling: each tensor is cast with a scale from its own amax, computed in
    the same step (one more read of the tensor than delayed scaling, no history, no state).

    use_power_2_scales: round the scales down to powers of 2 (fills the QParams left None).
    fp8_format: Format.HYBRID (default: E4M3 inputs and weights, E5M2 gradients) or Format.E4M3.
    fp8_quant_fwd_inp, fp8_quant_fwd_weight, fp8_quant_bwd_grad: QParams per role (default
        ``QParams(power_2_scale=use_power_2_scales, amax_epsilon=0.0)``).
    fp8_gemm_fprop / fp8_gemm_dgrad / fp8_gemm_wgrad: MMParams; Transformer Engine's defaults let
        the forward GEMM accumulate in fast mode (use_split_accumulator=False) on the GPU.
    fp8_dpa, fp8_mha: only False. backward_override: only None.

    No amax is all-reduced: each rank scales the tensors it multiplies (a tensor-parallel GEMM
    takes its input whole, gathered before the cast, so every rank computes the same scale for it).
    """

    name = "current"

    use_power_2_scales: bool = False
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: QParams | None = None
    fp8_quant_fwd_weight: QParams | None = None
    fp8_quant_bwd_grad: QParams | None = None
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None

    def __post_init__(self) -> None:
        _check_bool(self, "use_power_2_scales")
        _check_common(self)
        _set_qparams(self, self.use_power_2_scales)


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """Block scaling (DeepSeek-V3's recipe, Transformer Engine's Float8BlockScaling): a scale per
    block of 1 x 128 values (inputs and gradients: 128 consecutive values of a row along the GEMM's
    contraction dimension) or 128 x 128 (weights), E4M3 in both passes, power-of-2 scales.

    use_f32_scales: keep scales as computed (fp32) instead of powers of 2 (fills the QParams left None).
    fp8_format: Format.E4M3 (default) or Format.HYBRID (E5M2 gradients).
    fp8_quant_fwd_inp, fp8_quant_fwd_weight, fp8_quant_bwd_grad: QParams per role (default
        ``QParams(power_2_scale=not use_f32_scales)``).
    x_block_scaling_dim, w_block_scaling_dim, grad_block_scaling_dim: 1 (1 x 128 blocks) or 2
        (128 x 128) for inputs, weights and gradients; no GEMM multiplies two 2-D-scaled operands.
    fp8_gemm_fprop / dgrad / wgrad: MMParams, use_split_accumulator=True only.
    fp8_dpa, fp8_mha: only False. backward_override: only None.

    A 1 x 128 block runs along the contraction dimension of the GEMM that uses it, so an input
    is quantized twice from high precision, along its rows for the forward GEMM and along its
    columns for the weight-gradient GEMM (the gradient too: along its rows for dgrad, its columns
    for wgrad); a 128 x 128-scaled tensor serves both directions (its transpose is exact).
    Nothing is all-reduced: every block's scale is local.
    """

    name = "block"
    blockwise = True

    use_f32_scales: bool = False
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams | None = None
    fp8_quant_fwd_weight: QParams | None = None
    fp8_quant_bwd_grad: QParams | None = None
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None

    block_size = 128

    def __post_init__(self) -> None:
        _check_bool(self, "use_f32_scales")
        _check_common(self)
        _set_qparams(self, not self.use_f32_scales)
        dims = {"x": self.x_block_scaling_dim, "w": self.w_block_scaling_dim, "grad": self.grad_block_scaling_dim}
        for role, dim in dims.items():
            if isinstance(dim, bool) or dim not in (1, 2):
                raise ValueError(f"Float8BlockScaling: {role}_block_scaling_dim must be 1 (1x128 blocks) or 2 "
                                 f"(128x128); got {dim!r}")
        for a, b in (("x", "w"), ("x", "grad"), ("w", "grad")):
            if dims[a] == 2 and dims[b] == 2:
                raise ValueError(f"Float8BlockScaling: {a}_block_scaling_dim=2 and {b}_block_scaling_dim=2: a GEMM "
                                 "of two 128x128-scaled operands is not supported (one of them must be 1)")
        for field in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            if not getattr(self, field).use_split_accumulator:
                raise ValueError(f"Float8BlockScaling: {field}.use_split_accumulator must be True (block-scaled "
                                 "GEMMs promote to fp32 per block)")

    def block_dim(self, role: str) -> int:
        """1 or 2 for "input", "weight" or "grad_output"."""
        return {"input": self.x_block_scaling_dim, "weight": self.w_block_scaling_dim,
                "grad_output": self.grad_block_scaling_dim}[role]


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8 (OCP microscaling): a power-of-2 (E8M0) scale per 1 x 32 block along the contraction
    dimension, for every operand (each quantized along both directions from high precision).
    Needs a GPU of compute capability 10.x (Blackwell); :func:`tachyon.autocast` refuses it
    elsewhere, naming the device. fp8_format: Format.E4M3 (default) or Format.HYBRID. margin:
    only 0 (Transformer Engine's field, unused by its MXFP8 too). fp8_dpa, fp8_mha: only False.
    backward_override: only None.
    """

    name = "mxfp8"
    blockwise = True

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None

    block_size = 32
    x_block_scaling_dim = w_block_scaling_dim = grad_block_scaling_dim = 1
    fp8_quant_fwd_inp = fp8_quant_fwd_weight = fp8_quant_bwd_grad = QParams(power_2_scale=True)
    fp8_gemm_fprop = fp8_gemm_dgrad = fp8_gemm_wgrad = MMParams(use_split_accumulator=True)

    def __post_init__(self) -> None:
        _check_common(self)
        if self.margin != 0 or isinstance(self.margin, bool):
            raise ValueError(f"MXFP8BlockScaling: margin must be 0; got {self.margin!r}")

    def block_dim(self, role: str) -> int:
        return 1


RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling, "block": Float8BlockScaling,
           "mxfp8": MXFP8BlockScaling}
"""Short name -> recipe class (the names ``tachyon train --fp8`` takes)."""

__all__ = ["AMAX_ALGOS", "FP8_E4M3", "FP8_E5M2", "FP8_MAX", "RECIPES", "DelayedScaling", "Float8BlockScaling",
           "Float8CurrentScaling", "Format", "MMParams", "MXFP8BlockScaling", "QParams", "Recipe"]

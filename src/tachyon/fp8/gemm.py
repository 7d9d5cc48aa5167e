"""FP8 casts and the FP8 GEMM: native ``torch._scaled_mm`` on compute capability >= 8.9, else exact
emulation (the same numerics on any device, so CPU tests check them).

    x8 = cast_to_fp8(x, scale, torch.float8_e4m3fn)        # saturating: clamp to +-448, then cast
    out = fp8_gemm(x8, x_scale_inv, w8, w_scale_inv, torch.bfloat16)   # = (x8*sx) @ (w8*sw).T

Emulation: the FP8 operands are cast to fp32 and multiplied by their scale_inv, and the matmul
runs in fp32 (the tensor cores also accumulate in fp32); the result is cast to ``out_dtype``.
Every GEMM dimension must be a multiple of 16, as Transformer Engine and the FP8 tensor cores
require; the rule is enforced in emulation too, so behaviour does not depend on the machine.
"""

from __future__ import annotations

import torch

from tachyon.backend import resolve
from tachyon.kernels.fp8_cast import cast_to_fp8 as fused_cast_to_fp8
from tachyon.kernels.fp8_cast.reference import FP8_DTYPES, FP8_MAX, cast_to_fp8_torch, update_amax

FP8_ALIGNMENT = 16


def native_fp8_supported(device: torch.device) -> bool:
    """True where torch._scaled_mm runs FP8 GEMMs on tensor cores (CUDA, compute capability >= 8.9)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def check_fp8_dims(op: str, **dims: int) -> None:
    """ValueError naming the first dimension that is not a multiple of 16."""
    for name, size in dims.items():
        if size % FP8_ALIGNMENT:
            raise ValueError(
                f"{op}: {name}={size} is not a multiple of {FP8_ALIGNMENT}; FP8 GEMMs need every "
                f"dimension (in_features, out_features and the flattened token count) to be a multiple "
                f"of {FP8_ALIGNMENT} (as in Transformer Engine); pad it, or run this module outside fp8_autocast"
            )


def cast_to_fp8(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, amax: torch.Tensor | None = None, *,
    transpose: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x * scale, clamped to +-fp8_max (saturating, never inf), cast to ``fp8_dtype``.

    x: any float dtype and shape ([M, N] when ``transpose``); scale: fp32 0-dim tensor. Returns
    ``fp8_dtype``, x's shape, contiguous; or (x8, x8.T contiguous) when ``transpose``. NaN stays
    NaN. amax: None, or an fp32 0-dim tensor updated in place to max(amax, max |x|) (how a
    ScalingState records; pass ``state.amax_history[0]``).

    Where the backend is Triton (CUDA tensors under the "auto" backend) this is one fused kernel
    (tachyon.kernels.fp8_cast: one read of x for the cast, the amax and the transposed copy);
    elsewhere PyTorch's own conversion, which gives the same bits.
    """
    if fp8_dtype not in FP8_MAX:
        raise ValueError(f"cast_to_fp8: fp8_dtype={fp8_dtype} is not an FP8 dtype; allowed: {FP8_DTYPES}")
    if x.dim() and resolve(x) == "triton":
        return fused_cast_to_fp8(x, scale, fp8_dtype, amax, transpose=transpose, backend="triton")
    if amax is not None:
        update_amax(amax, x)  # NaN propagates
    x8 = cast_to_fp8_torch(x.detach(), scale, fp8_dtype)
    if transpose:
        if x8.dim() != 2:
            raise ValueError(f"cast_to_fp8: transpose=True needs a 2-D x; got shape {tuple(x.shape)}")
        return x8, x8.t().clone(memory_format=torch.contiguous_format)
    return x8


def cast_from_fp8(x8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x8 (an FP8 tensor) * scale_inv, in ``dtype`` (the product is formed in fp32)."""
    return (x8.to(torch.float32) * scale_inv).to(dtype)


def _check_operand(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_gemm: {name} has dtype {t.dtype}; expected an FP8 dtype {FP8_DTYPES}")
    if t.dim() != 2:
        raise ValueError(f"fp8_gemm: {name} must be 2-D; got shape {tuple(t.shape)}")


def fp8_gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    native: bool | None = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """out [M, N] = (a * a_scale_inv) @ (b * b_scale_inv).T in ``out_dtype``.

    a: [M, K], b: [N, K], FP8 (any layout; transposed views are fine). a_scale_inv, b_scale_inv:
    fp32 0-dim. M, N, K must be multiples of 16. ``native``: None picks torch._scaled_mm where
    the device supports it; False forces the emulation; True demands the native path.
    E5M2 x E5M2 is not a combination the FP8 tensor cores take; this GEMM accepts it only emulated.
    use_fast_accum: torch._scaled_mm's fast FP8 accumulation (a recipe's
    ``use_split_accumulator=False``); the emulation always accumulates in fp32.
    """
    _check_operand("a", a)
    _check_operand("b", b)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_gemm: a is {tuple(a.shape)} and b is {tuple(b.shape)}; their second dims (K) must match")
    m, k = a.shape
    n = b.shape[0]
    check_fp8_dims("fp8_gemm", M=m, N=n, K=k)
    supported = native_fp8_supported(a.device)
    if native is None:
        native = supported and not (a.dtype == b.dtype == torch.float8_e5m2)
    elif native and not supported:
        raise ValueError(f"fp8_gemm: native=True needs a CUDA device of compute capability >= 8.9; a is on {a.device}")
    if native:
        # _scaled_mm wants mat1 row-major [M, K] and mat2 column-major [K, N]
        return torch._scaled_mm(
            a.contiguous(), b.contiguous().t(), scale_a=a_scale_inv.reshape(()).float(),
            scale_b=b_scale_inv.reshape(()).float(), out_dtype=out_dtype, use_fast_accum=use_fast_accum,
        )
    a32 = a.to(torch.float32) * a_scale_inv
    b32 = b.to(torch.float32) * b_scale_inv
    return (a32 @ b32.t()).to(out_dtype)


__all__ = ["FP8_ALIGNMENT", "cast_from_fp8", "cast_to_fp8", "check_fp8_dims", "fp8_gemm", "native_fp8_supported"]

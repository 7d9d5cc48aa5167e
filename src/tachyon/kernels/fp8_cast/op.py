"""The fused FP8 cast + amax (+ transpose) op: validation, backend choice, torch.library registration.

    x8 = cast_to_fp8(x, scale, torch.float8_e4m3fn)                    # cast only
    x8 = cast_to_fp8(x, scale, torch.float8_e4m3fn, amax)              # + amax = max(amax, max|x|)
    x8, x8_t = cast_to_fp8(x, scale, torch.float8_e5m2, amax, transpose=True)   # + x8.T contiguous

x8 = fp8(clamp(x.float() * scale, -fp8_max, fp8_max)), round to nearest even, bit-identical to
``(x.float() * scale).clamp(-m, m).to(fp8_dtype)`` on either backend (reference.py says how).
It is what Transformer Engine's "cast + amax (+ transpose)" kernel does for delayed scaling: the
tensor is read once, the amax for the scale update is recorded in the same pass, and the
transposed copy that an FP8 GEMM of the backward pass needs (torch._scaled_mm takes a row-major
first and a column-major second operand) is written without a second read.

Registered as the custom op ``tachyon::fp8_cast`` (mutating ``amax``) with a fake implementation,
so torch.compile traces it. No autograd: a cast to FP8 is not differentiated; x is detached.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tachyon.backend import resolve
from tachyon.kernels.common import SUPPORTED_DTYPES, check_dtype, check_same_device
from tachyon.kernels.fp8_cast import reference
from tachyon.kernels.fp8_cast.reference import FP8_DTYPES, FP8_MAX
from tachyon.kernels.registry import fused_op

OP = "cast_to_fp8"


@fused_op("tachyon::fp8_cast", mutates_args=("amax",), triton_op=True)
def _fp8_cast(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax: Tensor | None, transpose: bool, backend: str,
) -> tuple[Tensor, Tensor]:
    """x: contiguous, or [M, N] with any strides when ``transpose``. Returns (x8, x8_t or an empty
    tensor); amax (when given) is updated in place."""
    if backend == "triton":
        from tachyon.kernels.fp8_cast import triton as tri

        x8, x8_t = tri.cast_to_fp8(x, scale, fp8_dtype, amax, transpose)
    else:
        out = reference.cast_to_fp8(x, scale, fp8_dtype, amax, transpose=transpose)
        x8, x8_t = out if transpose else (out, None)
    return x8, (x8_t if x8_t is not None else x.new_empty(0, dtype=fp8_dtype))


@_fp8_cast.register_fake
def _(x, scale, fp8_dtype, amax, transpose, backend):
    x8 = x.new_empty(x.shape, dtype=fp8_dtype)
    x8_t = x.new_empty((x.shape[1], x.shape[0]), dtype=fp8_dtype) if transpose else x.new_empty(0, dtype=fp8_dtype)
    return x8, x8_t


def _check_scalar(name: str, t: object) -> None:
    if not isinstance(t, Tensor) or t.dim() != 0 or t.dtype != torch.float32:
        got = (f"a {t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__)
        raise ValueError(f"{OP}: {name} must be a 0-dim float32 tensor; got {got}")


def cast_to_fp8(
    x: Tensor,
    scale: Tensor,
    fp8_dtype: torch.dtype,
    amax: Tensor | None = None,
    *,
    transpose: bool = False,
    backend: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Cast ``x`` to FP8 with ``scale``, saturating, and record its amax, in one pass.

    x: float32/float16/bfloat16, any shape; [M, N] when ``transpose``.
    scale: float32 0-dim tensor on x's device (x is multiplied by it in fp32).
    fp8_dtype: torch.float8_e4m3fn (max 448) or torch.float8_e5m2 (max 57344).
    amax: None, or a float32 0-dim tensor on x's device, updated in place to max(amax, max |x|)
    (NaN or inf in x makes it NaN or inf, as torch.amax would; an empty x leaves it unchanged).
    Returns x8 (fp8_dtype, x's shape, contiguous) or, when ``transpose``, (x8, x8_t) with
    x8_t = x8.T contiguous [N, M]. Saves nothing (no autograd).
    backend: "triton", "torch" or None/"auto" (see tachyon.backend); both give identical bits.
    """
    if not isinstance(x, Tensor):
        raise ValueError(f"{OP}: x must be a tensor; got {type(x).__name__}")
    check_dtype(OP, "x", x, SUPPORTED_DTYPES)
    if fp8_dtype not in FP8_MAX:
        allowed = ", ".join(str(d) for d in FP8_DTYPES)
        raise ValueError(f"{OP}: fp8_dtype={fp8_dtype!r} is not a supported FP8 dtype; allowed: {allowed}")
    _check_scalar("scale", scale)
    if amax is not None:
        _check_scalar("amax", amax)
    if not isinstance(transpose, bool):
        raise ValueError(f"{OP}: transpose must be True or False; got {transpose!r}")
    if transpose and x.dim() != 2:
        raise ValueError(f"{OP}: transpose=True needs a 2-D x [M, N]; got shape {tuple(x.shape)}")
    check_same_device(OP, x=x, scale=scale, amax=amax)
    chosen = resolve(x, backend)
    if chosen == "triton" and transpose:
        from tachyon.kernels.fp8_cast import triton as tri

        block_n = tri.tile_config(x.device)[1]
        if -(-x.shape[1] // block_n) > tri.MAX_GRID_Y:
            raise ValueError(f"{OP}: transpose=True on the Triton backend takes x with at most "
                             f"{tri.MAX_GRID_Y * block_n} columns; got {x.shape[1]} (use backend='torch')")
    x = x.detach()
    if not transpose:
        x = x.contiguous()
    x8, x8_t = _fp8_cast(x, scale, fp8_dtype, amax, transpose, chosen)
    return (x8, x8_t) if transpose else x8


__all__ = ["FP8_DTYPES", "FP8_MAX", "cast_to_fp8"]

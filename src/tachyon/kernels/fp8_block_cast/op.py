"""The block-scaled FP8 cast op: validation, backend choice, torch.library registration.

    data, scale_inv, data_t, scale_inv_t = block_cast_to_fp8(x, torch.float8_e4m3fn, 128, rows=True, cols=True)

What it computes is reference.py's docstring: per block of 1 x S (rows), S x 1 (cols, returned
transposed) or S x S (square) values, Transformer Engine's scale of the block's amax and the
saturating cast; both directions from one read of x on the Triton backend. Registered as the
custom op ``tachyon::fp8_block_cast`` with a fake implementation, so torch.compile traces it. No
autograd: x is detached; nothing is saved.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tachyon.backend import resolve
from tachyon.kernels.common import SUPPORTED_DTYPES, check_dtype
from tachyon.kernels.fp8_block_cast import reference
from tachyon.kernels.fp8_cast.reference import FP8_DTYPES, FP8_MAX
from tachyon.kernels.registry import fused_op

OP = "block_cast_to_fp8"
BLOCK_SIZES = (32, 128)


@fused_op("tachyon::fp8_block_cast", mutates_args=(), triton_op=True)
def _fp8_block_cast(x: Tensor, fp8_dtype: torch.dtype, block_size: int, square: bool, rows: bool, cols: bool,
                    power_2_scale: bool, amax_epsilon: float, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if backend == "triton":
        from tachyon.kernels.fp8_block_cast import triton as tri

        return tri.block_cast(x, fp8_dtype, block_size, square, rows, cols, power_2_scale, amax_epsilon)
    return reference.block_cast(x, fp8_dtype, block_size, square=square, rows=rows, cols=cols,
                                power_2_scale=power_2_scale, amax_epsilon=amax_epsilon)


@_fp8_block_cast.register_fake
def _(x, fp8_dtype, block_size, square, rows, cols, power_2_scale, amax_epsilon, backend):
    r, c = x.shape
    nr, nc = -(-r // block_size), -(-c // block_size)
    want_rows = rows or square
    data = x.new_empty((r, c) if want_rows else (0,), dtype=fp8_dtype)
    scale_inv = x.new_empty(((nr, nc) if square else (r, nc)) if want_rows else (0,), dtype=torch.float32)
    data_t = x.new_empty((c, r) if cols else (0,), dtype=fp8_dtype)
    scale_inv_t = x.new_empty(((nc, nr) if square else (c, nr)) if cols else (0,), dtype=torch.float32)
    return data, scale_inv, data_t, scale_inv_t


@fused_op("tachyon::fp8_scale_from_amax", mutates_args=(), triton_op=True)
def _fp8_scale_from_amax(amax: Tensor, fp8_max: float, power_2_scale: bool, amax_epsilon: float,
                         value_for_inf: float, backend: str) -> tuple[Tensor, Tensor]:
    if backend == "triton":
        from tachyon.kernels.fp8_block_cast import triton as tri

        return tri.scale_from_amax(amax, fp8_max, power_2_scale, amax_epsilon, value_for_inf)
    scale = reference.block_scale(amax, fp8_max, power_2_scale, amax_epsilon, value_for_inf)
    return scale, scale.reciprocal()


@_fp8_scale_from_amax.register_fake
def _(amax, fp8_max, power_2_scale, amax_epsilon, value_for_inf, backend):
    return amax.new_empty(()), amax.new_empty(())


def scale_from_amax(amax: Tensor, fp8_max: float, *, power_2_scale: bool = False, amax_epsilon: float = 0.0,
                    value_for_inf: float = reference.FP32_MAX, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """(scale, scale_inv) of a 0-dim fp32 amax by Transformer Engine's rule (reference.block_scale):
    per-tensor current scaling's scale, one launch on the Triton backend (about eight small ops
    on the PyTorch one). Returns two fp32 0-dim tensors on amax's device; no autograd."""
    if not isinstance(amax, Tensor) or amax.dim() != 0 or amax.dtype != torch.float32:
        raise ValueError(f"scale_from_amax: amax must be a 0-dim float32 tensor; got {amax!r}")
    if not amax_epsilon >= 0:
        raise ValueError(f"scale_from_amax: amax_epsilon must be >= 0; got {amax_epsilon!r}")
    return _fp8_scale_from_amax(amax.detach(), float(fp8_max), bool(power_2_scale), float(amax_epsilon),
                                float(value_for_inf), resolve(amax, backend))


def block_cast_to_fp8(
    x: Tensor, fp8_dtype: torch.dtype, block_size: int = 128, *, square: bool = False, rows: bool = True,
    cols: bool = False, power_2_scale: bool = True, amax_epsilon: float = 0.0, backend: str | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Cast x [R, C] (fp32/fp16/bf16) to FP8 with one scale per block (reference.py says how).

    block_size: 128 (Float8BlockScaling) or 32 (MXFP8). square: S x S blocks; else ``rows`` (1 x S)
    and/or ``cols`` (S x 1). Returns (data [R, C] FP8, scale_inv fp32, data_t [C, R] FP8,
    scale_inv_t fp32); the outputs not asked for are empty. backend: "triton", "torch" or
    None/"auto"; both give the same bits. Saves nothing (no autograd)."""
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError(f"{OP}: x must be a 2-D tensor [R, C]; got {tuple(x.shape) if isinstance(x, Tensor) else x!r}")
    check_dtype(OP, "x", x, SUPPORTED_DTYPES)
    if fp8_dtype not in FP8_MAX:
        raise ValueError(f"{OP}: fp8_dtype={fp8_dtype!r} is not a supported FP8 dtype; allowed: "
                         f"{', '.join(str(d) for d in FP8_DTYPES)}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"{OP}: block_size={block_size!r}; allowed: {BLOCK_SIZES}")
    if not (square or rows or cols):
        raise ValueError(f"{OP}: nothing to compute: pass square=True, rows=True or cols=True")
    if not amax_epsilon >= 0:
        raise ValueError(f"{OP}: amax_epsilon must be >= 0; got {amax_epsilon!r}")
    chosen = resolve(x, backend)
    return _fp8_block_cast(x.detach(), fp8_dtype, int(block_size), bool(square), bool(rows), bool(cols),
                           bool(power_2_scale), float(amax_epsilon), chosen)


__all__ = ["BLOCK_SIZES", "block_cast_to_fp8", "scale_from_amax"]

"""Scales and casts of the stateless recipes: per-tensor current scaling and block scaling.

    scale, scale_inv = current_scale(x, fp8_max, qparams)            # 0-dim fp32, from max |x|
    q = quantize_blocks(x, torch.float8_e4m3fn, (1, 128), qparams)   # BlockQuantized
    x_approx = dequantize(q)                                         # fp32, x's shape

The scale of an amax a (Transformer Engine's ``compute_scale_from_amax``, elementwise):

    a      = max(a, amax_epsilon)
    scale  = 1                               a is 0, inf or NaN
           = min(fp8_max / a, value_for_inf)  otherwise (value_for_inf: the largest finite value of
                                              fp32 for current scaling, of the input dtype for blocks)
    scale  = 2 ** floor(log2(scale))         with power_2_scale (the fp32 mantissa bits cleared)
    scale_inv = 1 / scale                    (exact for powers of 2)

A block-quantized tensor t [R, C] with blocks of br x bc values keeps ``data`` (FP8, [R, C],
row-major), ``scale_inv`` (fp32, [ceil(R / br), ceil(C / bc)]) and ``block`` = (br, bc); block
(i, j) covers rows [i br, (i+1) br) and columns [j bc, (j+1) bc) (the last ones partial when br or
bc does not divide the size; their missing values count as zeros). The GEMMs take operands
whose blocks run along their columns (the contraction dimension): (1, 128), (128, 128), (1, 32).
A tensor quantized along its columns (blocks (128, 1), for the weight-gradient GEMM) is turned
into that form by :func:`as_rows_of_transpose`, which transposes the FP8 data (one byte per
value), never the high-precision tensor.

On the GPU the per-tensor cast is tachyon's fused cast kernel (reading x once, writing x8 and
its transpose) after one amax reduction over x; the block casts of a GEMM operand are one
Triton kernel (tachyon.kernels.fp8_block_cast: both directions from one read; its PyTorch
reference elsewhere, the same bits), through :func:`quantize_operand`.
"""

from __future__ import annotations

import torch

from tachyon.fp8.recipe import FP8_MAX, QParams
from tachyon.kernels.fp8_block_cast import block_cast_to_fp8, scale_from_amax
from tachyon.kernels.fp8_block_cast.reference import FP32_MAX, block_scale
from tachyon.kernels.fp8_block_cast.reference import quantize as _quantize


def compute_scale(amax: torch.Tensor, fp8_max: float, qparams: QParams, value_for_inf: float = FP32_MAX) -> torch.Tensor:
    """The scale of each amax (any shape, fp32) by the rule in the module docstring."""
    return block_scale(amax, fp8_max, qparams.power_2_scale, qparams.amax_epsilon, value_for_inf)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an fp32 0-dim tensor, in one reduction (NaN anywhere gives NaN); 0 for an empty x."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.linalg.vector_norm(x.detach(), float("inf"), dtype=torch.float32)


def current_scale(x: torch.Tensor, fp8_max: float, qparams: QParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) of x under per-tensor current scaling: 0-dim fp32 on x's device. Two
    launches on a GPU: the amax reduction and one small kernel for the scale (the Triton backend)."""
    return scale_from_amax(tensor_amax(x), fp8_max, power_2_scale=qparams.power_2_scale,
                           amax_epsilon=qparams.amax_epsilon)


class BlockQuantized:
    """A block-scaled FP8 tensor (module docstring): ``data`` [R, C] FP8, ``scale_inv`` fp32
    [ceil(R / br), ceil(C / bc)], ``block`` (br, bc). shape / dtype / device are the data's."""

    __slots__ = ("block", "data", "scale_inv")

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
        self.data, self.scale_inv, self.block = data, scale_inv, block

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def __repr__(self) -> str:
        return f"BlockQuantized({self.data.dtype}, shape={tuple(self.data.shape)}, block={self.block})"


@torch.no_grad()
def quantize_blocks(t: torch.Tensor, fp8_dtype: torch.dtype, block: tuple[int, int], qparams: QParams) -> BlockQuantized:
    """t [R, C] (fp32/fp16/bf16) -> BlockQuantized with one scale per ``block`` = (br, bc), any
    block shape (the PyTorch path).

    Each block: amax, scale (module docstring; value_for_inf the largest finite value of t's
    dtype, as Transformer Engine), fp8(clamp(t * scale, +-fp8_max)) rounded to nearest even.
    No autograd; nothing saved."""
    if t.dim() != 2:
        raise ValueError(f"quantize_blocks: t must be 2-D; got shape {tuple(t.shape)}")
    if fp8_dtype not in FP8_MAX:
        raise ValueError(f"quantize_blocks: fp8_dtype={fp8_dtype} is not an FP8 dtype")
    data, scale_inv = _quantize(t, fp8_dtype, block, qparams.power_2_scale, qparams.amax_epsilon)
    return BlockQuantized(data, scale_inv, block)


def quantize_operand(t: torch.Tensor, fp8_dtype: torch.dtype, dim: int, size: int, qparams: QParams, *, rows: bool,
                     cols: bool) -> tuple[BlockQuantized | None, BlockQuantized | None]:
    """A GEMM operand t [R, C] quantized for what uses it, in one cast (one read of t on the GPU):
    (t for a GEMM summing over its columns: data [R, C]; t for one summing over its rows, in
    transposed form: data [C, R]), each only when asked. dim 2: size x size blocks, whose one
    quantization serves both (the second is its exact transpose); dim 1: 1 x size blocks along
    each direction, each computed from t."""
    square = dim == 2
    data, scale_inv, data_t, scale_inv_t = block_cast_to_fp8(
        t, fp8_dtype, size, square=square, rows=rows, cols=cols, power_2_scale=qparams.power_2_scale,
        amax_epsilon=qparams.amax_epsilon)
    block = (size, size) if square else (1, size)
    return (BlockQuantized(data, scale_inv, block) if rows else None,
            BlockQuantized(data_t, scale_inv_t, block) if cols else None)


def as_rows_of_transpose(q: BlockQuantized) -> BlockQuantized:
    """The same quantized values as the transpose [C, R], blocks (bc, br): exact (the FP8 data is
    transposed, nothing is quantized again)."""
    br, bc = q.block
    return BlockQuantized(q.data.t().contiguous(), q.scale_inv.t().contiguous(), (bc, br))


def dequantize(q: BlockQuantized) -> torch.Tensor:
    """data * scale_inv of each block, fp32 [R, C] (exact for power-of-2 scales)."""
    rows, cols = q.data.shape
    br, bc = q.block
    if rows % br == 0 and cols % bc == 0:
        view = q.data.float().view(rows // br, br, cols // bc, bc)
        return (view * q.scale_inv[:, None, :, None]).view(rows, cols)
    scale = q.scale_inv
    if br > 1:
        scale = scale.repeat_interleave(br, dim=0)[:rows]
    if bc > 1:
        scale = scale.repeat_interleave(bc, dim=1)[:, :cols]
    return q.data.float() * scale


__all__ = ["BlockQuantized", "FP32_MAX", "as_rows_of_transpose", "compute_scale", "current_scale", "dequantize",
           "quantize_blocks", "quantize_operand", "tensor_amax"]

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
its transpose) after one amax reduction over x; the block casts are the PyTorch ops below.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tachyon.fp8.recipe import FP8_MAX, QParams

FP32_MAX = torch.finfo(torch.float32).max
_MANTISSA_CLEARED = -0x800000  # int32 0xFF800000: sign and exponent bits of an fp32


_CONSTANTS: dict[tuple[float, torch.device], torch.Tensor] = {}


def _constant(value: float, device: torch.device) -> torch.Tensor:
    """A cached fp32 0-dim tensor holding ``value`` on ``device`` (no fill or copy per call)."""
    key = (value, device)
    tensor = _CONSTANTS.get(key)
    if tensor is None:
        tensor = _CONSTANTS[key] = torch.tensor(value, dtype=torch.float32, device=device)
    return tensor


def compute_scale(amax: torch.Tensor, fp8_max: float, qparams: QParams, value_for_inf: float = FP32_MAX) -> torch.Tensor:
    """The scale of each amax (any shape, fp32) by the rule in the module docstring."""
    if qparams.amax_epsilon > 0:
        amax = torch.clamp_min(amax, qparams.amax_epsilon)  # NaN stays NaN
    # a tensor over a tensor: the correctly rounded quotient (a float over a tensor is computed
    # as a reciprocal times the float in torch, which can differ in the last bit)
    candidate = torch.clamp_max(_constant(fp8_max, amax.device) / amax, value_for_inf)
    scale = torch.where((amax > 0) & (amax < float("inf")), candidate, _constant(1.0, amax.device))  # NaN fails both
    if qparams.power_2_scale:
        scale = (scale.view(torch.int32) & _MANTISSA_CLEARED).view(torch.float32)
    return scale


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an fp32 0-dim tensor, in one reduction (NaN anywhere gives NaN); 0 for an empty x."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.linalg.vector_norm(x.detach(), float("inf"), dtype=torch.float32)


def current_scale(x: torch.Tensor, fp8_max: float, qparams: QParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) of x under per-tensor current scaling: 0-dim fp32 on x's device."""
    scale = compute_scale(tensor_amax(x), fp8_max, qparams)
    return scale, scale.reciprocal()


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


def _blocks_view(t: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """t [R, C] -> [R / br, br, C / bc, bc] (zero-padded to whole blocks where needed)."""
    rows, cols = t.shape
    br, bc = block
    pad_r, pad_c = -rows % br, -cols % bc
    if pad_r or pad_c:
        t = F.pad(t, (0, pad_c, 0, pad_r))
    return t.reshape((rows + pad_r) // br, br, (cols + pad_c) // bc, bc), (pad_r, pad_c)


@torch.no_grad()
def quantize_blocks(t: torch.Tensor, fp8_dtype: torch.dtype, block: tuple[int, int], qparams: QParams) -> BlockQuantized:
    """t [R, C] (fp32/fp16/bf16) -> BlockQuantized with one scale per ``block`` = (br, bc).

    Each block: amax, scale (module docstring; value_for_inf the largest finite value of t's
    dtype, as Transformer Engine), fp8(clamp(t * scale, +-fp8_max)) rounded to nearest even.
    No autograd; nothing saved."""
    if t.dim() != 2:
        raise ValueError(f"quantize_blocks: t must be 2-D; got shape {tuple(t.shape)}")
    fp8_max = FP8_MAX[fp8_dtype]
    blocks, (pad_r, pad_c) = _blocks_view(t.detach(), block)
    blocks = blocks.float()
    amax = blocks.abs().amax(dim=(1, 3))  # [R / br, C / bc]
    scale = compute_scale(amax, fp8_max, qparams, torch.finfo(t.dtype).max)
    scaled = blocks * scale[:, None, :, None]
    data = scaled.clamp(-fp8_max, fp8_max).to(fp8_dtype)
    rows, cols = t.shape
    data = data.reshape(rows + pad_r, cols + pad_c)
    if pad_r or pad_c:
        data = data[:rows, :cols].contiguous()
    return BlockQuantized(data, scale.reciprocal(), block)


def as_rows_of_transpose(q: BlockQuantized) -> BlockQuantized:
    """The same quantized values as the transpose [C, R], blocks (bc, br): exact (the FP8 data is
    transposed, nothing is quantized again). Used for a tensor quantized along its columns (blocks
    (128, 1)) that a GEMM takes with the contraction along its rows, and for 128 x 128 blocks."""
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
           "quantize_blocks", "tensor_amax"]

"""PyTorch reference for the block-scaled FP8 cast: the CPU path and the oracle of the Triton kernel.

    data, scale_inv, data_t, scale_inv_t = block_cast(x, torch.float8_e4m3fn, 128, square=False,
                                                      rows=True, cols=True, power_2_scale=True)

x [R, C] (fp32/fp16/bf16) is cut into blocks of S values (S = ``block_size``) and each block is
cast with its own scale (Transformer Engine's compute_scale_from_amax; :func:`block_scale`):

    rows     blocks of 1 x S along each row       data [R, C],   scale_inv [R, ceil(C/S)]
    cols     blocks of S x 1 down each column,    data_t [C, R], scale_inv_t [C, ceil(R/S)]
             returned transposed (the layout a GEMM summing over R takes)
    square   blocks of S x S: data [R, C], scale_inv [ceil(R/S), ceil(C/S)]; with ``cols`` also
             their exact transpose data_t [C, R], scale_inv_t [ceil(C/S), ceil(R/S)]

A block's amax is max |x| over its values (NaN anywhere in it makes it NaN, hence scale 1); the
values a partial block lacks at the edges count as zeros. Each value becomes
fp8(clamp(x * scale, +-fp8_max)), round to nearest even (torch's cast: the same bits as
tachyon.kernels.fp8_cast); scale_inv = 1 / scale. Outputs not asked for are empty tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tachyon.kernels.fp8_cast.reference import FP8_MAX

FP32_MAX = torch.finfo(torch.float32).max
MANTISSA_CLEARED = -0x800000  # int32 0xFF800000: sign and exponent bits of an fp32
_CONSTANTS: dict[tuple[float, torch.device], torch.Tensor] = {}


def _constant(value: float, device: torch.device) -> torch.Tensor:
    """A cached fp32 0-dim tensor holding ``value`` on ``device`` (no fill or copy per call)."""
    key = (value, device)
    tensor = _CONSTANTS.get(key)
    if tensor is None:
        tensor = _CONSTANTS[key] = torch.tensor(value, dtype=torch.float32, device=device)
    return tensor


def block_scale(amax: torch.Tensor, fp8_max: float, power_2_scale: bool, amax_epsilon: float = 0.0,
                value_for_inf: float = FP32_MAX) -> torch.Tensor:
    """The scale of each fp32 amax: raised to ``amax_epsilon``; 1 for an amax of 0, inf or NaN;
    else fp8_max / amax (correctly rounded), ``value_for_inf`` where that overflows, and with
    ``power_2_scale`` rounded down to a power of 2 (mantissa bits cleared)."""
    if amax_epsilon > 0:
        amax = torch.clamp_min(amax, amax_epsilon)  # NaN stays NaN
    # a tensor over a tensor: the correctly rounded quotient (a float over a tensor is computed
    # as a reciprocal times the float in torch, which can differ in the last bit)
    candidate = torch.clamp_max(_constant(fp8_max, amax.device) / amax, value_for_inf)
    scale = torch.where((amax > 0) & (amax < float("inf")), candidate, _constant(1.0, amax.device))  # NaN fails both
    if power_2_scale:
        scale = (scale.view(torch.int32) & MANTISSA_CLEARED).view(torch.float32)
    return scale


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype, block: tuple[int, int], power_2_scale: bool,
             amax_epsilon: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(data [R, C], scale_inv [ceil(R/br), ceil(C/bc)]) of x [R, C] with blocks (br, bc) of any
    shape; the scale of a value that overflows is x's dtype's largest finite value."""
    rows, cols = x.shape
    br, bc = block
    pad_r, pad_c = -rows % br, -cols % bc
    t = x.detach()
    if pad_r or pad_c:
        t = F.pad(t, (0, pad_c, 0, pad_r))
    blocks = t.reshape((rows + pad_r) // br, br, (cols + pad_c) // bc, bc).float()
    amax = blocks.abs().amax(dim=(1, 3))
    fp8_max = FP8_MAX[fp8_dtype]
    scale = block_scale(amax, fp8_max, power_2_scale, amax_epsilon, torch.finfo(x.dtype).max)
    data = (blocks * scale[:, None, :, None]).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    data = data.reshape(rows + pad_r, cols + pad_c)
    if pad_r or pad_c:
        data = data[:rows, :cols].contiguous()
    return data, scale.reciprocal()


def block_cast(x: torch.Tensor, fp8_dtype: torch.dtype, block_size: int, *, square: bool, rows: bool, cols: bool,
               power_2_scale: bool, amax_epsilon: float = 0.0) -> tuple[torch.Tensor, ...]:
    """(data, scale_inv, data_t, scale_inv_t) as the module docstring says; empty where not asked."""
    empty8 = x.new_empty(0, dtype=fp8_dtype)
    empty32 = x.new_empty(0, dtype=torch.float32)
    size = block_size
    if square:
        data, scale_inv = quantize(x, fp8_dtype, (size, size), power_2_scale, amax_epsilon)
        if cols:
            return data, scale_inv, data.t().contiguous(), scale_inv.t().contiguous()
        return data, scale_inv, empty8, empty32
    data, scale_inv = quantize(x, fp8_dtype, (1, size), power_2_scale, amax_epsilon) if rows else (empty8, empty32)
    if cols:
        data_c, scale_c = quantize(x, fp8_dtype, (size, 1), power_2_scale, amax_epsilon)
        return data, scale_inv, data_c.t().contiguous(), scale_c.t().contiguous()
    return data, scale_inv, empty8, empty32

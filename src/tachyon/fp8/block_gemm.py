"""The block-scaled FP8 GEMM: torch._scaled_mm's blockwise scaling where this torch and GPU run it,
else exact emulation.

    out = block_gemm(a, b, torch.bfloat16)     # a, b: BlockQuantized; out = deq(a) @ deq(b).T

a: [M, K] with blocks (1, bs) or (bs, bs) along K, b: [N, K] likewise; bs is 128 (Float8BlockScaling)
or 32 (MXFP8). torch._scaled_mm (CUDA 12.9+, compute capability 9.0) takes 1x128 x 128x128,
128x128 x 1x128 and 1x128 x 1x128 with fp32 scales: a's [M, K/128] outer-dim-major or
[M/128, K/128] row-major, b's as [K/128, N] or [K/128, N/128] (the transposed layouts). Whether
it runs for a given pair of blocks and FP8 dtypes is found by trying it once per device on a
small GEMM (:func:`block_gemm_support`, cached; ``tachyon info`` prints the answer); where it
does not, and always for 1x32 blocks (whose E8M0 scales _scaled_mm wants in a swizzled layout)
and on CPU, the GEMM is emulated: each operand dequantized (exact for power-of-2 scales) and
multiplied in fp32, the accumulation the tensor cores also use between block promotions.
"""

from __future__ import annotations

import torch

from tachyon.fp8.gemm import check_fp8_dims
from tachyon.fp8.quantize import BlockQuantized, dequantize

_SUPPORT: dict[tuple, tuple[bool, str]] = {}
NATIVE_MULTIPLE = 128
"""The blockwise torch._scaled_mm runs GEMMs whose M, N and K are multiples of this (whole
blocks, as the probe's); others are emulated."""


def _native_scales(a: BlockQuantized, b: BlockQuantized) -> tuple[torch.Tensor, torch.Tensor]:
    """scale_a, scale_b in the layouts torch._scaled_mm's blockwise scaling checks for."""
    if a.block[0] == 1:  # [M, K/128], stride (1, M)
        scale_a = a.scale_inv.t().contiguous().t()
    else:  # [M/128, K/128] row-major
        scale_a = a.scale_inv.contiguous()
    if b.block[0] == 1:  # b [N, K] 1x128 -> [K/128, N] row-major
        scale_b = b.scale_inv.t().contiguous()
    else:  # b [N, K] 128x128 -> [K/128, N/128] with stride (1, K/128)
        scale_b = b.scale_inv.contiguous().t()
    return scale_a, scale_b


def _scaled_mm(a: BlockQuantized, b: BlockQuantized, out_dtype: torch.dtype) -> torch.Tensor:
    scale_a, scale_b = _native_scales(a, b)
    return torch._scaled_mm(a.data, b.data.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                            use_fast_accum=False)


def block_gemm_support(device: torch.device, a_block: tuple[int, int], b_block: tuple[int, int],
                       a_dtype: torch.dtype, b_dtype: torch.dtype) -> tuple[bool, str]:
    """(runs natively, what runs and why) for this pair of operand blocks and FP8 dtypes on
    ``device``. On CUDA devices of compute capability >= 9.0 torch._scaled_mm is tried once on a
    256 x 256 x 256 GEMM of zeros (outside CUDA-graph capture: ``tachyon.autocast`` does it when it
    opens, :func:`probe`); the answer is cached. GEMMs whose sizes are not multiples of 128 are
    emulated whatever the answer (:data:`NATIVE_MULTIPLE`)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"emulated on {device.type}: dequantized operands, fp32 matmul"
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, a_block, b_block, a_dtype, b_dtype)
    if key in _SUPPORT:
        return _SUPPORT[key]
    major, minor = torch.cuda.get_device_capability(index)
    if a_block[1] != 128 or b_block[1] != 128:
        answer = (False, f"emulated: {a_block[0]}x{a_block[1]} x {b_block[0]}x{b_block[1]} blocks (MXFP8's E8M0 "
                         "scales) are not passed to torch._scaled_mm by tachyon")
    elif (major, minor) < (9, 0):
        answer = (False, f"emulated: blockwise torch._scaled_mm needs compute capability 9.0+; this GPU is {major}.{minor}")
    elif a_block[0] == 128 and b_block[0] == 128:
        answer = (False, "emulated: 128x128 x 128x128 block GEMMs are not supported by torch._scaled_mm")
    elif torch.cuda.is_current_stream_capturing():
        raise RuntimeError("block_gemm_support: the blockwise torch._scaled_mm probe cannot run during CUDA-graph "
                           "capture; run one step (or enter tachyon.autocast) before capturing")
    else:
        size = 256
        a = BlockQuantized(torch.zeros(size, size, device=device).to(a_dtype),
                           torch.ones(size // a_block[0], size // 128, device=device), a_block)
        b = BlockQuantized(torch.zeros(size, size, device=device).to(b_dtype),
                           torch.ones(size // b_block[0], size // 128, device=device), b_block)
        try:
            _scaled_mm(a, b, torch.bfloat16)
            torch.cuda.synchronize(device)
            answer = (True, f"native: torch._scaled_mm blockwise {a_block[0]}x128 x {b_block[0]}x128 "
                            f"({str(a_dtype).removeprefix('torch.')} x {str(b_dtype).removeprefix('torch.')})")
        except (RuntimeError, NotImplementedError, ValueError) as error:
            reason = str(error).strip().splitlines()[0][:160]
            answer = (False, f"emulated: torch {torch.__version__}'s _scaled_mm refused {a_block[0]}x128 x "
                             f"{b_block[0]}x128 blocks on compute capability {major}.{minor} ({reason})")
    _SUPPORT[key] = answer
    return answer


def block_pairs(recipe) -> dict[str, tuple[tuple[int, int], tuple[int, int], torch.dtype, torch.dtype]]:
    """The three GEMMs of a block recipe: {"fprop", "dgrad", "wgrad"} -> (a's blocks, b's
    blocks, a's FP8 dtype, b's FP8 dtype), as tachyon.fp8.block_linear runs them."""
    size = recipe.block_size
    blocks = {role: (size, size) if recipe.block_dim(role) == 2 else (1, size)
              for role in ("input", "weight", "grad_output")}
    fwd, bwd = recipe.fp8_format.forward_dtype, recipe.fp8_format.backward_dtype
    return {"fprop": (blocks["input"], blocks["weight"], fwd, fwd),
            "dgrad": (blocks["grad_output"], blocks["weight"], bwd, fwd),
            "wgrad": (blocks["grad_output"], blocks["input"], bwd, fwd)}


def probe(recipe, device: torch.device | None = None) -> dict[str, tuple[bool, str]]:
    """:func:`block_gemm_support` for each GEMM of a block recipe on ``device`` (default: the
    current CUDA device): tries the blockwise torch._scaled_mm before it is needed (what
    ``tachyon.autocast`` does when it opens with a block recipe on a GPU, so that a later CUDA-graph
    capture finds the answer cached)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return {name: block_gemm_support(device, a, b, da, db) for name, (a, b, da, db) in block_pairs(recipe).items()}


def block_gemm(a: BlockQuantized, b: BlockQuantized, out_dtype: torch.dtype, *, native: bool | None = None) -> torch.Tensor:
    """out [M, N] = dequantize(a) @ dequantize(b).T in ``out_dtype`` (module docstring).

    a: [M, K], b: [N, K], blocks along K of one size. M, N, K must be multiples of 16.
    native: None picks torch._scaled_mm where :func:`block_gemm_support` says it runs; False
    forces the emulation; True demands the native path (ValueError where it does not run)."""
    if a.data.dim() != 2 or b.data.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"block_gemm: a is {tuple(a.shape)} and b is {tuple(b.shape)}; expected [M, K] and [N, K]")
    if a.block[1] != b.block[1] or a.block[0] not in (1, a.block[1]) or b.block[0] not in (1, b.block[1]):
        raise ValueError(f"block_gemm: blocks {a.block} and {b.block} do not both run along K with one size")
    m, k = a.shape
    n = b.shape[0]
    check_fp8_dims("block_gemm", M=m, N=n, K=k)
    if native is None or native:
        supported, reason = block_gemm_support(a.device, a.block, b.block, a.dtype, b.dtype)
        if supported and (m % NATIVE_MULTIPLE or n % NATIVE_MULTIPLE or k % NATIVE_MULTIPLE):
            supported, reason = False, (f"emulated: M={m}, N={n}, K={k} are not all multiples of {NATIVE_MULTIPLE} "
                                        "(the shapes the blockwise torch._scaled_mm probe covers)")
        if native and not supported:
            raise ValueError(f"block_gemm: native=True, but {reason}")
        native = supported
    if native:
        return _scaled_mm(a, b, out_dtype)
    return (dequantize(a) @ dequantize(b).t()).to(out_dtype)


__all__ = ["block_gemm", "block_gemm_support"]

"""Which GEMM path each FP8 recipe takes on a device: what ``tachyon info`` prints.

    tachyon.fp8.gemm_paths()
    # {"delayed": (True, "emulated on cpu: ..."), "current": (...), "block": (...), "mxfp8": (False, "...")}
"""

from __future__ import annotations

import torch

from tachyon.fp8.context import recipe_support
from tachyon.fp8.block_gemm import NATIVE_MULTIPLE, block_gemm_support, block_pairs
from tachyon.fp8.gemm import native_fp8_supported
from tachyon.fp8.recipe import Float8BlockScaling, MXFP8BlockScaling


def _per_tensor(device: torch.device) -> str:
    if native_fp8_supported(device):
        major, minor = torch.cuda.get_device_capability(device)
        return f"native: torch._scaled_mm with per-tensor scales (compute capability {major}.{minor})"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"emulated: compute capability {major}.{minor} has no FP8 tensor cores (needs 8.9+)"
    return f"emulated on {device.type}: cast to FP8 and back, fp32 matmul"


def _block(recipe, device: torch.device) -> str:
    """One line for the three GEMMs of a block recipe (their block pairs differ)."""
    answers = {name: block_gemm_support(device, a, b, da, db) for name, (a, b, da, db) in block_pairs(recipe).items()}
    reasons = {reason for _, reason in answers.values()}
    line = reasons.pop() if len(reasons) == 1 else "; ".join(f"{name} {reason}" for name, (_, reason) in answers.items())
    if any(runs for runs, _ in answers.values()):
        line += f" (GEMMs whose sizes are all multiples of {NATIVE_MULTIPLE}; others emulated)"
    return line


def gemm_paths(device: torch.device | str | None = None) -> dict[str, tuple[bool, str]]:
    """{"delayed", "current", "block", "mxfp8"} -> (the recipe runs here, what its GEMMs run on):
    native torch._scaled_mm or exact emulation, and for a refused recipe the reason. Default
    device: the current CUDA device, else CPU. On a GPU this tries the blockwise torch._scaled_mm
    once (cached)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    per_tensor = _per_tensor(device)
    out = {"delayed": (True, per_tensor),
           "current": (True, per_tensor + "; scales from each tensor's amax (one reduction, then the cast)"),
           "block": (True, "1x128 / 128x128 blocks: " + _block(Float8BlockScaling(), device))}
    runs, why = recipe_support(MXFP8BlockScaling(), device)
    out["mxfp8"] = (True, "1x32 blocks: " + _block(MXFP8BlockScaling(), device)) if runs else (False, why)
    return out


__all__ = ["gemm_paths"]


def _answer(runs: bool, reason: str, return_reason: bool) -> bool | tuple[bool, str]:
    return (runs, "" if runs else reason) if return_reason else runs


def is_fp8_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """Transformer Engine's query: True where FP8 GEMMs run on tensor cores (compute capability
    8.9+). tachyon also runs FP8 elsewhere, emulated (:func:`gemm_paths`)."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    runs = native_fp8_supported(device)
    return _answer(runs, "FP8 tensor cores need a GPU of compute capability 8.9+; tachyon emulates FP8 here "
                         f"({_per_tensor(device)})", return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """Transformer Engine's query: True where block-scaled GEMMs run natively (torch._scaled_mm's
    blockwise scaling; tried on this GPU). tachyon also runs them emulated (:func:`gemm_paths`)."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    reason = _block(Float8BlockScaling(), device)
    return _answer(reason.startswith("native"), reason, return_reason)


def is_mxfp8_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """Transformer Engine's query: True where MXFP8BlockScaling runs (compute capability 10.x)."""
    runs, why = recipe_support(MXFP8BlockScaling())
    return _answer(runs, why, return_reason)


__all__ += ["is_fp8_available", "is_fp8_block_scaling_available", "is_mxfp8_available"]

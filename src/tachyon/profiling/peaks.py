"""Peak FLOP/s to compute MFU (model FLOPs utilization = achieved FLOP/s / peak) against.

GPUs: the vendors' dense datasheet peaks (SXM parts, no sparsity), per dtype. Anything else (a
CPU, an unlisted GPU): the rate of a square matmul in that dtype, measured once per process,
device and dtype. fp32 on a GPU counts as TF32 when torch allows TF32 matmuls
(``torch.backends.cuda.matmul.allow_tf32``), as the GEMMs then run on tensor cores.
"""

from __future__ import annotations

import time

import torch

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "tf32": 494.5, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "tf32": 494.5, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
}
"""Dense datasheet peaks in TFLOP/s, keyed by a substring of ``torch.cuda.get_device_name()``."""

_DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_MEASURED: dict[tuple[str, torch.dtype], float] = {}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def measure_matmul_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, size: int = 1024,
                         repeats: int = 5) -> float:
    """The best FLOP/s of ``repeats`` [size, size] @ [size, size] matmuls (after one warm-up)."""
    device = torch.device(device)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / max(best, 1e-9)


def peak_flops(device: torch.device | str, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s, where the number comes from) for GEMMs in ``dtype`` on ``device``."""
    device = torch.device(device)
    name = _device_name(device)
    key = _DTYPE_KEYS.get(dtype, "fp32")
    if device.type == "cuda":
        if key == "fp32" and torch.backends.cuda.matmul.allow_tf32:
            key = "tf32"
        for gpu, row in PEAK_TFLOPS.items():
            if gpu in name and key in row:
                return row[key] * 1e12, f"{gpu} {key} datasheet"
    cache_key = (str(device), dtype)
    if cache_key not in _MEASURED:
        _MEASURED[cache_key] = measure_matmul_flops(device, dtype)
    return _MEASURED[cache_key], f"measured {str(dtype).replace('torch.', '')} matmul on {name}"


__all__ = ["PEAK_TFLOPS", "measure_matmul_flops", "peak_flops"]

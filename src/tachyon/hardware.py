"""Memory and bandwidth of the GPUs `tachyon plan` plans for; their peak FLOP/s come from the one
peak table, `tachyon.profiling.peaks.PEAK_TFLOPS` (which the flops profiler's MFU uses too).

    from tachyon.hardware import get_gpu
    h100 = get_gpu("h100")
    h100.peak_flops("bf16")        # dense FLOP/s, from tachyon.profiling.peaks
    h100.memory_bytes              # 80 GiB

Every figure is the vendor's datasheet number for the SXM (NVLink) board. Sources:

- H100 SXM5 80GB: NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100):
  80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s per GPU (both directions together).
- H200 SXM 141GB: NVIDIA H200 Tensor Core GPU product page (nvidia.com/en-us/data-center/h200):
  141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s.
- A100 SXM4 80GB: NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100):
  80 GB HBM2e at 2,039 GB/s; NVLink 600 GB/s per GPU.
- Inter-node network per GPU: DGX H100 / H200 systems have one 400 Gb/s (NDR InfiniBand)
  ConnectX-7 port per GPU = 50 GB/s each way; DGX A100 one 200 Gb/s (HDR) port per GPU = 25 GB/s
  (NVIDIA DGX H100 and DGX A100 user guides).

Memory capacities are the datasheets' "80 GB" / "141 GB", which count HBM in GiB (2**30 bytes).
The CUDA context and driver take some of it; `tachyon plan` subtracts a reserve for that.
"""

from __future__ import annotations

import dataclasses
import difflib

TFLOPS = 1e12
GIB = 2**30
GB_S = 1e9


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    """One GPU model: memory and link bandwidths (bytes/s, one direction); ``peak_key`` is its row
    in `tachyon.profiling.peaks.PEAK_TFLOPS`."""

    name: str
    peak_key: str
    memory_bytes: int
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    """NVLink bandwidth per GPU, one direction (half the datasheet's bidirectional figure)."""
    network_bytes_per_s: float
    """Inter-node bandwidth per GPU, one direction (the NIC attached to each GPU)."""
    gpus_per_node: int = 8
    source: str = ""

    @property
    def peak_flops_by_dtype(self) -> dict[str, float]:
        """dtype name -> dense FLOP/s of matmuls in that dtype (tensor cores where they exist)."""
        from tachyon.profiling.peaks import PEAK_TFLOPS

        return {dtype: tflops * TFLOPS for dtype, tflops in PEAK_TFLOPS[self.peak_key].items()}

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` ("fp8", "bf16", "fp16", "tf32", "fp32"); ValueError
        naming the dtypes this GPU has when it has no such tensor cores (FP8 on A100)."""
        peaks = self.peak_flops_by_dtype
        if dtype not in peaks:
            raise ValueError(f"{self.name} has no {dtype} peak (no such tensor cores); its dtypes: {sorted(peaks)}")
        return peaks[dtype]


GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec(
        name="NVIDIA H100 SXM5 80GB", peak_key="H100", memory_bytes=80 * GIB, hbm_bytes_per_s=3350 * GB_S,
        nvlink_bytes_per_s=450 * GB_S, network_bytes_per_s=50 * GB_S, source="NVIDIA H100 Tensor Core GPU datasheet",
    ),
    "h200": GPUSpec(
        name="NVIDIA H200 SXM 141GB", peak_key="H200", memory_bytes=141 * GIB, hbm_bytes_per_s=4800 * GB_S,
        nvlink_bytes_per_s=450 * GB_S, network_bytes_per_s=50 * GB_S,
        source="NVIDIA H200 Tensor Core GPU product page",
    ),
    "a100": GPUSpec(
        name="NVIDIA A100 SXM4 80GB", peak_key="A100", memory_bytes=80 * GIB, hbm_bytes_per_s=2039 * GB_S,
        nvlink_bytes_per_s=300 * GB_S, network_bytes_per_s=25 * GB_S, source="NVIDIA A100 Tensor Core GPU datasheet",
    ),
}
ALIASES = {"h100-sxm": "h100", "h100-80gb": "h100", "h200-sxm": "h200", "a100-80gb": "a100", "a100-sxm": "a100"}


def get_gpu(name: str) -> GPUSpec:
    """The spec for ``name`` (case-insensitive: "h100", "h200", "a100", or an alias); ValueError
    listing the known GPUs (with a did-you-mean) otherwise."""
    key = str(name).lower()
    key = ALIASES.get(key, key)
    if key not in GPUS:
        known = sorted([*GPUS, *ALIASES])
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown GPU {name!r}: known GPUs are {sorted(GPUS)} (aliases {sorted(ALIASES)}){hint}")
    return GPUS[key]


__all__ = ["ALIASES", "GIB", "GPUS", "GPUSpec", "get_gpu"]

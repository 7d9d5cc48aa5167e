"""What every benchmark script shares: timing, peak memory, hardware peaks, tables and CSV rows.

    from benchmarks.common import Timing, bench, peak_memory, print_table, write_csv, machine_info

Timing uses triton.testing.do_bench (CUDA events, L2 flushed between runs) when Triton and a GPU
are there, CUDA events otherwise, and perf_counter on CPU (CPU timings are noise; kept only so
scripts run anywhere). Results are the median with p20 and p80. Every CSV row carries the device,
torch/triton versions, git commit and date, so a result file says where it came from.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

# Dense peaks per GPU from the vendors' datasheets (SXM parts; no sparsity), for MFU and
# bandwidth fractions. Measured rates (measure_matmul_peak / measure_copy_bandwidth) are what
# results report against; these are the paper ceilings beside them. TFLOP/s and TB/s.
GPU_PEAKS: dict[str, dict[str, float]] = {
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "tf32": 494.5, "fp32": 67.0, "hbm_tbs": 3.35},
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "tf32": 494.5, "fp32": 67.0, "hbm_tbs": 4.8},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp8": 0.0, "tf32": 156.0, "fp32": 19.5, "hbm_tbs": 2.04},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp8": 242.0, "tf32": 60.0, "fp32": 30.3, "hbm_tbs": 0.3},
    "V100": {"bf16": 0.0, "fp16": 125.0, "fp8": 0.0, "tf32": 0.0, "fp32": 15.7, "hbm_tbs": 0.9},
}


def gpu_peaks(device_name: str | None = None) -> dict[str, float] | None:
    """The GPU_PEAKS row whose key appears in the device name (None when unknown or on CPU)."""
    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    for key, row in GPU_PEAKS.items():
        if key in device_name:
            return row
    return None


@dataclasses.dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    # GPU time alone: the median of the same call replayed from a CUDA graph (no host work between
    # kernels, L2 not flushed). None on CPU, where capture failed, or with TACHYON_BENCH_GRAPH=0.
    graph_ms: float | None = None
    # Host time alone: ms per call of 10 calls issued back to back without waiting for the GPU
    # (what Python, autograd and the launches cost; the GPU queue does not fill in 10 calls).
    host_ms: float | None = None

    def rate(self, amount: float) -> float:
        """amount per second at the median (e.g. FLOPs -> FLOP/s, bytes -> B/s)."""
        return amount / (self.median_ms * 1e-3)


def bench(fn: Callable[[], Any], *, warmup: int = 10, rep: int = 50, device: str | None = None) -> Timing:
    """Time ``fn`` (median, p20, p80 in ms). GPU: do_bench or CUDA events; CPU: perf_counter."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        try:
            import triton.testing

            p20, med, p80 = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.2, 0.5, 0.8])
            return Timing(med, p20, p80, graph_time(fn), host_time(fn))
        except ImportError:
            pass
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(rep):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(rep):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(times, n=10, method="inclusive")
    return Timing(statistics.median(times), q[1], q[7])


def host_time(fn: Callable[[], Any], calls: int = 10) -> float:
    """ms of host time per call: ``calls`` calls issued back to back, timed on the host without
    waiting for the GPU in between (a call that synchronizes includes the GPU's time)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e3


def graph_time(fn: Callable[[], Any]) -> float | None:
    """Median ms of ``fn`` replayed from a CUDA graph (triton.testing.do_bench_cudagraph): what the
    GPU spends, without the host time (Python, autograd, launches) that eager timing includes
    wherever the host is slower than the kernels. None where ``fn`` cannot be captured (the reason
    goes to stderr) or TACHYON_BENCH_GRAPH=0."""
    if os.environ.get("TACHYON_BENCH_GRAPH", "1") == "0" or not torch.cuda.is_available():
        return None
    try:
        import triton.testing

        return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))
    except Exception as exc:  # a call that syncs or allocates in a way capture refuses
        print(f"graph_time: not captured ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})", file=sys.stderr)
        try:
            torch.cuda.synchronize()
        except Exception:  # a capture that left the context unusable: no more graphs in this process
            os.environ["TACHYON_BENCH_GRAPH"] = "0"
            print("graph_time: CUDA context damaged by the failed capture; graph timing off from here", file=sys.stderr)
        return None


def peak_memory(fn: Callable[[], Any]) -> int:
    """Peak CUDA memory in bytes allocated while ``fn`` runs, above what was allocated before."""
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def measure_copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src))
    return t.rate(2 * src.numel() * src.element_size())


def measure_matmul_peak(dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float:
    """Measured dense matmul rate in FLOP/s on random data (n x n x n)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    t = bench(lambda: a @ b)
    return t.rate(2 * n**3)


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               cwd=Path(__file__).resolve().parent).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("TACHYON_COMMIT", "unknown")


def machine_info() -> dict[str, str]:
    """device, torch, triton, commit, date: the columns every CSV row starts with."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "device": device,
        "torch": torch.__version__,
        "triton": triton_version,
        "commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
    }


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A markdown table of ``rows`` (floats to 4 significant digits)."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())

    def cell(v: Any) -> str:
        if v is None:
            return ""
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    body = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(columns)]
    line = lambda cells: "| " + " | ".join(x.ljust(w) for x, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, title: str | None = None) -> None:
    if title:
        print(f"\n## {title}\n")
    print(format_table(rows, columns))


def write_csv(path: str | os.PathLike, rows: Sequence[dict[str, Any]], benchmark: str) -> None:
    """Append ``rows`` to the CSV at ``path``, each prefixed with benchmark name and machine_info()."""
    if not rows:
        return
    info = machine_info()
    full = [{"benchmark": benchmark, **info, **r} for r in rows]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    fields = list(full[0].keys())
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows(full)


def output_dir() -> Path:
    """Where scripts write: $TACHYON_BENCH_OUT (set by gpu.sh) or benchmarks/results/latest."""
    out = Path(os.environ.get("TACHYON_BENCH_OUT", Path(__file__).resolve().parent / "results" / "latest"))
    out.mkdir(parents=True, exist_ok=True)
    return out

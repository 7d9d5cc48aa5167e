"""What every benchmark script shares: timing, peak memory, hardware peaks, tables and CSV rows.

    from benchmarks.common import Timing, bench, peak_memory, print_table, write_csv, machine_info

Timing uses triton.testing.do_bench (CUDA events, L2 flushed between runs) when Triton and a GPU
are there, CUDA events otherwise, and perf_counter on CPU (CPU timings are noise; kept only so
scripts run anywhere). Results are the median with p20 and p80. Every CSV row carries the device,
torch/triton versions, git commit and date, so a result file says where it came from.

Rows stream: ``Stream`` prints each row as it is measured (flushed) and appends it to the CSV at once,
so a script cut off by its time limit keeps what it measured; the aligned table prints at the end.

Warm mode (``TACHYON_BENCH_WARM=1``, set by gpu.sh's warm phase): ``bench`` runs the callable
``WARM_CALLS`` times and returns a placeholder (NaN) timing, the peak-rate measurements return NaN
without running, ``peak_memory`` returns 0, and nothing is written to CSV. A script run that way
compiles every Triton kernel, autotuning config and torch.compile graph it would time, into the
on-disk caches, and measures nothing; the timed run after it starts warm.
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

WARM_ENV = "TACHYON_BENCH_WARM"
WARM_CALLS = 2  # calls of each timed callable in warm mode: the first compiles, the second replays caches
# graph_ms left empty for a callable that is already a CUDA graph: capturing it again would nest
# captures (torch refuses: "Cannot prepare for replay during capturing stage")
ALREADY_GRAPHED = "already a CUDA graph (make_graphed_callables): median_ms is its replay; not captured again"


def warm_mode() -> bool:
    """True when $TACHYON_BENCH_WARM is set (not empty, not "0"): compile, do not measure."""
    return os.environ.get(WARM_ENV, "0") not in ("", "0")


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
    # why graph_ms is empty where it is (not capturable, already a graph, warm mode); "" otherwise
    note: str = ""

    def columns(self) -> dict[str, Any]:
        """The timing columns every benchmark row carries."""
        return {"median_ms": self.median_ms, "p20_ms": self.p20_ms, "p80_ms": self.p80_ms, "graph_ms": self.graph_ms,
                "host_ms": self.host_ms, "note": self.note}

    def rate(self, amount: float) -> float:
        """amount per second at the median (e.g. FLOPs -> FLOP/s, bytes -> B/s)."""
        return amount / (self.median_ms * 1e-3)


def warm_run(fn: Callable[[], Any]) -> Timing:
    """Warm mode's stand-in for a measurement: ``fn`` called WARM_CALLS times, NaN timings."""
    for _ in range(WARM_CALLS):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    nan = float("nan")
    return Timing(nan, nan, nan, None, None, "warm-up run: not measured")


def bench(fn: Callable[[], Any], *, warmup: int = 10, rep: int = 50, device: str | None = None,
          graph: bool | str = True, host: bool | str = True) -> Timing:
    """Time ``fn`` (median, p20, p80 in ms). GPU: do_bench or CUDA events, then graph_ms and host_ms;
    CPU: perf_counter. ``graph``: False or the reason (a str, e.g. ALREADY_GRAPHED) to leave graph_ms
    empty without trying a capture; ``host``: False or a reason to leave host_ms empty (a call that
    synchronizes or runs for seconds). The reasons go to Timing.note. Warm mode: warm_run(fn)."""
    if warm_mode():
        return warm_run(fn)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        quantiles = _do_bench(fn)
        if quantiles is not None:
            p20, med, p80 = quantiles
            notes = []
            if graph is True:
                graph_ms, reason = _graph_time(fn)
            else:
                graph_ms, reason = None, graph or "graph timing not requested"
            if reason:
                notes.append(f"graph_ms: {reason}")
            host_ms = host_time(fn) if host is True else None
            if host is not True and host:
                notes.append(f"host_ms: {host}")
            return Timing(med, p20, p80, graph_ms, host_ms, "; ".join(notes))
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


def _do_bench(fn: Callable[[], Any]) -> tuple[float, float, float] | None:
    """(p20, median, p80) ms by triton.testing.do_bench; None without Triton."""
    try:
        import triton.testing
    except ImportError:
        return None
    p20, med, p80 = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.2, 0.5, 0.8])
    return p20, med, p80


def host_time(fn: Callable[[], Any], calls: int = 10) -> float:
    """ms of host time per call: ``calls`` calls issued back to back, timed on the host without
    waiting for the GPU in between (a call that synchronizes includes the GPU's time). NaN in warm
    mode (nothing run)."""
    if warm_mode():
        return float("nan")
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
    goes to stderr), in warm mode, or with TACHYON_BENCH_GRAPH=0. Never pass a callable that is
    already a CUDA graph (bench(..., graph=ALREADY_GRAPHED) leaves it out)."""
    return _graph_time(fn)[0]


def _graph_time(fn: Callable[[], Any]) -> tuple[float | None, str]:
    """graph_time's value and, where it is None, why ("" where it was measured)."""
    if warm_mode():
        return None, "warm-up run: not measured"
    if os.environ.get("TACHYON_BENCH_GRAPH", "1") == "0":
        return None, "graph timing off (TACHYON_BENCH_GRAPH=0)"
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    try:
        import triton.testing

        return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")), ""
    except Exception as exc:  # a call that syncs or allocates in a way capture refuses
        reason = f"not captured ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
        print(f"graph_time: {reason}", file=sys.stderr)
        try:
            torch.cuda.synchronize()
        except Exception:  # a capture that left the context unusable: no more graphs in this process
            os.environ["TACHYON_BENCH_GRAPH"] = "0"
            print("graph_time: CUDA context damaged by the failed capture; graph timing off from here", file=sys.stderr)
        return None, reason


def peak_memory(fn: Callable[[], Any]) -> int:
    """Peak CUDA memory in bytes allocated while ``fn`` runs, above what was allocated before
    (0 on CPU, and in warm mode, where ``fn`` is not run again)."""
    if not torch.cuda.is_available() or warm_mode():
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def measure_copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + write counted); NaN in warm mode."""
    if warm_mode():
        return float("nan")
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src))
    return t.rate(2 * src.numel() * src.element_size())


def measure_matmul_peak(dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float:
    """Measured dense matmul rate in FLOP/s on random data (n x n x n); NaN in warm mode."""
    if warm_mode():
        return float("nan")
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    t = bench(lambda: a @ b)
    return t.rate(2 * n**3)


def _git_commit() -> str:
    """$TACHYON_COMMIT where set (gpu.sh sets it, and a caller may pass it: a copy of the tree can
    carry stale git metadata), else git's short HEAD (+ "-dirty"), else "unknown"."""
    if os.environ.get("TACHYON_COMMIT"):
        return os.environ["TACHYON_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               cwd=Path(__file__).resolve().parent).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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

    body = [[_cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(columns)]
    line = lambda cells: "| " + " | ".join(x.ljust(w) for x, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, title: str | None = None) -> None:
    if title:
        print(f"\n## {title}\n")
    print(format_table(rows, columns))


def write_csv(path: str | os.PathLike, rows: Sequence[dict[str, Any]], benchmark: str) -> None:
    """Append ``rows`` to the CSV at ``path``, each prefixed with benchmark name and machine_info().
    Nothing is written in warm mode (its timings are placeholders)."""
    if not rows or warm_mode():
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


STREAM_PREFIX = "row "  # streamed row lines: "row | a | b |" (gpu.sh strips the prefix into summary.md)


def _cell(v: Any) -> str:
    if v is None:
        return ""
    return f"{v:.4g}" if isinstance(v, float) else str(v)


class Stream:
    """Rows of one table, kept as they are measured: ``add(row)`` prints the row at once (a
    markdown row after STREAM_PREFIX, flushed; the header before the first) and appends it to the
    CSV, so a script cut off by its time limit keeps everything it measured. ``table()`` prints
    the aligned table of all rows at the end. ``columns`` fixes the CSV header (every row written
    with every column, missing cells empty); without it the first row's keys are the columns.

        out = Stream("bench_mlp.csv", "mlp", columns=[...], title="MLP block")
        out.add({...})            # as each row is measured
        out.table()               # at the end
    """

    def __init__(self, csv_name: str | None, benchmark: str, columns: Sequence[str] | None = None,
                 title: str | None = None, echo: bool = True) -> None:
        self.path = output_dir() / csv_name if csv_name else None
        self.benchmark, self.title, self.echo = benchmark, title, echo
        self.columns = list(columns) if columns is not None else None
        self.rows: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> dict[str, Any]:
        if self.columns is None:
            self.columns = list(row.keys())
        unknown = [k for k in row if k not in self.columns]
        if unknown:
            raise ValueError(f"Stream({self.benchmark!r}): row has columns {unknown} outside {self.columns}")
        if self.echo:
            if not self.rows:
                print(f"{STREAM_PREFIX}| " + " | ".join(self.columns) + " |", flush=True)
                print(f"{STREAM_PREFIX}|" + "|".join("---" for _ in self.columns) + "|", flush=True)
            print(f"{STREAM_PREFIX}| " + " | ".join(_cell(row.get(c)) for c in self.columns) + " |", flush=True)
        self.rows.append(row)
        if self.path is not None:
            write_csv(self.path, [{c: row.get(c, "") for c in self.columns}], self.benchmark)
        return row

    def table(self, title: str | None = None, columns: Sequence[str] | None = None) -> None:
        print_table(self.rows, columns or self.columns, title=title or self.title)
        sys.stdout.flush()


def output_dir() -> Path:
    """Where scripts write: $TACHYON_BENCH_OUT (set by gpu.sh) or benchmarks/results/latest."""
    out = Path(os.environ.get("TACHYON_BENCH_OUT", Path(__file__).resolve().parent / "results" / "latest"))
    out.mkdir(parents=True, exist_ok=True)
    return out

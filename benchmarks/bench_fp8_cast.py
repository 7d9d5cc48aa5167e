"""FP8 cast + amax (+ transpose): tachyon's fused Triton kernel vs the PyTorch multi-pass path.

The PyTorch path is what tachyon.fp8 ran before the fused op: ``ScalingState.record`` (abs, amax,
maximum into the history) and ``cast_to_fp8`` (x.float() * scale, clamp, .to(fp8)), plus, for the
backward GEMMs' column-major operand, ``x8.t().contiguous()``. Variants:

    tachyon          cast_to_fp8(x, scale, e4m3, amax[, transpose=True]): one read of x
    torch            the eager multi-pass path
    torch.compile    the same multi-pass function through torch.compile (inductor)

bf16 input, TE-layer shapes (tokens x hidden, tokens x ffn). Reports ms (median, p20, p80) and
GB/s of the bytes the op must move (read x; write x8, and x8_t with transpose), as a fraction of
the measured copy bandwidth and of the datasheet HBM bandwidth. Each variant is checked bit for
bit against the eager path before it is timed.
Needs a CUDA GPU. Usage: python benchmarks/bench_fp8_cast.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    bench, gpu_peaks, measure_copy_bandwidth, output_dir, peak_memory, print_table, write_csv,
)

SHAPES = [(8192, 4096), (8192, 16384), (16384, 8192), (4096, 4096)]
QUICK_SHAPES = [(8192, 4096), (8192, 16384)]
FP8 = torch.float8_e4m3fn


def _torch_path(transpose: bool):
    def run(x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor):
        amax.copy_(torch.maximum(amax, x.abs().amax().float()))
        x8 = (x.float() * scale).clamp(-448.0, 448.0).to(FP8)
        return (x8, x8.t().contiguous()) if transpose else x8

    return run


def _variants(transpose: bool):
    from tachyon.kernels.fp8_cast import cast_to_fp8

    def ours(x, scale, amax):
        return cast_to_fp8(x, scale, FP8, amax, transpose=transpose, backend="triton")

    eager = _torch_path(transpose)
    return {"tachyon": ours, "torch": eager, "torch.compile": torch.compile(_torch_path(transpose))}


def _same(a, b) -> bool:
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return all(torch.equal(p.view(torch.uint8), q.view(torch.uint8)) for p, q in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="two shapes only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_fp8_cast needs a CUDA GPU; nothing to time on this machine")
        raise SystemExit(0)
    copy_bw = measure_copy_bandwidth()
    peaks = gpu_peaks()
    hbm = peaks["hbm_tbs"] * 1e12 if peaks else float("nan")
    print(f"measured copy bandwidth: {copy_bw / 1e9:.0f} GB/s; datasheet HBM: {hbm / 1e9:.0f} GB/s")
    rows = []
    for transpose in (False, True):
        variants = _variants(transpose)
        for m, n in QUICK_SHAPES if args.quick else SHAPES:
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            scale = torch.tensor(448.0 / 6.0, device="cuda")
            nbytes = m * n * (x.element_size() + (2 if transpose else 1))
            want = variants["torch"](x, scale, torch.zeros((), device="cuda"))
            for name, fn in variants.items():
                amax = torch.zeros((), device="cuda")
                got = fn(x, scale, amax)
                ok = _same(got, want) and amax.item() == x.float().abs().max().item()
                t = bench(lambda: fn(x, scale, amax))
                gbs = t.rate(nbytes) / 1e9
                rows.append({
                    "op": "cast+amax+transpose" if transpose else "cast+amax", "shape": f"{m}x{n}",
                    "variant": name, "median_ms": t.median_ms, "p20_ms": t.p20_ms, "p80_ms": t.p80_ms,
                    "GB/s": gbs, "frac_copy_bw": gbs * 1e9 / copy_bw, "frac_hbm": gbs * 1e9 / hbm,
                    "peak_mem_MB": peak_memory(lambda: fn(x, scale, amax)) / 2**20, "bit_exact": ok,
                })
            del x, want
    print_table(rows, title="FP8 cast + amax (+ transpose), bf16 -> e4m3")
    write_csv(output_dir() / "bench_fp8_cast.csv", rows, "fp8_cast")
    if not all(r["bit_exact"] for r in rows):
        raise SystemExit("some variant's output differs from the eager PyTorch path (see bit_exact)")


if __name__ == "__main__":
    main()

"""LayerNorm / RMSNorm: tachyon (Triton) vs torch.nn.LayerNorm (eager) vs torch.compile.

Forward and forward+backward, fp16 and bf16, rows x hidden from (4096, 1024) to (16384, 8192).
Reports ms (median, p20, p80), achieved GB/s (the bytes the op must move: read x, write y; plus
read dy, x, write dx for backward) and that as a fraction of the measured copy bandwidth.
Needs a CUDA GPU. Usage: python benchmarks/bench_layernorm.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import Stream, bench, measure_copy_bandwidth, peak_memory  # noqa: E402

SHAPES = [(4096, 1024), (4096, 4096), (8192, 4096), (16384, 4096), (16384, 8192)]


def _variants(kind: str, n: int, dtype: torch.dtype):
    import tachyon.nn as tnn

    if kind == "layernorm":
        ours = tnn.LayerNorm(n, device="cuda", dtype=dtype, backend="triton")
        base = torch.nn.LayerNorm(n, device="cuda", dtype=dtype)
    else:
        ours = tnn.RMSNorm(n, device="cuda", dtype=dtype, backend="triton")
        base = torch.nn.RMSNorm(n, eps=1e-6, device="cuda", dtype=dtype)
    return {"tachyon": ours, "torch": base, "torch.compile": torch.compile(base)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="two shapes only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_layernorm needs a CUDA GPU")
    copy_bw = measure_copy_bandwidth()
    print(f"measured copy bandwidth: {copy_bw / 1e9:.0f} GB/s", flush=True)
    out = Stream("bench_layernorm.csv", "layernorm", ["op", "dtype", "shape", "variant", "mode", "median_ms", "p20_ms",
                                                      "p80_ms", "graph_ms", "host_ms", "GB/s", "frac_copy_bw",
                                                      "peak_mem_MB", "note"], title="LayerNorm / RMSNorm")
    for kind in ("layernorm", "rmsnorm"):
        for dtype in (torch.float16, torch.bfloat16):
            for m, n in SHAPES[:2] if args.quick else SHAPES:
                x = torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=True)
                dy = torch.randn_like(x)
                esize = x.element_size()
                fwd_bytes = 2 * m * n * esize
                bwd_bytes = fwd_bytes + 3 * m * n * esize  # + read dy, x; write dx
                for name, mod in _variants(kind, n, dtype).items():
                    def fwd():
                        return mod(x)

                    def fwd_bwd():
                        x.grad = None
                        mod(x).backward(dy)

                    for mode, fn, nbytes in (("fwd", fwd, fwd_bytes), ("fwd+bwd", fwd_bwd, bwd_bytes)):
                        t = bench(fn)
                        gbs = t.rate(nbytes) / 1e9
                        out.add({
                            "op": kind, "dtype": str(dtype).removeprefix("torch."), "shape": f"{m}x{n}",
                            "variant": name, "mode": mode, **t.columns(), "GB/s": gbs,
                            "frac_copy_bw": gbs * 1e9 / copy_bw, "peak_mem_MB": peak_memory(fn) / 2**20,
                        })
    out.table()


if __name__ == "__main__":
    main()

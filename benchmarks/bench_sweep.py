"""Config sweeps on a GPU: every candidate block shape of the kernels under work, timed alone.

A GPU session is short; choosing defaults needs data for every candidate at once, so that the
choice can be made afterwards, on a CPU, from the CSV. Each row forces one autotuning config of one
kernel (the autotuner is given that config alone) and times the op with CUDA-graph replay
(``graph_ms``: GPU time, no host time) and eager (``median_ms``):

- attention backward at BERT's shapes (b64 s128 and b16 s512, 16 heads, d64) and the GPT shape
  (b4 s2048 d128 causal): the one-kernel backward's square tiles, and the two-kernel backward's
  dK/dV and dQ tiles (incl. the Triton tutorial's 32x128 / 128x32 layouts with more stages);
  the forward's tiles; dropout 0.1 against 0 (the cost of the Philox draws);
- the MLP's epilogue GEMM (BERT-Large: 8192 tokens, 1024 -> 4096 -> 1024) forward and backward
  against the cuBLAS chain;
- LayerNorm backward's partial-sum granularity (``tiling.MIN_ROWS_PER_PARTIAL``) at 4096 and
  8192 rows of 1024.

Every tachyon row names ``backend="triton"``: under the default "auto", CUDA runs torch's SDPA /
F.layer_norm wherever kernels/dispatch.py says so, and a forced config would time torch's kernel.
Each shape has its torch reference rows beside them (SDPA, F.layer_norm, the cuBLAS MLP chain;
"backend" column: torch). Rows print and go to the CSV as they are measured.

    python benchmarks/bench_sweep.py [--only attention,mlp,norm] [--shapes bert-s128,...] [--quick]

Writes bench_sweep.csv (results/latest or $TACHYON_BENCH_OUT). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import Stream, bench  # noqa: E402

ATTN_SHAPES = {"bert-s128": (64, 16, 128, 64, False), "bert-s512": (16, 16, 512, 64, False),
               "gpt-s2048": (4, 32, 2048, 128, True)}
# (BLOCK_M, BLOCK_N, num_warps, num_stages)
ONE_KERNEL = [(32, 32, 4, 1), (32, 32, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (128, 128, 8, 2),
              (128, 128, 8, 3)]
DKDV = [(64, 128, 8, 2), (32, 128, 8, 2), (32, 128, 4, 5), (64, 64, 4, 2), (64, 64, 4, 4), (32, 64, 4, 2),
        (128, 128, 8, 2)]
DQ = [(128, 64, 8, 2), (128, 32, 4, 5), (64, 64, 4, 2), (64, 64, 4, 4), (64, 128, 8, 2), (32, 64, 4, 2)]
FWD = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 4), (64, 32, 4, 2)]
# (BLOCK_N, BLOCK_K, num_warps, num_stages)
GEMM = [(128, 64, 8, 3), (256, 64, 8, 3), (128, 32, 4, 4), (64, 64, 4, 4), (128, 128, 8, 2), (256, 64, 8, 4),
        (128, 64, 4, 5), (256, 128, 8, 3)]


@contextlib.contextmanager
def only_config(kernel, config) -> Iterator[None]:
    """Run ``kernel`` (a FastKernel over an Autotuner) with ``config`` alone; restores after."""
    tuner = kernel.autotuner
    saved = tuner.configs, dict(tuner.cache), dict(kernel._configs), kernel._tuned
    tuner.configs, kernel._tuned = [config], False
    tuner.cache.clear()
    kernel._configs.clear()
    try:
        yield
    finally:
        tuner.configs, kernel._tuned = saved[0], saved[3]
        tuner.cache.clear()
        tuner.cache.update(saved[1])
        kernel._configs.clear()
        kernel._configs.update(saved[2])


def _config(kwargs: dict, warps: int, stages: int):
    import triton

    return triton.Config(kwargs, num_warps=warps, num_stages=stages)


COLUMNS = ["sweep", "shape", "backend", "kernel", "config", "mode", "dropout", "median_ms", "graph_ms", "host_ms",
           "TFLOP/s (graph)", "error", "note"]
OUT: Stream | None = None  # main() sets it; rows go there as they are measured


def timed(label: dict, fn: Callable[[], object], flops: float | None = None) -> dict:
    """One row: ``fn`` called twice (compile, tune), then timed; a failure is recorded in the row."""
    row = {"backend": "triton", **label}
    try:
        for _ in range(2):  # compile, tune
            fn()
        t = bench(fn)
        row.update(median_ms=t.median_ms, graph_ms=t.graph_ms, host_ms=t.host_ms, note=t.note)
        best = t.graph_ms or t.median_ms
        if flops:
            row["TFLOP/s (graph)"] = flops / (best * 1e-3) / 1e12
    except Exception as exc:  # a config that does not compile or fit: recorded, the sweep goes on
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    if OUT is not None:
        OUT.add(row)
    return row


def attention_rows(quick: bool, only_shapes: set[str] | None = None) -> list[dict]:
    import torch.nn.functional as F

    from tachyon.kernels.attention import attention
    from tachyon.kernels.attention import triton as tri

    rows = []
    shapes = {k: v for k, v in ATTN_SHAPES.items() if (not quick or k != "bert-s512")
              and (only_shapes is None or k in only_shapes)}
    for name, (b, h, s, d, causal) in shapes.items():
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        fwd_flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
        seed = torch.tensor(7, device="cuda")

        def fwd_bwd(p=0.0, one=True, det=True):
            q.grad = k.grad = v.grad = None
            out = attention(q, k, v, causal=causal, dropout_p=p, seed=seed if p else None, deterministic=det,
                            one_kernel_backward=one, backend="triton")
            out.backward(dout)

        def fwd(p=0.0):
            with torch.no_grad():
                return attention(q, k, v, causal=causal, dropout_p=p, seed=seed if p else None, backend="triton")

        def sdpa_fwd():
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def sdpa_fwd_bwd():
            q.grad = k.grad = v.grad = None
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(dout)

        torch_row = {"sweep": "attention", "shape": name, "backend": "torch",
                     "kernel": "F.scaled_dot_product_attention", "dropout": 0.0}
        rows.append(timed({**torch_row, "mode": "fwd"}, sdpa_fwd, fwd_flops))
        rows.append(timed({**torch_row, "mode": "fwd+bwd"}, sdpa_fwd_bwd, 3.5 * fwd_flops))

        for p in (0.0, 0.1):
            rows.append(timed({"sweep": "attention", "shape": name, "kernel": "default", "mode": "fwd", "dropout": p},
                              lambda p=p: fwd(p), fwd_flops))
            rows.append(timed({"sweep": "attention", "shape": name, "kernel": "default one-kernel bwd",
                               "mode": "fwd+bwd", "dropout": p}, lambda p=p: fwd_bwd(p), 3.5 * fwd_flops))
        rows.append(timed({"sweep": "attention", "shape": name, "kernel": "default two-kernel bwd", "mode": "fwd+bwd",
                           "dropout": 0.0}, lambda: fwd_bwd(one=False), 3.5 * fwd_flops))
        for m, n, w, st in FWD:
            with only_config(tri._fwd_kernel, _config({"BLOCK_M": m, "BLOCK_N": n}, w, st)):
                rows.append(timed({"sweep": "attention", "shape": name, "kernel": "_fwd_kernel",
                                   "config": f"{m}x{n} w{w} s{st}", "mode": "fwd"}, fwd, fwd_flops))
        for m, n, w, st in ONE_KERNEL:
            with only_config(tri._bwd_one_kernel, _config({"BLOCK_M": m, "BLOCK_N": n}, w, st)):
                rows.append(timed({"sweep": "attention", "shape": name, "kernel": "_bwd_one_kernel",
                                   "config": f"{m}x{n} w{w} s{st}", "mode": "fwd+bwd"}, fwd_bwd, 3.5 * fwd_flops))
        if quick:
            continue
        for m, n, w, st in DKDV:
            with only_config(tri._bwd_dkdv_kernel, _config({"BLOCK_M": m, "BLOCK_N": n}, w, st)):
                rows.append(timed({"sweep": "attention", "shape": name, "kernel": "_bwd_dkdv_kernel (two-kernel)",
                                   "config": f"{m}x{n} w{w} s{st}", "mode": "fwd+bwd"},
                                  lambda: fwd_bwd(one=False), 3.5 * fwd_flops))
        for m, n, w, st in DQ:
            with only_config(tri._bwd_dq_kernel, _config({"BLOCK_M": m, "BLOCK_N": n}, w, st)):
                rows.append(timed({"sweep": "attention", "shape": name, "kernel": "_bwd_dq_kernel (two-kernel)",
                                   "config": f"{m}x{n} w{w} s{st}", "mode": "fwd+bwd"},
                                  lambda: fwd_bwd(one=False), 3.5 * fwd_flops))
    return rows


def mlp_rows(quick: bool) -> list[dict]:
    import torch.nn.functional as F

    from tachyon.kernels.linear import mlp
    from tachyon.kernels.linear import triton as tri

    tokens, hidden, ffn = 8192, 1024, 4096
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w1 = (0.02 * torch.randn(ffn, hidden, device="cuda", dtype=torch.bfloat16)).requires_grad_()
    b1 = torch.zeros(ffn, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w2 = (0.02 * torch.randn(hidden, ffn, device="cuda", dtype=torch.bfloat16)).requires_grad_()
    dout = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    flops = 2.0 * tokens * hidden * ffn * 2

    def tachyon_fwd():
        with torch.no_grad():
            return mlp(x, w1, b1, "gelu", w2, backend="triton")

    def tachyon_fwd_bwd():
        x.grad = w1.grad = b1.grad = w2.grad = None
        mlp(x, w1, b1, "gelu", w2, backend="triton").backward(dout)

    def cublas_fwd_bwd():
        x.grad = w1.grad = b1.grad = w2.grad = None
        F.linear(F.gelu(F.linear(x, w1, b1)), w2).backward(dout)

    rows = [timed({"sweep": "mlp", "backend": "torch", "kernel": "torch eager (cuBLAS)", "mode": "fwd+bwd"},
                  cublas_fwd_bwd, 3 * flops),
            timed({"sweep": "mlp", "kernel": "default", "mode": "fwd"}, tachyon_fwd, flops),
            timed({"sweep": "mlp", "kernel": "default", "mode": "fwd+bwd"}, tachyon_fwd_bwd, 3 * flops)]
    for n, k, w, st in GEMM[:4] if quick else GEMM:
        with only_config(tri._gemm_act_kernel, _config({"BLOCK_N": n, "BLOCK_K": k}, w, st)):
            rows.append(timed({"sweep": "mlp", "kernel": "_gemm_act_kernel", "config": f"N{n} K{k} w{w} s{st}",
                               "mode": "fwd"}, tachyon_fwd, flops))
            rows.append(timed({"sweep": "mlp", "kernel": "_gemm_act_kernel", "config": f"N{n} K{k} w{w} s{st}",
                               "mode": "fwd+bwd"}, tachyon_fwd_bwd, 3 * flops))
    return rows


def norm_rows(quick: bool) -> list[dict]:
    import torch.nn.functional as F

    from tachyon.kernels import tiling
    from tachyon.kernels.layernorm import layer_norm

    rows = []
    for m in (4096, 8192):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.ones(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        bias = torch.zeros(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)

        def run(fn):
            def step():
                x.grad = w.grad = bias.grad = None
                fn(x, w, bias).backward(dy)
            return step

        rows.append(timed({"sweep": "norm", "shape": f"{m}x1024", "backend": "torch", "kernel": "F.layer_norm",
                           "mode": "fwd+bwd"},
                          run(lambda a, ww, bb: F.layer_norm(a, (1024,), ww, bb))))
        saved = tiling.MIN_ROWS_PER_PARTIAL
        for rows_per_partial in ((8,) if quick else (2, 8, 32, 128)):
            tiling.MIN_ROWS_PER_PARTIAL = rows_per_partial
            rows.append(timed({"sweep": "norm", "shape": f"{m}x1024", "kernel": "tachyon layer_norm",
                               "config": f"MIN_ROWS_PER_PARTIAL={rows_per_partial}", "mode": "fwd+bwd"},
                              run(lambda a, ww, bb: layer_norm(a, ww, bb, backend="triton"))))
        tiling.MIN_ROWS_PER_PARTIAL = saved
    return rows


def main() -> None:
    global OUT
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="attention,mlp,norm")
    parser.add_argument("--shapes", default=None,
                        help=f"attention shapes, comma-separated (default: all of {', '.join(ATTN_SHAPES)})")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and configs")
    args = parser.parse_args()
    only_shapes = set(args.shapes.split(",")) if args.shapes else None
    if only_shapes and not only_shapes <= set(ATTN_SHAPES):
        parser.error(f"--shapes: unknown {sorted(only_shapes - set(ATTN_SHAPES))}; known: {', '.join(ATTN_SHAPES)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_sweep needs a CUDA GPU")
    start = time.time()
    OUT = Stream("bench_sweep.csv", "sweep", COLUMNS)
    for name in args.only.split(","):
        if name == "attention":
            attention_rows(args.quick, only_shapes)
        elif name in ("mlp", "norm"):
            (mlp_rows if name == "mlp" else norm_rows)(args.quick)
        else:
            parser.error(f"--only: unknown sweep {name!r}; known: attention, mlp, norm")
    OUT.table(title=f"Config sweeps ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()

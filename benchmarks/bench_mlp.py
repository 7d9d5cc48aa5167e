"""The MLP block with its activation in the GEMMs' epilogues (tachyon.kernels.linear.mlp, Triton
GEMMs) vs the same math with cuBLAS GEMMs around the fused bias + activation kernel (what
tachyon ran before, and runs inside fp8_autocast), eager PyTorch, and torch.compile of it.

Shapes: BERT-Large's FFN (1024 -> 4096 -> 1024, erf GELU) at 8192 tokens (seq 512 x batch 16),
GPT-2 XL's (1600 -> 6400 -> 1600, tanh GELU) and a Llama-7B SwiGLU FFN (4096 -> 2 x 11008 ->
4096) at 8192 tokens; bf16 and fp16; forward and forward + backward. Reports ms (median, p20,
p80), TFLOP/s (the block's GEMM FLOPs: 2 per multiply-add, 3x forward for forward + backward) and
that as a fraction of the measured bf16 matmul peak, and peak memory.

The decision it informs: the Triton GEMMs must beat cuBLAS + the separate kernel for ``mlp`` to
stay the default outside FP8 (the bytes it saves: docs/traffic.md). Goal: tachyon mlp >= the
cuBLAS chain's TFLOP/s in fwd+bwd at every shape.

Needs a CUDA GPU. Usage: python benchmarks/bench_mlp.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import Stream, bench, measure_matmul_peak, peak_memory  # noqa: E402

# (name, tokens, hidden, ffn, kernel activation)
SHAPES = [("BERT-Large", 8192, 1024, 4096, "gelu"), ("GPT-2 XL", 8192, 1600, 6400, "gelu_tanh"),
          ("Llama-7B", 8192, 4096, 11008, "swiglu")]


def _variants(activation: str):
    from tachyon.kernels.activation import bias_act
    from tachyon.kernels.linear import mlp

    def eager(x, w1, b1, w2, b2):
        h = F.linear(x, w1, b1)
        if activation == "swiglu":
            gate, value = h.chunk(2, dim=-1)
            return F.linear(F.silu(gate) * value, w2, b2)
        return F.linear(F.gelu(h, approximate="tanh" if activation == "gelu_tanh" else "none"), w2, b2)

    def cublas_chain(x, w1, b1, w2, b2):
        return F.linear(bias_act(F.linear(x, w1), b1, activation, backend="triton"), w2, b2)

    return {
        "tachyon mlp (Triton epilogue GEMMs)": lambda x, w1, b1, w2, b2: mlp(x, w1, b1, activation, w2, b2,
                                                                             backend="triton"),
        "cuBLAS + bias_act + cuBLAS": cublas_chain,
        # what a user gets by default: the dispatch table's choice for this class (tachyon.kernels.dispatch)
        "tachyon mlp (auto)": lambda x, w1, b1, w2, b2: mlp(x, w1, b1, activation, w2, b2),
        "torch eager": eager,
        "torch.compile(eager)": torch.compile(eager),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="BERT-Large's shape, bf16 only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mlp needs a CUDA GPU")
    peak = measure_matmul_peak(torch.bfloat16)
    print(f"measured bf16 matmul peak: {peak / 1e12:.0f} TFLOP/s", flush=True)
    out = Stream("bench_mlp.csv", "mlp", ["shape", "dtype", "variant", "mode", "median_ms", "p20_ms", "p80_ms", "graph_ms",
                                          "host_ms", "TFLOP/s", "frac_matmul_peak", "peak_mem_MB", "note"],
                 title="MLP block: activation in the GEMM epilogues vs cuBLAS + a separate kernel")
    for dtype in (torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float16):
        for name, tokens, hidden, ffn, activation in SHAPES[:1] if args.quick else SHAPES:
            rows_w1 = 2 * ffn if activation == "swiglu" else ffn

            def param(*shape, scale):
                return (scale * torch.randn(*shape, device="cuda")).to(dtype).requires_grad_()

            inputs = (param(tokens, hidden, scale=1.0), param(rows_w1, hidden, scale=hidden ** -0.5),
                      param(rows_w1, scale=0.1), param(hidden, ffn, scale=ffn ** -0.5), param(hidden, scale=0.1))
            gemm_flops = 2 * tokens * hidden * (rows_w1 + ffn)
            grad = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
            for variant, fn in _variants(activation).items():
                def fwd(fn=fn):
                    return fn(*inputs)

                def fwd_bwd(fn=fn):
                    torch.autograd.grad(fn(*inputs), inputs, grad)

                for mode, f, flops in (("fwd", fwd, gemm_flops), ("fwd+bwd", fwd_bwd, 3 * gemm_flops)):
                    t = bench(f)
                    tflops = t.rate(flops) / 1e12
                    out.add({"shape": name, "dtype": str(dtype).removeprefix("torch."), "variant": variant,
                             "mode": mode, **t.columns(), "TFLOP/s": tflops, "frac_matmul_peak": tflops * 1e12 / peak,
                             "peak_mem_MB": peak_memory(f) / 2**20})
    out.table()


if __name__ == "__main__":
    main()

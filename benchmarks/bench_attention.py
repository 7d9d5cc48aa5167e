"""Attention: tachyon (Triton flash attention) vs torch SDPA (flash backend) vs eager PyTorch math.

Forward and forward+backward, bf16 and fp16, on
    (b 16, h 16, s 512, d 64)              BERT-large-like, no mask
    (b 4, h 32, s 2048, d 128, causal)     GPT/Llama-7B-like
    (b 4, h 32, kv 8, s 2048, d 128, causal)  GQA (Llama-2-70B/Llama-3 head ratio)
Reports ms (median, p20, p80), TFLOP/s and that as a fraction of the measured dense matmul rate in
the same dtype (benchmarks.common.measure_matmul_peak), and peak memory. FLOPs: 4 * b * h * sq * sk
* d for the forward (two matmuls), the backward counted as 2.5x the forward, so fwd+bwd = 3.5x
(flash-attn's convention); halved for causal. "eager" materializes the scores (softmax in fp32).
"tachyon-atomic-dq" is tachyon with ``deterministic=False`` (the dK/dV kernel also accumulates dQ
with fp32 atomics; the probabilities are recomputed once in backward instead of twice): its
forward is tachyon's, so it is timed for fwd+bwd only.
Needs a CUDA GPU. Usage: python benchmarks/bench_attention.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import Stream, bench, measure_matmul_peak, peak_memory  # noqa: E402

# (name, batch, heads, kv_heads, seq, head_dim, causal)
SHAPES = [
    ("bert", 16, 16, 16, 512, 64, False),
    ("gpt-causal", 4, 32, 32, 2048, 128, True),
    ("gqa-causal", 4, 32, 8, 2048, 128, True),
]


BACKWARD_ONLY_VARIANTS = {"tachyon-atomic-dq"}  # same forward as "tachyon"


def _variants():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tachyon.kernels.attention import attention, sdpa_attention
    from tachyon.kernels.attention.reference import attention_lowp_reference

    def sdpa_flash(q, k, v, causal):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa_attention(q, k, v, causal=causal)

    return {
        "tachyon": lambda q, k, v, causal: attention(q, k, v, causal=causal, backend="triton"),
        "tachyon-atomic-dq": lambda q, k, v, causal: attention(q, k, v, causal=causal, backend="triton",
                                                               deterministic=False),
        "sdpa-flash": sdpa_flash,
        "eager": lambda q, k, v, causal: attention_lowp_reference(q, k, v, causal=causal),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="bf16 and the first two shapes only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA GPU")
    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float16]
    shapes = SHAPES[:2] if args.quick else SHAPES
    peaks = {dt: measure_matmul_peak(dt) for dt in dtypes}
    for dt, peak in peaks.items():
        print(f"measured {str(dt).removeprefix('torch.')} matmul rate: {peak / 1e12:.0f} TFLOP/s", flush=True)
    columns = ["shape", "b,h,kv,s,d", "causal", "dtype", "variant", "mode", "median_ms", "p20_ms", "p80_ms", "graph_ms",
               "host_ms", "TFLOP/s", "frac_matmul_peak", "peak_mem_MB", "note"]
    out = Stream("bench_attention.csv", "attention", columns, title="Attention")
    for dtype in dtypes:
        for name, b, h, kvh, s, d, causal in shapes:
            q = torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True)
            k = torch.randn(b, kvh, s, d, device="cuda", dtype=dtype, requires_grad=True)
            v = torch.randn(b, kvh, s, d, device="cuda", dtype=dtype, requires_grad=True)
            dout = torch.randn_like(q)
            fwd_flops = 4 * b * h * s * s * d / (2 if causal else 1)
            for variant, fn in _variants().items():
                def fwd():
                    return fn(q, k, v, causal)

                def fwd_bwd():
                    q.grad = k.grad = v.grad = None
                    fn(q, k, v, causal).backward(dout)

                for mode, run, flops in (("fwd", fwd, fwd_flops), ("fwd+bwd", fwd_bwd, 3.5 * fwd_flops)):
                    if mode == "fwd" and variant in BACKWARD_ONLY_VARIANTS:
                        continue
                    row = {"shape": name, "b,h,kv,s,d": f"{b},{h},{kvh},{s},{d}", "causal": causal,
                           "dtype": str(dtype).removeprefix("torch."), "variant": variant, "mode": mode}
                    try:
                        t = bench(run)
                        mem = peak_memory(run)
                    except (RuntimeError, torch.OutOfMemoryError) as exc:  # e.g. no flash kernel for GQA here
                        row.update(median_ms=float("nan"), note=f"{type(exc).__name__}: {str(exc)[:80]}")
                        out.add(row)
                        torch.cuda.empty_cache()
                        continue
                    tflops = t.rate(flops) / 1e12
                    row.update(**t.columns(), **{"TFLOP/s": tflops}, frac_matmul_peak=tflops * 1e12 / peaks[dtype],
                               peak_mem_MB=mem / 2**20)
                    out.add(row)
            del q, k, v, dout
            torch.cuda.empty_cache()
    out.table()


if __name__ == "__main__":
    main()

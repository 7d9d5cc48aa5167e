"""The fused BERT layer (TransformerKernelLayer) vs HF BertLayer: speed, memory, largest micro-batch.

GPU (default): one BERT-Large layer (hidden 1024, 16 heads, ffn 4096) at seq 128 batch 64 and
seq 512 batch 16, fp16 and bf16, forward and forward+backward: tachyon post-LN and pre-LN (and
pre-LN with ``stochastic_mode=True``: the attention backward accumulates dQ with atomics; its
forward is the same, so it is timed for forward+backward only) vs HF BertLayer in eager PyTorch
(SDPA attention) vs torch.compile(HF BertLayer) vs torch.compile(tachyon pre-LN), and the pre-LN layer
captured with ``tachyon.make_graphed_callables`` (its forward and backward replayed; graph_ms empty: its
median is already the replay). Reports median ms (p20, p80), TFLOP/s, the fraction of the measured matmul
rate, and peak memory. The tachyon layers run with their default backend ("auto"; the "backend" column):
what a user of the layer gets. Rows print and go to the CSV as they are measured. Then the largest
micro-batch of a 24-layer BERT-Large stack (fp16, forward+backward) for every memory-flag
setting and for HF, by binary search with OOM catching (the seed tutorial's table).

    python benchmarks/bench_transformer_kernel.py [--quick]         # needs a CUDA GPU
    python benchmarks/bench_transformer_kernel.py --memory-table    # CPU: saved-for-backward bytes
    python benchmarks/bench_transformer_kernel.py --smoke           # CPU: the GPU code paths at toy sizes

--memory-table measures exactly (saved_tensors_hooks, unique storages, parameters excluded) what
ONE layer at BERT-Large shapes saves for backward, batch 1, fp32, training mode with dropout 0.1,
torch backend: alone, and as one layer of a stack (a layer's output is often saved by the next
layer as its input; the stack figure counts it once). Bytes scale linearly with batch.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    ALREADY_GRAPHED, Stream, bench, measure_matmul_peak, output_dir, peak_memory, print_table, warm_mode, write_csv)

HIDDEN, HEADS, FFN, LAYERS = 1024, 16, 4096, 24
DEVICE = "cuda"
SPEED_SHAPES = [(128, 64), (512, 16)]  # (seq, batch)
MAX_BATCH_SEARCH = [(128, 4096), (512, 1024)]  # (seq, largest batch tried)
COMPILE = True
FLAGS = ("normalize_invertible", "gelu_checkpoint", "attn_dropout_checkpoint")
SHORT = {"normalize_invertible": "inv", "gelu_checkpoint": "gelu_ckpt", "attn_dropout_checkpoint": "attn_ckpt"}


def kernel_config(batch: int, seq: int, dtype: torch.dtype, pre_ln: bool, dropout: float = 0.1, **flags):
    from tachyon.nn import TransformerKernelConfig

    return TransformerKernelConfig(
        batch_size=batch, max_seq_length=seq, hidden_size=HIDDEN, intermediate_size=FFN, heads=HEADS,
        attn_dropout_ratio=dropout, hidden_dropout_ratio=dropout, num_hidden_layers=LAYERS, initializer_range=0.02,
        seed=1234, fp16=dtype == torch.float16, bf16=dtype == torch.bfloat16, pre_layer_norm=pre_ln, **flags,
    )


def hf_layer(attn_implementation: str, dtype: torch.dtype, device: str, dropout: float = 0.1):
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    config = BertConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=FFN,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    config._attn_implementation = attn_implementation
    return BertLayer(config).to(device=device, dtype=dtype).train()


def flag_label(flags: dict) -> str:
    return "+".join(SHORT[f] for f in FLAGS if flags.get(f)) or "none"


def layer_flops(batch: int, seq: int) -> float:
    """Forward FLOPs of one BERT layer: the four GEMMs (2 * tokens * params) plus QK^T and PV."""
    tokens = batch * seq
    gemms = 2 * tokens * (4 * HIDDEN * HIDDEN + 2 * HIDDEN * FFN)
    attention = 2 * 2 * batch * seq * seq * HIDDEN
    return float(gemms + attention)


# --- memory table (CPU) ------------------------------------------------------------------------

def memory_table() -> list[dict]:
    from tachyon import use_backend
    from tachyon.nn import TransformerKernelLayer
    from tachyon.nn.transformer_kernel import saved_tensor_bytes

    torch.manual_seed(0)
    rows = []
    variants = []
    for pre_ln in (False, True):
        for on in itertools.product([False, True], repeat=3):
            flags = dict(zip(FLAGS, on))
            variants.append((f"tachyon {'pre' if pre_ln else 'post'}-LN", flag_label(flags), pre_ln, flags))
    variants += [("HF BertLayer eager", "-", None, "eager"), ("HF BertLayer sdpa", "-", None, "sdpa")]
    for name, flags_text, pre_ln, spec in variants:
        row = {"layer": name, "flags": flags_text}
        for seq in (128, 512):
            if pre_ln is None:
                layers = [hf_layer(spec, torch.float32, "cpu") for _ in range(2)]
            else:
                layers = [TransformerKernelLayer(kernel_config(1, seq, torch.float32, pre_ln, **spec)) for _ in range(2)]
            params = [p for layer in layers for p in layer.parameters()]
            x = torch.randn(1, seq, HIDDEN, requires_grad=True)
            with use_backend("torch"):
                _, one = saved_tensor_bytes(lambda: layers[0](x), exclude=params)
                _, two = saved_tensor_bytes(lambda: layers[1](layers[0](x)), exclude=params)
            row[f"seq{seq} alone MiB"] = one / 2**20
            row[f"seq{seq} in stack MiB"] = (two - one) / 2**20
        rows.append(row)
        print(f"  measured {name} [{flags_text}]", file=sys.stderr)
    return rows


# --- GPU timing ----------------------------------------------------------------------------------

SPEED_COLUMNS = ["layer", "backend", "dtype", "seq", "batch", "mode", "median_ms", "p20_ms", "p80_ms", "graph_ms",
                 "host_ms", "TFLOP/s", "frac_matmul_peak", "peak_mem_MB", "note"]
BATCH_COLUMNS = ["stack", "seq", "dtype", "max_micro_batch", "note"]


def speed_rows(quick: bool, out: Stream | None = None) -> list[dict]:
    from tachyon.nn import TransformerKernelLayer

    out = out or Stream(None, "transformer_kernel", SPEED_COLUMNS, echo=False)

    if DEVICE == "cuda":
        peaks = {dt: measure_matmul_peak(dt) for dt in (torch.float16, torch.bfloat16)}
    else:  # --smoke on CPU: no meaningful peak
        peaks = dict.fromkeys((torch.float16, torch.bfloat16), float("nan"))
    for dt, rate in peaks.items():
        print(f"measured {dt} matmul: {rate / 1e12:.0f} TFLOP/s", flush=True)
    shapes = SPEED_SHAPES[:1] if quick else SPEED_SHAPES
    dtypes = [torch.bfloat16] if quick else [torch.float16, torch.bfloat16]
    for seq, batch in shapes:
        for dtype in dtypes:
            hf = hf_layer("sdpa", dtype, DEVICE)
            variants = {
                "tachyon post-LN": TransformerKernelLayer(kernel_config(batch, seq, dtype, False)).to(DEVICE),
                "tachyon pre-LN": TransformerKernelLayer(kernel_config(batch, seq, dtype, True)).to(DEVICE),
                "tachyon pre-LN stochastic_mode": TransformerKernelLayer(
                    kernel_config(batch, seq, dtype, True, stochastic_mode=True)).to(DEVICE),
                "HF BertLayer (sdpa)": hf,
            }
            if COMPILE:
                variants["torch.compile(HF)"] = torch.compile(hf)
                variants["torch.compile(tachyon pre-LN)"] = torch.compile(
                    TransformerKernelLayer(kernel_config(batch, seq, dtype, True)).to(DEVICE))
            x = torch.randn(batch, seq, HIDDEN, device=DEVICE, dtype=dtype, requires_grad=True)
            mask = torch.ones(batch, seq, device=DEVICE, dtype=torch.long)
            mask[batch // 2:, seq * 3 // 4:] = 0  # half the batch padded by a quarter
            ext = (1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
            if DEVICE == "cuda":  # the pre-LN layer's forward and backward replayed from CUDA graphs
                import tachyon

                variants["tachyon pre-LN graphed"] = tachyon.make_graphed_callables(
                    TransformerKernelLayer(kernel_config(batch, seq, dtype, True)).to(DEVICE), (x, mask))
            dy = torch.randn_like(x)
            for name, module in variants.items():
                m = mask if name.startswith("tachyon") else ext

                def fwd(module=module, m=m):
                    return module(x, m)

                def fwd_bwd(module=module, m=m):
                    x.grad = None
                    out = module(x, m)
                    out = out[0] if isinstance(out, tuple) else out
                    out.backward(dy)

                for mode, fn, flops in (("fwd", fwd, layer_flops(batch, seq)), ("fwd+bwd", fwd_bwd, 3 * layer_flops(batch, seq))):
                    if mode == "fwd" and "stochastic_mode" in name:
                        continue  # the forward is the deterministic layer's
                    t = bench(fn, graph=ALREADY_GRAPHED if name.endswith("graphed") else True)
                    rate = t.rate(flops)
                    out.add({
                        "layer": name, "backend": "auto" if "tachyon" in name else "-",
                        "dtype": str(dtype).removeprefix("torch."), "seq": seq, "batch": batch, "mode": mode,
                        **t.columns(), "TFLOP/s": rate / 1e12, "frac_matmul_peak": rate / peaks[dtype],
                        "peak_mem_MB": peak_memory(fn) / 2**20,
                    })
    return out.rows


def _fits(make_stack, seq: int, batch: int, dtype: torch.dtype, kernel: bool) -> bool:
    stack = None
    try:
        stack = make_stack(batch)
        x = torch.randn(batch, seq, HIDDEN, device=DEVICE, dtype=dtype, requires_grad=True)
        mask = torch.ones(batch, seq, device=DEVICE, dtype=torch.long)
        if not kernel:
            mask = (1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        h = x
        for layer in stack:
            h = layer(h, mask)
        h.float().sum().backward()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del stack
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def max_batch_rows(quick: bool, out: Stream | None = None) -> list[dict]:
    """Largest micro-batch of a 24-layer BERT-Large stack (fp16, fwd+bwd) per flag setting. Warm mode:
    each stack once at batch 2 (compiles its kernels) and no search (it would fill the GPU's memory,
    which the warm phase shares between processes)."""
    from tachyon.nn import TransformerKernelLayer

    out = out or Stream(None, "transformer_kernel_max_batch", BATCH_COLUMNS, echo=False)
    dtype = torch.float16
    for seq, upper in MAX_BATCH_SEARCH:
        settings = [dict(zip(FLAGS, on)) for on in itertools.product([False, True], repeat=3)]
        if quick:
            settings = [settings[0], settings[-1]]
        makers = {}
        for flags in settings:
            def make(batch, flags=flags):
                layer = TransformerKernelLayer(kernel_config(batch, seq, dtype, True, **flags)).to(DEVICE)
                return torch.nn.ModuleList([layer] + [TransformerKernelLayer(layer.config).to(DEVICE)
                                                      for _ in range(LAYERS - 1)])
            makers[f"tachyon pre-LN [{flag_label(flags)}]"] = (make, True)
        makers["HF BertLayer (sdpa)"] = (lambda batch: torch.nn.ModuleList(
            [hf_layer("sdpa", dtype, DEVICE) for _ in range(LAYERS)]), False)
        for name, (make, kernel) in makers.items():
            if warm_mode():
                _fits(make, seq, 2, dtype, kernel)
                continue
            lo, hi = 0, upper  # lo fits (0 trivially), hi + 1 is not tried
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if _fits(make, seq, mid, dtype, kernel):
                    lo = mid
                else:
                    hi = mid - 1
            out.add({"stack": name, "seq": seq, "dtype": "float16", "max_micro_batch": lo,
                     "note": f"searched up to {upper}" if lo == upper else ""})
    return out.rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="one shape and dtype; two flag settings")
    parser.add_argument("--memory-table", action="store_true", help="CPU: saved-for-backward bytes of one layer")
    parser.add_argument("--smoke", action="store_true",
                        help="run the GPU code paths on CPU at toy sizes (checks the script, measures nothing)")
    args = parser.parse_args()
    if args.smoke:
        global HIDDEN, HEADS, FFN, LAYERS, DEVICE, SPEED_SHAPES, MAX_BATCH_SEARCH, COMPILE
        HIDDEN, HEADS, FFN, LAYERS, DEVICE, COMPILE = 64, 4, 256, 2, "cpu", False
        SPEED_SHAPES, MAX_BATCH_SEARCH = [(16, 2), (24, 2)], [(16, 4)]
    if args.memory_table:
        rows = memory_table()
        print_table(rows, title="Saved for backward by ONE BERT-Large layer, batch 1, fp32, dropout 0.1 (MiB)")
        write_csv(output_dir() / "bench_transformer_kernel_memory.csv", rows, "transformer_kernel_memory")
        return
    if not torch.cuda.is_available() and not args.smoke:
        raise SystemExit("bench_transformer_kernel needs a CUDA GPU (or pass --memory-table for the CPU table)")
    speed = Stream(None if args.smoke else "bench_transformer_kernel.csv", "transformer_kernel", SPEED_COLUMNS,
                   title="BERT-Large layer: tachyon vs HF BertLayer vs torch.compile")
    speed_rows(args.quick, speed)
    speed.table()
    batches = Stream(None if args.smoke else "bench_transformer_kernel_max_batch.csv", "transformer_kernel_max_batch",
                     BATCH_COLUMNS, title=f"Largest micro-batch, {LAYERS}-layer BERT-Large stack, fp16, fwd+bwd")
    max_batch_rows(args.quick, batches)
    batches.table()


if __name__ == "__main__":
    main()

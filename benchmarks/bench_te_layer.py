"""One GPT layer, the Transformer Engine getting-started progression, forward+backward.

Shape (the tutorial's): hidden 4096, ffn 16384, 32 heads, seq 2048, batch 4, sbhd, dropout 0.1
(attention and hidden), causal attention, bf16 and fp16 (--quick: bf16 only). Variants, as the tutorial
builds them, run most valuable first (a run cut off by its time limit keeps those):

    torch.nn            BasicTransformerLayer: torch.nn.LayerNorm / Linear, SDPA attention, nn.Dropout
    TransformerLayer    tachyon.nn.TransformerLayer (flash attention kernel, fused bias-dropout-add)
    ... graphed           TransformerLayer (and each +FP8 row) captured by tachyon.make_graphed_callables
                        (GPU only; graph_ms empty: the row's median is already the graph's replay)
    TransformerLayer+FP8 (<recipe>)  the same inside tachyon.autocast, one row per FP8 recipe (--recipe):
                        current (Float8CurrentScaling()), delayed (DelayedScaling(HYBRID, amax history 16,
                        "max"), the tutorial's), block (Float8BlockScaling()); bf16 only
    +tachyon Linear/LN  the same as torch.nn with tachyon.nn.Linear and tachyon.nn.LayerNorm
    +LayerNormLinear/MLP  tachyon.nn.LayerNormLinear (LN + QKV) and LayerNormMLP, SDPA attention
    torch.compile       torch.compile(BasicTransformerLayer)

The tachyon modules run with their default backend ("auto": on CUDA, the norms and attention without
dropout go to torch's twin where kernels/dispatch.py says so); the "backend" column says so: these
rows measure what a user of the modules gets, not one kernel.

FLOPs counted per forward (T = seq * batch tokens, h hidden, f ffn): the GEMMs 2 T h (4 h + 2 f)
and causal attention 2 b s^2 h (QK^T and PV over the lower triangle: half of the full 4 b s^2 h);
forward+backward = 3x forward. TFLOP/s is at the median time; "frac_bf16_peak" divides it by the
bf16 matmul rate measured in the same run (the FP8 row too, so it can exceed what bf16 reaches).

Also printed: Transformer Engine's published H100 figures for this layer (BENCHMARKS.md: batch 8,
BF16: plain PyTorch 48.3 ms, TE TransformerLayer 35.7 ms, TE + FP8 21.7 ms), scaled to this
run's batch by batch / 8 (every op of the layer is linear in the batch size, so equal work at
batch 4 is half the batch-8 time). They are published reference numbers, not measured here.

Needs a CUDA GPU. Usage: python benchmarks/bench_te_layer.py [--quick | --smoke] [--recipe NAME ...]
(--recipe: the FP8 rows to run, any of current, delayed, block; default all three; --quick:
hidden 1024, ffn 4096, 16 heads, seq 512, batch 4, bf16; --smoke: every variant's code path on CPU at
a toy shape, a check that the script works, not a measurement; torch.compile with aot_eager)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    ALREADY_GRAPHED, Stream, bench, measure_matmul_peak, peak_memory, print_table)

FULL = {"hidden": 4096, "ffn": 16384, "heads": 32, "seq": 2048, "batch": 4}
QUICK = {"hidden": 1024, "ffn": 4096, "heads": 16, "seq": 512, "batch": 4}
SMOKE = {"hidden": 64, "ffn": 128, "heads": 4, "seq": 16, "batch": 2}
DROPOUT = 0.1
# Transformer Engine getting-started tutorial on H100, batch 8, BF16 (BENCHMARKS.md), in ms
TE_PUBLISHED = {"plain PyTorch": 48.3, "TE TransformerLayer": 35.7, "TE TransformerLayer + FP8": 21.7}
TE_PUBLISHED_BATCH = 8


class BasicMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, linear: Callable[..., nn.Module]) -> None:
        super().__init__()
        self.linear1, self.linear2 = linear(hidden, ffn), linear(ffn, hidden)

    def forward(self, x):
        return self.linear2(F.gelu(self.linear1(x), approximate="tanh"))


def sdpa_attention(q, k, v, dropout_p):
    """q, k, v: [s, b, heads, d] views -> [s, b, heads * d], causal SDPA (flash on GPU)."""
    s, b, h, d = q.shape
    out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                         dropout_p=dropout_p, is_causal=True)
    return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


class BasicTransformerLayer(nn.Module):
    """The tutorial's baseline layer (x: [seq, batch, hidden]); ``linear`` / ``layernorm`` pick the
    modules (torch.nn or tachyon.nn)."""

    def __init__(self, hidden: int, ffn: int, heads: int, linear=nn.Linear, layernorm=nn.LayerNorm) -> None:
        super().__init__()
        self.heads, self.kv_channels = heads, hidden // heads
        self.ln1 = layernorm(hidden, eps=1e-5)
        self.qkv_projection = linear(hidden, 3 * hidden)
        self.projection = linear(hidden, hidden)
        self.dropout = nn.Dropout(DROPOUT)
        self.ln2 = layernorm(hidden, eps=1e-5)
        self.mlp = BasicMLP(hidden, ffn, linear)

    def forward(self, x):
        res = x
        qkv = self.qkv_projection(self.ln1(x))
        qkv = qkv.view(qkv.size(0), qkv.size(1), self.heads, 3 * self.kv_channels)
        q, k, v = torch.split(qkv, self.kv_channels, dim=3)
        x = self.dropout(self.projection(sdpa_attention(q, k, v, DROPOUT if self.training else 0.0))) + res
        return self.mlp(self.ln2(x)) + x


class FusedTransformerLayer(nn.Module):
    """The tutorial's third step: LayerNormLinear for LN + QKV, LayerNormMLP, SDPA attention."""

    def __init__(self, hidden: int, ffn: int, heads: int) -> None:
        super().__init__()
        import tachyon.nn as tnn

        self.heads, self.kv_channels = heads, hidden // heads
        self.ln_qkv = tnn.LayerNormLinear(hidden, 3 * hidden, eps=1e-5)
        self.projection = tnn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(DROPOUT)
        self.ln_mlp = tnn.LayerNormMLP(hidden, ffn, eps=1e-5)

    def forward(self, x):
        res = x
        qkv = self.ln_qkv(x)
        qkv = qkv.view(qkv.size(0), qkv.size(1), self.heads, 3 * self.kv_channels)
        q, k, v = torch.split(qkv, self.kv_channels, dim=3)
        x = self.dropout(self.projection(sdpa_attention(q, k, v, DROPOUT if self.training else 0.0))) + res
        return self.ln_mlp(x) + x


RECIPES = ("current", "delayed", "block")  # the order their rows run in


def fp8_recipe(name: str):
    """The FP8 recipe of a ``--recipe`` name: the tutorial's delayed scaling, or TE 2.x's defaults."""
    from tachyon.fp8 import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format

    if name == "delayed":
        return DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    return {"current": Float8CurrentScaling, "block": Float8BlockScaling}[name]()


def build_variants(shape: dict, dtype: torch.dtype, device: str,
                   recipes: tuple[str, ...] = RECIPES) -> dict[str, Callable[[], tuple[nn.Module, object]]]:
    """name -> a builder returning (module in train mode on ``device``/``dtype``, forward context)."""
    import tachyon
    import tachyon.nn as tnn

    h, f, heads = shape["hidden"], shape["ffn"], shape["heads"]

    def make(factory, ctx=contextlib.nullcontext):
        def build():
            module = factory().to(device=device, dtype=dtype).train()
            return module, ctx
        return build

    def te_layer():
        return tnn.TransformerLayer(h, f, heads, hidden_dropout=DROPOUT, attention_dropout=DROPOUT)

    def fp8_ctx(name):
        return lambda: tachyon.autocast(enabled=True, recipe=fp8_recipe(name))

    def graphed(build_module, ctx=contextlib.nullcontext, **fp8):
        def build():
            import tachyon

            module = build_module().to(device=device, dtype=dtype).train()
            if device != "cuda":
                return module, ctx
            x = torch.randn(shape["seq"], shape["batch"], h, device=device, dtype=dtype, requires_grad=True)
            return tachyon.make_graphed_callables(module, (x,), **fp8), contextlib.nullcontext
        return build

    variants = {  # most valuable first: a run cut off by its time limit keeps these
        "torch.nn": make(lambda: BasicTransformerLayer(h, f, heads)),
        "TransformerLayer": make(te_layer),
        "TransformerLayer graphed": graphed(te_layer),
    }
    if dtype == torch.bfloat16:
        for name in (r for r in RECIPES if r in recipes):
            variants[f"TransformerLayer+FP8 ({name})"] = make(te_layer, fp8_ctx(name))
            variants[f"TransformerLayer+FP8 ({name}) graphed"] = graphed(
                te_layer, fp8_ctx(name), fp8_enabled=True, fp8_recipe=fp8_recipe(name))
    variants["+tachyon Linear/LN"] = make(lambda: BasicTransformerLayer(h, f, heads, linear=tnn.Linear,
                                                                        layernorm=tnn.LayerNorm))
    variants["+LayerNormLinear/MLP"] = make(lambda: FusedTransformerLayer(h, f, heads))
    # on CPU (the smoke run) the inductor backend would need a C++ compiler
    compile_kwargs = {} if device == "cuda" else {"backend": "aot_eager"}
    variants["torch.compile"] = make(lambda: torch.compile(BasicTransformerLayer(h, f, heads), **compile_kwargs))
    return variants


def layer_flops(shape: dict) -> float:
    """Forward FLOPs of one layer (GEMMs + causal attention); forward+backward is 3x."""
    h, f, s, b = shape["hidden"], shape["ffn"], shape["seq"], shape["batch"]
    return 2.0 * s * b * h * (4 * h + 2 * f) + 2.0 * b * s * s * h


def time_variant(module: nn.Module, ctx, x: torch.Tensor, dy: torch.Tensor, mode: str, reps: dict | None = None,
                 graphed: bool = False):
    """(fn to time, Timing): mode "fwd" (training forward) or "fwd+bwd"; ``graphed``: the module is
    already CUDA graphs (no capture of it again: graph_ms stays empty, the median is the replay)."""
    def fwd():
        with ctx():
            return module(x)

    def fwd_bwd():
        module.zero_grad(set_to_none=True)
        fwd().backward(dy)

    fn = fwd if mode == "fwd" else fwd_bwd
    for _ in range(3):  # compile, autotune, FP8 amax history
        fn()
    return fn, bench(fn, **(reps or {}), graph=ALREADY_GRAPHED if graphed else True)


COLUMNS = ["variant", "backend", "dtype", "mode", "shape", "median_ms", "p20_ms", "p80_ms", "graph_ms", "host_ms",
           "TFLOP/s", "frac_bf16_peak", "speedup_vs_torch.nn", "speedup_vs_TransformerLayer", "peak_mem_MB", "note"]
TORCH_ONLY = ("torch.nn", "torch.compile")  # no tachyon module inside: no backend to name


def run(shape: dict, dtypes, device: str = "cuda", bf16_peak: float | None = None, reps: dict | None = None,
        recipes: tuple[str, ...] = RECIPES, out: Stream | None = None) -> list[dict]:
    """Every variant's rows, each handed to ``out`` (printed and written) as it is measured."""
    out = out or Stream(None, "te_layer", COLUMNS, echo=False)
    fwd_flops = layer_flops(shape)
    for dtype in dtypes:
        x = torch.randn(shape["seq"], shape["batch"], shape["hidden"], device=device, dtype=dtype)
        dy = torch.randn_like(x)
        baseline = {}
        layer_ms = {}
        for name, build in build_variants(shape, dtype, device, recipes).items():
            module, ctx = build()
            for mode, flops in (("fwd", fwd_flops), ("fwd+bwd", 3 * fwd_flops)):
                fn, t = time_variant(module, ctx, x, dy, mode, reps, graphed=name.endswith("graphed"))
                tflops = t.rate(flops) / 1e12
                baseline.setdefault(mode, t.median_ms)
                if name == "TransformerLayer":
                    layer_ms[mode] = t.median_ms
                out.add({
                    "variant": name, "backend": "-" if name in TORCH_ONLY else "auto",
                    "dtype": str(dtype).removeprefix("torch."), "mode": mode,
                    "shape": "h{hidden} f{ffn} a{heads} s{seq} b{batch}".format(**shape), **t.columns(), "TFLOP/s": tflops,
                    "frac_bf16_peak": tflops * 1e12 / bf16_peak if bf16_peak else float("nan"),
                    "speedup_vs_torch.nn": baseline[mode] / t.median_ms,
                    "speedup_vs_TransformerLayer": layer_ms[mode] / t.median_ms if mode in layer_ms else float("nan"),
                    "peak_mem_MB": peak_memory(fn) / 2**20,
                })
            del module
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    return out.rows


def published_rows(shape: dict) -> list[dict]:
    """TE's published H100 batch-8 BF16 figures, scaled to ``shape``'s batch (not measured)."""
    scale = shape["batch"] / TE_PUBLISHED_BATCH
    flops_b8 = 3 * layer_flops({**shape, "batch": TE_PUBLISHED_BATCH})
    return [{
        "published (not measured)": name, "H100 batch-8 ms": ms, f"scaled to batch {shape['batch']} ms": ms * scale,
        "TFLOP/s (our FLOP count)": flops_b8 / (ms * 1e-3) / 1e12,
    } for name, ms in TE_PUBLISHED.items()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a smaller shape (hidden 1024, seq 512)")
    parser.add_argument("--smoke", action="store_true", help="CPU, toy shape: the code paths, not a measurement")
    parser.add_argument("--recipe", nargs="+", choices=RECIPES, default=list(RECIPES),
                        help="the FP8 recipes to run a TransformerLayer+FP8 row for (default: all)")
    args = parser.parse_args()
    recipes = tuple(args.recipe)
    if args.smoke:
        out = Stream(None, "te_layer", COLUMNS, title="smoke run on CPU (toy shape; timings meaningless)")
        run(SMOKE, (torch.bfloat16, torch.float32), device="cpu", reps={"warmup": 1, "rep": 2}, recipes=recipes, out=out)
        out.table()
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_te_layer needs a CUDA GPU")
    shape = QUICK if args.quick else FULL
    peak = measure_matmul_peak(torch.bfloat16)
    print(f"measured bf16 matmul peak: {peak / 1e12:.0f} TFLOP/s", flush=True)
    out = Stream("bench_te_layer.csv", "te_layer", COLUMNS,
                 title="GPT layer, TE tutorial progression (forward / forward+backward)")
    run(shape, (torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float16), bf16_peak=peak, recipes=recipes,
        out=out)
    out.table()
    if shape is FULL:
        print_table(published_rows(shape), title="Transformer Engine, published H100 figures (NOT measured here; "
                                                 "batch 8 scaled by batch / 8)")
    else:
        print("\n(published Transformer Engine figures are for the full shape; run without --quick to compare)")


if __name__ == "__main__":
    main()

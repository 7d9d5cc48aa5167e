"""Bytes moved and kernel launches per training step of a unit, counted exactly on CPU, beside the
module a user would otherwise run and beside the minimum the shapes allow.

Units (batch 1, or each of --batches; fp32 and bf16; forward + backward unless said):

    bert       TransformerKernelLayer (post-LN, BERT-Large width: hidden 1024, 16 heads, ffn 4096,
               dropout 0.1), without memory flags and with each flag, at seq 128 and 512, vs HF
               BertLayer in eager attention and HF BertLayer with its attention as one fused SDPA
               (flash) call
    gpt        tachyon.nn.TransformerLayer, GPT configuration (LayerNorm, tanh GELU, biases, causal,
               dropout 0.1; hidden 1024, 16 heads, ffn 4096), vs HF GPT2Block (eager / flash)
    llama      tachyon.nn.TransformerLayer, Llama configuration (RMSNorm, SwiGLU, RoPE, GQA 16/4
               heads, no bias, no dropout; hidden 1024, ffn 2816), vs HF LlamaDecoderLayer
    adam       one FusedAdam step over the BERT layer's parameters (fp32) vs torch.optim.AdamW
               (foreach, fused); the step after the first (the first also allocates the states).
               The step counts are host scalars for tachyon and torch's foreach path (not
               counted: host work on a GPU) and device tensors for torch's fused path
    decode     one decode step of the injected inference decoder (tachyon.init_inference; fp32 and
               INT8 weights) at batch 1 and 16, context 128, vs HF GPT2LMHeadModel with its KV
               cache; a small GPT-2 (hidden 256, 4 layers, vocab 2048, benchmarks/bench_inference.py's
               SMALL), minimum = the weights one step reads + the KV cache (bench_inference.floor_bytes),
               compared with the bytes the step reads ('x minimum' of a decode row: read / floor)

How: tachyon.profiling.TrafficCounter. tachyon's kernels run through Triton's CPU interpreter
(backend="triton", TRITON_INTERPRET=1 set here before triton is imported), every other op is
counted by its inputs and outputs (see src/tachyon/profiling/traffic.py). The HF modules run as a
GPU runs them: ``F.dropout`` is routed to ``aten.native_dropout`` (what ``at::dropout`` picks on
CUDA: one kernel, a bool mask; on CPU it picks bernoulli_ + div_ + mul), and the "flash" anchors
run SDPA with attention-probability dropout 0 so that the CPU takes its fused flash kernel: a
flash kernel moves the same bytes with dropout (the mask is regenerated from a seed). In bf16,
tachyon's attention runs its bf16 kernels under the interpreter (whose bf16 tl.dot gives wrong
values: the addresses, hence bytes and launches, are those of the GPU run; the values are not
used). Minimum: src/tachyon/profiling/traffic_minimum.py.

Scaling: everything but attention is linear in tokens (batch * seq); attention's compulsory bytes
are linear in tokens too (flash keeps no [seq, seq] tensor; HF eager's scores are batch * heads *
seq^2), and its requested bytes (re-reads of K/V per query block) grow with seq^2 / BLOCK_M
(interpreter tiles are 32 x 32; a GPU's 64-128 re-read 2-4x less). Counts at batch B are B times
the batch-1 counts for the elementwise part; launches do not change with shapes. The GEMMs' weight
traffic does not grow with the batch at all, and at batch 1 it is most of a layer's bytes (HF's and
tachyon's alike): ``--batches 2,3`` (or 2,3,4, to check the line) gives each variant's per-step and
per-sequence bytes and from them the bytes at issue 14's GPU benchmark batch (seq 128 x 64, seq
512 x 16), where activations dominate as they do in training; see ``scaling_rows``.

Grids: under the interpreter the backward kernels run few programs, so their fp32 partial sums
(one row per program) are small; a GPU runs 4-8 programs per SM and writes and reads that many
rows. ``--as-gpu-sms 132`` launches an H100's grids under the interpreter, so the count includes
the partial sums an H100 run would move.

    python benchmarks/bench_traffic.py                      # everything (about an hour on 2 cores)
    python benchmarks/bench_traffic.py --quick              # seq 128, fp32, no flags, + adam, decode
    python benchmarks/bench_traffic.py --smoke              # tiny shapes: checks that the script runs
    python benchmarks/bench_traffic.py --units bert --seqs 512 --dtypes fp32 --flags none --as-gpu-sms 132
    python benchmarks/bench_traffic.py --units bert --seqs 512 --dtypes fp32 --flags none
    python benchmarks/bench_traffic.py --units bert,gpt,llama --seqs 128 --dtypes fp32 --flags none --batches 2,3,4
    --out FILE  the markdown report (default benchmarks/results/<today>-cpu-traffic.md); CSV rows
    go to $TACHYON_BENCH_OUT or benchmarks/results/latest/bench_traffic.csv.

On a machine with a GPU (benchmarks/gpu.sh runs every bench_*.py) it does nothing unless
``--on-gpu-machine``: the counts are the same on any machine.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import format_table, machine_info, output_dir, write_csv  # noqa: E402

HIDDEN, HEADS, FFN = 1024, 16, 4096
LLAMA_FFN, LLAMA_KV_HEADS = 2816, 4
DROPOUT = 0.1
FLAGS = ("none", "normalize_invertible", "gelu_checkpoint", "attn_dropout_checkpoint")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIB = float(1 << 20)


@dataclasses.dataclass
class Result:
    unit: str
    variant: str
    dtype: str
    seq: int
    counter: object  # TrafficCounter
    minimum: object | None = None  # traffic_minimum.Minimum (decode: weights + KV cache, launches 0 = not stated)
    anchor: str | None = None  # variant name of the anchor in the same unit/dtype/seq/batch
    seconds: float = 0.0
    batch: int = 1  # sequences per step (bert, gpt, llama; decode keeps its batch in seq)


# --- the HF modules as a GPU runs them --------------------------------------------------------


@contextlib.contextmanager
def gpu_dropout_path():
    """F.dropout as CUDA's at::dropout: aten.native_dropout (one kernel, bool mask)."""
    original = F.dropout

    def dropout(x, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return x
        return torch.native_dropout(x, p, True)[0]

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = original


def count(fn, *args, host_tensors=()):
    from tachyon.profiling import TrafficCounter

    start = time.perf_counter()
    with gpu_dropout_path(), TrafficCounter(host_tensors=host_tensors) as counter:
        fn(*args)
    return counter, time.perf_counter() - start


def _step(module, x, grad, **kw):
    x = x.detach().requires_grad_()  # a fresh leaf: no gradient accumulated from an earlier run
    out = module(x, **kw)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad)


# --- units ---------------------------------------------------------------------------------------


def bert_units(seq: int, dtype_name: str, flags: list[str], batch: int = 1) -> list[Result]:
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    from tachyon.nn import TransformerKernelConfig, TransformerKernelLayer
    from tachyon.profiling.traffic_minimum import bert_layer_minimum

    dtype = DTYPES[dtype_name]
    x = torch.randn(batch, seq, HIDDEN).to(dtype).requires_grad_()
    grad = torch.randn(batch, seq, HIDDEN).to(dtype)
    results = []
    for name, impl, p_attn in (("HF BertLayer (eager)", "eager", DROPOUT), ("HF BertLayer (flash)", "sdpa", 0.0)):
        config = BertConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=FFN,
                            hidden_dropout_prob=DROPOUT, attention_probs_dropout_prob=p_attn)
        config._attn_implementation = impl
        layer = BertLayer(config).to(dtype).train()
        counter, seconds = count(_step, layer, x, grad)
        results.append(Result("bert", name, dtype_name, seq, counter,
                              bert_layer_minimum(batch, seq, HIDDEN, FFN, HEADS, dtype), None, seconds, batch))
    for flag in flags:
        kw = {} if flag == "none" else {flag: True}
        config = TransformerKernelConfig(
            batch_size=batch, max_seq_length=seq, hidden_size=HIDDEN, intermediate_size=FFN, heads=HEADS,
            attn_dropout_ratio=DROPOUT, hidden_dropout_ratio=DROPOUT, num_hidden_layers=24, initializer_range=0.02,
            seed=1234, pre_layer_norm=False, bf16=dtype == torch.bfloat16, **kw)
        layer = TransformerKernelLayer(config, backend="triton").train()
        counter, seconds = count(_step, layer, x, grad)
        minimum = bert_layer_minimum(batch, seq, HIDDEN, FFN, HEADS, dtype, **kw)
        results.append(Result("bert", f"tachyon BERT kernel layer ({flag})", dtype_name, seq, counter, minimum,
                              "HF BertLayer (eager)", seconds, batch))
    return results


def _hf_causal_mask(seq: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((seq, seq), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]


def te_units(kind: str, seq: int, dtype_name: str, batch: int = 1) -> list[Result]:
    from tachyon.nn import TransformerLayer
    from tachyon.nn.rope import RotaryTables
    from tachyon.profiling.traffic_minimum import transformer_layer_minimum

    dtype = DTYPES[dtype_name]
    x = torch.randn(batch, seq, HIDDEN).to(dtype).requires_grad_()
    grad = torch.randn(batch, seq, HIDDEN).to(dtype)
    results = []
    if kind == "gpt":
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        minimum = transformer_layer_minimum(batch, seq, HIDDEN, FFN, HEADS, None, dtype)
        anchors = []
        for name, impl, p_attn in (("HF GPT2Block (eager)", "eager", DROPOUT), ("HF GPT2Block (flash)", "sdpa", 0.0)):
            config = GPT2Config(n_embd=HIDDEN, n_head=HEADS, n_inner=FFN, n_positions=seq, resid_pdrop=DROPOUT,
                                attn_pdrop=p_attn, embd_pdrop=0.0, attn_implementation=impl)
            anchors.append((name, GPT2Block(config, layer_idx=0).to(dtype).train(),
                            {"attention_mask": _hf_causal_mask(seq, dtype)} if impl == "eager" else {}))
        ours = TransformerLayer.from_hf(anchors[0][1], backend="triton")
        ours.hidden_dropout = DROPOUT
        ours.self_attention.core_attention.attention_dropout = DROPOUT
        ours_kw = {}
    else:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        minimum = transformer_layer_minimum(batch, seq, HIDDEN, LLAMA_FFN, HEADS, LLAMA_KV_HEADS, dtype,
                                            normalization="RMSNorm", gated=True, bias=False, dropout=False)
        anchors = []
        for name, impl in (("HF LlamaDecoderLayer (eager)", "eager"), ("HF LlamaDecoderLayer (flash)", "sdpa")):
            config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=LLAMA_KV_HEADS,
                                 intermediate_size=LLAMA_FFN, num_hidden_layers=1, attn_implementation=impl)
            layer = LlamaDecoderLayer(config, layer_idx=0).to(dtype).train()
            cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(seq)[None])
            kw = {"position_embeddings": (cos, sin)}
            if impl == "eager":
                kw["attention_mask"] = _hf_causal_mask(seq, dtype)
            anchors.append((name, layer, kw))
        ours = TransformerLayer.from_hf(anchors[0][1], backend="triton")
        cos, sin = anchors[0][2]["position_embeddings"]
        ours_kw = {"rotary_pos_emb": RotaryTables(cos[0].float(), sin[0].float())}
    ours = ours.train()
    for name, layer, kw in anchors:
        counter, seconds = count(lambda m=layer, k=kw: _step(m, x, grad, **k))
        results.append(Result(kind, name, dtype_name, seq, counter, minimum, None, seconds, batch))
    counter, seconds = count(lambda: _step(ours, x, grad, **ours_kw))
    results.append(Result(kind, "tachyon TransformerLayer", dtype_name, seq, counter, minimum, anchors[0][0], seconds,
                          batch))
    return results


def decode_units(context: int = 128, batches: tuple[int, ...] = (1, 16)) -> list[Result]:
    import copy

    import tachyon
    from benchmarks.bench_inference import SMALL, floor_bytes, gpt2
    from tachyon.profiling.traffic_minimum import Minimum, Step

    shape = dict(SMALL)
    if HIDDEN < 1024:  # --smoke
        shape.update(n_embd=64, n_head=4, n_layer=2, vocab_size=96)
    model = gpt2(shape)
    engines = [("tachyon decode (fp32)", torch.float32, 4), ("tachyon decode (INT8 weights)", torch.int8, 1)]
    engines = [(name, tachyon.init_inference(copy.deepcopy(model), dtype=dt).module, wb) for name, dt, wb in engines]
    results = []
    for batch in batches:
        prompt = torch.randint(3, shape["vocab_size"], (batch, context))
        nxt = torch.randint(3, shape["vocab_size"], (batch, 1))

        def floor(weight_bytes: int) -> Minimum:
            f = floor_bytes(shape, weight_bytes, context, batch, 4)
            return Minimum("decode step", (Step("weights", int(f["weights"]), 0, 0), Step("KV cache", int(f["kv_cache"]), 0, 0)))

        with torch.no_grad():
            cache = model(prompt, use_cache=True).past_key_values
            counter, seconds = count(lambda: model(nxt, cache=cache, use_cache=True))
        results.append(Result("decode", "HF GPT2LMHeadModel (eager, KV cache)", "fp32", batch, counter, floor(4), None,
                              seconds))
        for name, decoder, weight_bytes in engines:
            kv = decoder.new_cache(batch, context + 1)
            with torch.no_grad(), tachyon.use_backend("triton"):
                decoder.step(prompt, torch.arange(context).expand(batch, context), kv, last_only=True)
                counter, seconds = count(lambda d=decoder, c=kv: d.step(nxt, torch.full((batch, 1), context), c,
                                                                        last_only=True))
            results.append(Result("decode", name, "fp32", batch, counter, floor(weight_bytes),
                                  "HF GPT2LMHeadModel (eager, KV cache)", seconds))
    return results


def adam_units() -> list[Result]:
    from tachyon.engine.optim import FusedAdam
    from tachyon.nn import TransformerKernelConfig, TransformerKernelLayer
    from tachyon.profiling.traffic_minimum import adam_minimum

    config = TransformerKernelConfig(batch_size=1, max_seq_length=8, hidden_size=HIDDEN, intermediate_size=FFN,
                                     heads=HEADS, attn_dropout_ratio=DROPOUT, hidden_dropout_ratio=DROPOUT,
                                     num_hidden_layers=24, initializer_range=0.02, seed=1)
    shapes = [tuple(p.shape) for p in TransformerKernelLayer(config).parameters()]
    minimum = adam_minimum([torch.Size(s).numel() for s in shapes])
    results = []
    makers = {
        "torch AdamW (foreach)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True),
        "torch AdamW (fused)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
        "tachyon FusedAdam": lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.01, backend="triton"),
    }
    for name, make in makers.items():
        params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = make(params)
        if isinstance(opt, FusedAdam):  # the first step (it creates the states) needs no interpreter
            opt.backend = "torch"
            opt.step()
            opt.backend = "triton"
            opt.step()  # builds the kernel's cached program map: not a per-step cost
        else:
            opt.step()  # the first step also creates the states
        # step counts: CPU scalars a GPU run updates on the host (torch's foreach and tachyon);
        # the fused torch optimizer keeps them on the device (its step += 1 is a launch)
        host = [] if "fused" in name else [opt.state[p]["step"] for p in params]
        counter, seconds = count(opt.step, host_tensors=host)
        results.append(Result("adam", name, "fp32", 0, counter, minimum,
                              None if name.endswith("(foreach)") else "torch AdamW (foreach)", seconds))
    return results


# --- report --------------------------------------------------------------------------------------


def summary_rows(results: list[Result]) -> list[dict]:
    rows = []
    for r in results:
        total = r.counter.total
        anchor = next((a for a in results if a.unit == r.unit and a.dtype == r.dtype and a.seq == r.seq
                       and a.batch == r.batch and a.variant == r.anchor), None)
        flash = next((a for a in results if a.unit == r.unit and a.dtype == r.dtype and a.seq == r.seq
                      and a.batch == r.batch and a.variant.endswith("(flash)")), None)
        rows.append({
            "unit": r.unit, "seq": (f"batch {r.seq}" if r.unit == "decode" else r.seq) or "",
            "batch": r.batch if r.unit in ("bert", "gpt", "llama") else "", "dtype": r.dtype,
            "variant": r.variant,
            "MiB": round(total.bytes / MIB, 2),
            "x anchor": round(total.bytes / anchor.counter.total.bytes, 3) if anchor else "",
            "x flash anchor": round(total.bytes / flash.counter.total.bytes, 3) if flash and flash is not r
            and not r.variant.startswith("HF") else "",
            # decode: the floor is what a step must read; its reads are compared with it
            "x minimum": round((total.read if r.unit == "decode" else total.bytes) / r.minimum.bytes, 3)
            if r.minimum else "",
            "launches": total.launches,
            "min launches": r.minimum.launches if r.minimum and r.minimum.launches else "",
            "requested MiB": round(total.requested / MIB, 2),
        })
    return rows


def goal_rows(results: list[Result]) -> list[dict]:
    """The issue's goals, each checked where its unit was measured."""
    def find(unit, variant, dtype="fp32", seq=None, batch=1):
        return next((r for r in results if r.unit == unit and r.variant == variant and r.dtype == dtype
                     and (seq is None or r.seq == seq) and r.batch == batch), None)

    rows = []

    def check(goal, r, anchor, max_anchor, max_minimum, max_launches=None):
        if r is None or anchor is None:
            return
        t = r.counter.total
        x_anchor, x_min = t.bytes / anchor.counter.total.bytes, t.bytes / r.minimum.bytes
        if max_anchor is None:  # the anchor goal is stated at another sequence length
            parts = [f"{x_anchor:.3f}x anchor (its goal is at seq 512)", f"{x_min:.3f}x minimum (goal <= {max_minimum})"]
            met = x_min <= max_minimum
        else:
            parts = [f"{x_anchor:.3f}x anchor (goal <= {max_anchor})", f"{x_min:.3f}x minimum (goal <= {max_minimum})"]
            met = x_anchor <= max_anchor and x_min <= max_minimum
        if max_launches is not None:
            parts.append(f"{t.launches} launches (goal <= {max_launches})")
            met = met and t.launches <= max_launches
        rows.append({"goal": goal, "measured": "; ".join(parts), "met": "yes" if met else "no"})

    layer_units = (("bert", "BERT kernel layer", "tachyon BERT kernel layer (none)", "HF BertLayer (eager)"),
                   ("gpt", "TransformerLayer (GPT)", "tachyon TransformerLayer", "HF GPT2Block (eager)"),
                   ("llama", "TransformerLayer (Llama)", "tachyon TransformerLayer", "HF LlamaDecoderLayer (eager)"))
    for unit, label, ours, anchor in layer_units:
        for seq, batch in sorted({(r.seq, r.batch) for r in results if r.unit == unit}):
            check(f"{label} fwd+bwd, seq {seq}, batch {batch}, fp32{', no flags' if unit == 'bert' else ''}, "
                  f"vs {anchor}", find(unit, ours, seq=seq, batch=batch), find(unit, anchor, seq=seq, batch=batch),
                  0.42 if seq == 512 else None, 1.15, 28)
    adam = find("adam", "tachyon FusedAdam")
    if adam is not None:
        t, m = adam.counter.total, adam.minimum
        rows.append({"goal": "FusedAdam step exactly at its minimum (param, grad, m, v read; param, m, v written)",
                     "measured": f"{t.bytes - m.bytes} bytes above the minimum of {m.bytes} ({t.bytes / m.bytes:.5f}x), "
                                 f"{t.launches} launch",
                     "met": "yes" if t.bytes == m.bytes and t.launches == 1 else "no"})
    for r in results:
        if r.unit == "decode" and r.variant.startswith("tachyon"):
            x = r.counter.total.read / r.minimum.bytes
            rows.append({"goal": f"{r.variant}, batch {r.seq}: bytes read <= 1.05x weights + KV cache",
                         "measured": f"{x:.3f}x ({r.counter.total.written / MIB:.3f} MiB written beside)",
                         "met": "yes" if x <= 1.05 else "no"})
    return rows


# issue 14's GPU benchmark shapes of the BERT layer (seq 128 at batch 64, seq 512 at batch 16)
GPU_BATCH = {128: 64, 512: 16}


def scaling_rows(results: list[Result]) -> list[dict]:
    """Bytes at the GPU benchmark's batch, from the counts at the two largest counted batches (b1
    < b2) of the same unit, seq and dtype: a step's bytes are a + b * batch (weights once per step;
    activations, attention and what is kept for backward per sequence), so a = B(b1) - b1 * b and
    b = (B(b2) - B(b1)) / (b2 - b1). Count at batch 2 and more: at batch 1 HF's eager layers skip
    copies that every larger batch makes (fewer launches), so batch 1 is off their line. A third
    counted batch checks the line (the deviation of the smallest from it is printed)."""
    rows = []
    keys = sorted({(r.unit, r.dtype, r.seq, r.variant) for r in results if r.unit in ("bert", "gpt", "llama")})
    for unit, dtype, seq, variant in keys:
        counted = sorted((r.batch, r) for r in results
                         if (r.unit, r.dtype, r.seq, r.variant) == (unit, dtype, seq, variant))
        target = GPU_BATCH.get(seq)
        if len(counted) < 2 or target is None:
            continue
        (b1, r1), (b2, r2) = counted[-2], counted[-1]
        slope = (r2.counter.total.bytes - r1.counter.total.bytes) / (b2 - b1)
        fixed = r1.counter.total.bytes - b1 * slope
        check = ""
        if len(counted) > 2:
            b0, r0 = counted[0]
            check = f"batch {b0}: {(fixed + b0 * slope) / r0.counter.total.bytes - 1:+.2e}"
        rows.append({"unit": unit, "dtype": dtype, "seq": seq, "variant": variant, "counted batches": ",".join(
            str(b) for b, _ in counted), "per-step MiB": round(fixed / MIB, 2), "per-sequence MiB": round(slope / MIB, 2),
            "line vs smallest batch": check, "batch": target, "MiB at batch": round((fixed + target * slope) / MIB, 1),
            "_bytes": fixed + target * slope, "_anchor": r1.anchor})
    for row in rows:  # ratios to the anchor at the same batch
        anchor = next((a for a in rows if (a["unit"], a["dtype"], a["seq"]) == (row["unit"], row["dtype"], row["seq"])
                       and a["variant"] == row["_anchor"]), None)
        row["x anchor at batch"] = round(row["_bytes"] / anchor["_bytes"], 3) if anchor else ""
    return [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows]


def write_report(path: Path, results: list[Result], argv: list[str], rows: list[dict]) -> None:
    info = machine_info()
    commit = info["commit"]
    if commit.endswith("-dirty"):
        commit = f"HEAD {commit[:-len('-dirty')]} with uncommitted changes"
    lines = [
        "# Bytes moved and kernel launches per step, counted on CPU",
        "",
        f"Date: {info['date']} UTC. Machine: CPU only ({os.cpu_count()} cores). Commit: {commit}. "
        f"Versions: torch {info['torch']}, triton {info['triton']}, Python {sys.version.split()[0]}.",
        "",
        "Command:",
        "",
        "```",
        "python benchmarks/bench_traffic.py " + " ".join(argv),
        "```",
        "",
        "Method, units and scaling: the docstring of benchmarks/bench_traffic.py. Bytes are MiB "
        "(2^20); 'x anchor' divides by the first anchor of the unit (HF eager; torch AdamW foreach), "
        "'x flash anchor' by the HF module with its attention as one fused SDPA call, 'x minimum' by "
        "tachyon.profiling.traffic_minimum for the same math and flags. 'requested' adds the re-reads "
        "(Triton kernels: every active lane of every load/store; torch ops: the same as compulsory).",
        "",
        "## Per unit",
        "",
        format_table(rows),
        "",
        "## Goals (issue 21)",
        "",
        format_table(goal_rows(results)),
        "",
    ]
    scaled = scaling_rows(results)
    if scaled:
        lines += ["## At the GPU benchmark's batch (issue 14: seq 128 x 64, seq 512 x 16)", "",
                  scaling_rows.__doc__.split("\n\n")[0].replace("\n    ", " "), "", format_table(scaled), ""]
    for r in results:
        where = {"decode": f"batch {r.seq}", "adam": "step"}.get(r.unit, f"seq {r.seq} batch {r.batch}")
        lines += [f"## {r.unit} {where} {r.dtype}: {r.variant} (counted in {r.seconds:.0f} s)", "", "```",
                  r.counter.table(), "```", ""]
        if r.minimum is not None and not r.variant.startswith(("HF", "torch")) and r.minimum.launches:
            lines += ["Minimum:", "", "```", r.minimum.table(), "```", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--units", default="bert,gpt,llama,adam,decode",
                        help="comma-separated: bert, gpt, llama, adam, decode")
    parser.add_argument("--seqs", default="128,512", help="comma-separated sequence lengths (bert, gpt, llama)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--flags", default=",".join(FLAGS), help=f"BERT memory flags, comma-separated: {', '.join(FLAGS)}")
    parser.add_argument("--batches", default="1", help="comma-separated batch sizes (bert, gpt, llama); two or "
                        "more: the bytes at the GPU benchmark's batch follow from them (see scaling_rows)")
    parser.add_argument("--quick", action="store_true", help="seq 128, fp32, no flags, all units")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (hidden 64): checks that the script runs")
    parser.add_argument("--out", default=None, help="markdown report path")
    parser.add_argument("--on-gpu-machine", action="store_true", help="run even where CUDA is available")
    parser.add_argument("--as-gpu-sms", type=int, default=None,
                        help="launch the GPU grids of a GPU with this many SMs (H100: 132) instead of the "
                             "interpreter's small ones: the backward kernels' partial sums get the GPU's rows")
    args = parser.parse_args(argv)
    if torch.cuda.is_available() and not args.on_gpu_machine:
        print("bench_traffic: bytes and launches are counted on CPU and are the same on any machine; "
              "skipped on a GPU machine (pass --on-gpu-machine to run it here anyway)")
        return
    units = [u for u in args.units.split(",") if u]
    seqs = [int(s) for s in args.seqs.split(",") if s]
    batches = [int(b) for b in args.batches.split(",") if b]
    if not batches or min(batches) < 1:
        parser.error(f"--batches: ints >= 1; got {args.batches!r}")
    dtypes, flags = args.dtypes.split(","), args.flags.split(",")
    if args.quick:
        seqs, dtypes, flags = [128], ["fp32"], ["none"]
    if args.smoke:
        global HIDDEN, HEADS, FFN, LLAMA_FFN, LLAMA_KV_HEADS
        HIDDEN, HEADS, FFN, LLAMA_FFN, LLAMA_KV_HEADS = 64, 4, 256, 176, 2
        seqs = [40]
    for name, values, allowed in (("units", units, ("bert", "gpt", "llama", "adam", "decode")),
                                  ("dtypes", dtypes, tuple(DTYPES)),
                                  ("flags", flags, FLAGS)):
        bad = [v for v in values if v not in allowed]
        if bad:
            parser.error(f"--{name}: {bad} not allowed; choose from {', '.join(allowed)}")

    from tachyon.kernels.attention import triton as attention_triton

    attention_triton.BF16_AS_FP32_UNDER_INTERPRETER = False  # count the bf16 kernels themselves
    if args.as_gpu_sms is not None:
        if args.as_gpu_sms < 1:
            parser.error(f"--as-gpu-sms must be >= 1; got {args.as_gpu_sms}")
        from tachyon.kernels import tiling

        tiling.INTERPRETER_AS_SMS = args.as_gpu_sms
    results: list[Result] = []
    for dtype in dtypes:
        for seq in seqs if {"bert", "gpt", "llama"} & set(units) else []:
            for batch in batches:
                if "bert" in units:
                    results += bert_units(seq, dtype, flags, batch)
                for kind in ("gpt", "llama"):
                    if kind in units:
                        results += te_units(kind, seq, dtype, batch)
                print(f"counted {dtype} seq {seq} batch {batch}", flush=True)
    if "adam" in units:
        results += adam_units()
    if "decode" in units:
        results += decode_units()
    rows = summary_rows(results)
    print(format_table(rows))
    print(format_table(goal_rows(results)))
    if scaling_rows(results):
        print(format_table(scaling_rows(results)))
    for r in results:
        print(f"\n## {r.unit} {'batch' if r.unit == 'decode' else 'seq'} {r.seq} (batch {r.batch}) {r.dtype}: {r.variant}\n"
              f"{r.counter.table()}")
    write_csv(output_dir() / "bench_traffic.csv", rows, "bench_traffic")
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / f"{today}-cpu-traffic.md"
    write_report(out, results, sys.argv[1:] if argv is None else argv, rows)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

"""Inference engine: correctness and bytes per decode step (CPU), per-token decode latency (GPU).

CPU part (always; a check and a count, not a timing):
  1. correctness: tiny random GPT-2 and Llama (fp32) injected by tachyon.init_inference against
     HF: max |logits| difference, greedy tokens identical for 32 tokens (batch of 3 left-padded
     prompts), INT8 greedy tokens identical to fp32 (rate over the prompts).
  2. bytes moved by one decode step (batch 1, context 128) of a small GPT-2 (hidden 256, 4 layers,
     vocab 2048), counted exactly with tachyon.profiling.TrafficCounter (Triton kernels under the
     interpreter): HF eager with its cache vs tachyon fp32 and INT8, beside the floor (the weights
     one step must read + the KV cache); plus kernel launches. The counter counts a row gather
     (embedding, index_select on dim 0) as the rows it picks, so a step reads one row of each
     embedding table, as on a GPU.
  3. the same floor for GPT-2 XL (48 layers, hidden 1600, vocab 50257) in fp16 and INT8: the bytes
     a GPU decode step must read, which the GPU part divides by its measured copy bandwidth.

GPU part (needs CUDA): GPT-2 XL size, random weights, fp16, prompt 128 tokens, batch 1 and 16:
per-token decode latency = (generate(N + 1 tokens) - generate(1 token)) / N, for HF eager, tachyon
fp16, tachyon INT8, each tachyon variant with and without CUDA graphs, and last HF with a static
cache and torch.compile (HF's own compiled decode). Printed: ms/token, speedup over HF eager, weight +
KV bytes per step / time as GB/s and as a fraction of the device copy bandwidth measured in the
same run. Goals: >= 4x HF eager at batch 1 in fp16, >= 80% of copy bandwidth, INT8 >= 1.7x tachyon
fp16. Each row is a whole generate() call timed eagerly (no graph_ms / host_ms: GENERATE_NOTE says
why; the "+ CUDA graph" rows are tachyon replaying its captured decode step). The tachyon engines
run with their default backend ("auto"). Rows print and go to the CSV as they are measured.

Usage: python benchmarks/bench_inference.py [--cpu-only | --gpu-only] [--quick] [--smoke]
  --quick: GPU part with a GPT-2 Large-size model (36 layers, hidden 1280) and 32 new tokens
  --smoke: the GPU part's code path on CPU with a toy model (a check that the script runs)
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

if "triton" not in sys.modules and not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # count Triton kernels on CPU (before triton loads)

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import Stream, bench, measure_copy_bandwidth, output_dir, print_table, write_csv  # noqa: E402

XL = {"n_layer": 48, "n_embd": 1600, "n_head": 25, "vocab_size": 50257, "n_positions": 1024}
LARGE = {"n_layer": 36, "n_embd": 1280, "n_head": 20, "vocab_size": 50257, "n_positions": 1024}
SMALL = {"n_layer": 4, "n_embd": 256, "n_head": 8, "vocab_size": 2048, "n_positions": 512}
TOY = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 96, "n_positions": 256}
GOALS = "goals: >= 4x HF eager at batch 1 (fp16), >= 80% of copy bandwidth, INT8 >= 1.7x tachyon fp16"
# Why a generate() call gets no graph_ms: it is a host loop that cannot be captured whole (HF's builds its
# special-token tensors from Python ints, a host-to-device copy per call, and checks its stopping criteria on
# the host every token; tachyon's syncs once on the prompt's padding and captures its own decode graph on
# first use). No host_ms either: 10 more calls of a whole generate() would take seconds and measure its wall time.
GENERATE_NOTE = "a whole generate() call (host loop, syncs, host-to-device copies): not capturable"
LATENCY_COLUMNS = ["batch", "variant", "backend", "ms_per_token", "speedup_vs_hf_eager", "floor_GB_per_step", "GB_per_s",
                   "frac_copy_bw", "note"]


def gpt2(shape: dict, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel, logging

    logging.set_verbosity_error()
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(bos_token_id=1, eos_token_id=2, **shape)).eval()


def llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=256)).eval()


def left_padded(vocab: int, lengths=(9, 4, 6), seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[row, -n:] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------- CPU part


def correctness() -> list[dict]:
    import tachyon

    rows = []
    for name, make in (("GPT-2", lambda: gpt2(TOY)), ("Llama", llama)):
        model = make()
        ids, mask = left_padded(96)
        with torch.no_grad():
            ref = model(ids, attention_mask=mask).logits
            hf_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, eos_token_id=None)
        engine = tachyon.init_inference(copy.deepcopy(model), dtype=torch.float32)
        int8 = tachyon.init_inference(copy.deepcopy(model), dtype=torch.int8)
        logits = engine(ids, attention_mask=mask).logits.cpu()
        tokens = engine.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, eos_token_id=None).cpu()
        tokens8 = int8.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, eos_token_id=None).cpu()
        keep = mask.bool()
        rows.append({"model": name, "max_abs_logit_diff": float((logits - ref)[keep].abs().max()),
                     "greedy_32_identical_to_hf": bool(torch.equal(tokens, hf_tokens)),
                     "int8_prompts_identical": f"{int((tokens8 == tokens).all(1).sum())}/{len(tokens)}"})
    return rows


def floor_bytes(shape: dict, weight_bytes: float, context: int, batch: int, kv_bytes: int) -> dict[str, float]:
    """What one decode step must read: the layers' GEMM weights (weight_bytes per element, INT8
    adds a 4-byte scale per output row), norms, the tied LM head (in the activation dtype), and
    the KV cache of every layer at ``context`` tokens; weights are read once per step whatever the
    batch, the cache once per sequence."""
    h, n, v = shape["n_embd"], shape["n_layer"], shape["vocab_size"]
    gemm = n * 12 * h * h * weight_bytes + (n * (3 * h + h + 4 * h + h) * 4 if weight_bytes == 1 else 0)
    head = v * h * kv_bytes
    norms = n * 4 * h * kv_bytes + 2 * h * kv_bytes
    kv = batch * n * 2 * context * h * kv_bytes
    return {"weights": gemm + head + norms, "kv_cache": kv, "total": gemm + head + norms + kv}


def decode_traffic(context: int = 128) -> list[dict]:
    """Bytes moved by one decode step, counted (not timed): HF eager vs tachyon fp32 / INT8."""
    import tachyon
    from tachyon.backend import triton_interpreting
    from tachyon.profiling import TrafficCounter

    if torch.cuda.is_available() or not triton_interpreting():
        print("\n(decode traffic is counted on a machine without CUDA, with Triton's interpreter; skipped here)")
        return []
    model = gpt2(SMALL)
    prompt = torch.randint(3, SMALL["vocab_size"], (1, context))
    nxt = torch.randint(3, SMALL["vocab_size"], (1, 1))
    rows = []
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        cache = out["cache"] if "cache" in out else out.past_key_values
        with TrafficCounter(track_modules=False) as counter:
            model(nxt, cache=cache, use_cache=True)
    floor = floor_bytes(SMALL, 4, context, 1, 4)
    rows.append({"variant": "HF eager (fp32)", "MiB_read": counter.total.read / 2**20,
                 "MiB_written": counter.total.written / 2**20, "launches": counter.total.launches,
                 "floor_MiB": floor["total"] / 2**20, "read_over_floor": counter.total.read / floor["total"]})
    for label, dtype, wbytes in (("tachyon fp32", torch.float32, 4), ("tachyon INT8", torch.int8, 1)):
        engine = tachyon.init_inference(copy.deepcopy(model), dtype=dtype)
        decoder = engine.module
        kv = decoder.new_cache(1, context + 1)
        positions = torch.arange(context)[None]
        with torch.no_grad(), tachyon.use_backend("triton"):
            decoder.step(prompt, positions, kv, last_only=True)
            with TrafficCounter(track_modules=False) as counter:
                decoder.step(nxt, torch.tensor([[context]]), kv, last_only=True)
        floor = floor_bytes(SMALL, wbytes, context, 1, 4)
        rows.append({"variant": label, "MiB_read": counter.total.read / 2**20,
                     "MiB_written": counter.total.written / 2**20, "launches": counter.total.launches,
                     "floor_MiB": floor["total"] / 2**20, "read_over_floor": counter.total.read / floor["total"]})
    return rows


def xl_floor(context: int = 128) -> list[dict]:
    rows = []
    for batch in (1, 16):
        for label, wbytes in (("fp16", 2), ("INT8 weights", 1)):
            f = floor_bytes(XL, wbytes, context, batch, 2)
            rows.append({"model": "GPT-2 XL", "batch": batch, "weights": label, "weights_MiB": f["weights"] / 2**20,
                         "kv_MiB": f["kv_cache"] / 2**20, "floor_MiB_per_step": f["total"] / 2**20})
    return rows


# ---------------------------------------------------------------------------------------- GPU part


def per_token_ms(generate, batch: int, prompt_len: int, new: int, vocab: int, device) -> float:
    ids = torch.randint(3, vocab, (batch, prompt_len), device=device)
    mask = torch.ones_like(ids)

    def run(n):
        return lambda: generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None,
                                min_new_tokens=None)

    long_run, short_run = run(new + 1), run(1)
    t_long = bench(long_run, device=device.type, graph=GENERATE_NOTE, host=GENERATE_NOTE)
    t_short = bench(short_run, device=device.type, graph=GENERATE_NOTE, host=GENERATE_NOTE)
    return (t_long.median_ms - t_short.median_ms) / new


def latency(shape: dict, new: int, smoke: bool, out: Stream | None = None) -> list[dict]:
    """Per-token decode latency rows, each handed to ``out`` (printed and written) as it is measured."""
    import tachyon

    out = out or Stream(None, "inference-latency", LATENCY_COLUMNS, echo=False)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    prompt = 128 if not smoke else 8
    copy_bw = measure_copy_bandwidth() if device.type == "cuda" else float("nan")
    base = gpt2(shape).to(dtype)
    for batch in ((1, 16) if not smoke else (1, 2)):
        results = {}

        def record(name: str, ms: float, batch: int = batch, results: dict = results) -> None:
            results[name] = ms
            eager = results["HF eager"]
            wbytes = 1 if "INT8" in name else 2
            floor = floor_bytes(shape, wbytes, prompt + new // 2, batch, 2)["total"]
            gbs = floor / (ms * 1e-3) / 1e9
            out.add({"batch": batch, "variant": name, "backend": "auto" if name.startswith("tachyon") else "-",
                     "ms_per_token": ms, "speedup_vs_hf_eager": eager / ms, "floor_GB_per_step": floor / 1e9,
                     "GB_per_s": gbs, "frac_copy_bw": gbs * 1e9 / copy_bw if copy_bw == copy_bw else float("nan"),
                     "note": GENERATE_NOTE})

        hf = base.to(device)
        with torch.no_grad():
            record("HF eager", per_token_ms(hf.generate, batch, prompt, new, shape["vocab_size"], device))
        hf.to("cpu")
        for label, kwargs in (("tachyon fp16", {"dtype": dtype}), ("tachyon INT8", {"dtype": torch.int8})):
            for graph in ((False, True) if device.type == "cuda" else (False,)):
                engine = tachyon.init_inference(copy.deepcopy(base), enable_cuda_graph=graph, max_out_tokens=prompt + new + 2,
                                                **kwargs)
                name = label + (" + CUDA graph" if graph else "")
                record(name, per_token_ms(engine.generate, batch, prompt, new, shape["vocab_size"], device))
                del engine
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        # last: HF's compiled decode (its compilation is the slowest part of the run; a run cut off keeps the rest)
        hf = base.to(device)
        with torch.no_grad():
            def hf_compiled(ids, **kw):
                return hf.generate(ids, cache_implementation="static", **kw)

            try:
                record("HF static cache + torch.compile", per_token_ms(hf_compiled, batch, prompt, new,
                                                                      shape["vocab_size"], device))
            except Exception as exc:  # recorded, not hidden: the row says why it is missing
                print(f"HF + torch.compile failed: {type(exc).__name__}: {exc}", flush=True)
        hf.to("cpu")
    return out.rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-only", action="store_true", help="only the CPU part")
    parser.add_argument("--quick", action="store_true", help="GPU part at GPT-2 Large size, 32 new tokens")
    parser.add_argument("--smoke", action="store_true", help="the GPU part's code path on CPU with a toy model")
    parser.add_argument("--gpu-only", action="store_true", help="skip the CPU part (a GPU session's budget)")
    args = parser.parse_args()
    out = output_dir() / "inference.csv"
    if args.gpu_only:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu-only needs a CUDA device")
        shape = LARGE if args.quick else XL
        stream = Stream(out.name, "inference-latency", LATENCY_COLUMNS,
                        title=f"per-token decode latency ({torch.cuda.get_device_name()}); {GOALS}")
        latency(shape, 32 if args.quick else 64, False, stream)
        stream.table()
        return
    rows = correctness()
    print_table(rows, title="correctness vs HF (fp32, tiny random models)")
    write_csv(out, rows, "inference-correctness")
    rows = decode_traffic()
    print_table(rows, title="one decode step, batch 1, context 128, GPT-2 (hidden 256, 4 layers): bytes counted")
    write_csv(out, rows, "inference-decode-traffic")
    rows = xl_floor()
    print_table(rows, title="GPT-2 XL: bytes one decode step must read (context 128)")
    write_csv(out, rows, "inference-xl-floor")
    if args.cpu_only:
        return
    if not torch.cuda.is_available() and not args.smoke:
        print("\nGPU part skipped: no CUDA device (run with --smoke to check its code path on CPU)")
        return
    shape = TOY if args.smoke else (LARGE if args.quick else XL)
    new = 4 if args.smoke else (32 if args.quick else 64)
    stream = Stream(out.name, "inference-latency-smoke" if args.smoke else "inference-latency", LATENCY_COLUMNS,
                    title=f"per-token decode latency ({'smoke, CPU' if args.smoke else torch.cuda.get_device_name()}); "
                          f"{GOALS}")
    latency(shape, new, args.smoke, stream)
    stream.table()


if __name__ == "__main__":
    main()

"""Training engine: throughput of ZeRO stages 0/1/2 and model-state bytes per rank.

GPU part (needs CUDA): a GPT of ~350M parameters (GPT-2 medium shape: 24 layers, hidden 1024,
16 heads, vocab 50257, tied embeddings, sequence 1024) trained in bf16 at world size 1:
tachyon's engine (bf16 weights and gradient accumulation, fp32 masters, FusedAdam) at stages
0, 1 and 2 against a plain PyTorch AMP loop (fp32 weights, bf16 autocast,
torch.optim.AdamW(fused=True)). Reports ms per step, tokens/s, model TFLOP/s (6 * params *
tokens + attention), MFU against the datasheet peak and the measured bf16 matmul rate, and peak
memory.

CPU part (always): model-state bytes per rank that ``engine.memory_breakdown()`` measures after
the boundary backward on real gloo ranks for N = 1, 2, 4, stages 0/1/2, fp16 and bf16 (bf16 and
fp32 gradient accumulation), DeepSpeed's default zero_optimization keys, next to the formulas of
`tachyon.engine.zero.model_state_bytes`.

Live-storage part (always; with DeepSpeed's figures where ``import deepspeed`` works, otherwise a
line says why): on 2 and 4 gloo ranks, 8 x Linear(1024, 1024) (8.4M parameters, the model of the
report that first compared the default configs), bf16 and fp16, stages 0/1/2, DeepSpeed's default
keys and tuned buckets (2e5 elements, overlap_comm), under tachyon (its defaults, and bf16 with
fp32 accumulation) and DeepSpeed (``"torch_adam": true``, ``DS_ACCELERATOR=cpu``). Each rank counts
every live tensor storage of its process (`tachyon.engine.zero.live_tensor_storages`: whatever a
library keeps, reported or not) that was not alive before the model was built, after the backward,
inside the inner optimizer's step, after the step, and at every gradient hook of the backward.
DeepSpeed does not belong in the project venv: see
benchmarks/results/2026-11-25-cpu-zero-memory-default-config.md for the scratch venv it runs in.

Usage: python benchmarks/bench_engine.py [--quick] [--cpu-only] [--smoke] [--deepspeed-only]
       [--ds-gas N]
  --deepspeed-only runs only the live-storage part; --quick: 2 ranks, bf16, default keys.
  --smoke runs the GPU-part code on a tiny GPT (on CPU when there is no GPU): a check that the
  script works, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    gpu_peaks,
    measure_matmul_peak,
    output_dir,
    print_table,
    write_csv,
)


# ---------------------------------------------------------------------- the model
class Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.fc = torch.nn.Linear(hidden, 4 * hidden)
        self.out = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [batch, seq, hidden]
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(torch.nn.Module):
    """GPT-2 style decoder; ``forward(tokens [batch, seq]) -> loss`` (next-token cross entropy)."""

    def __init__(self, vocab: int, seq: int, hidden: int, layers: int, heads: int):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, hidden)
        self.wpe = torch.nn.Embedding(seq, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(hidden)
        self.layers, self.hidden, self.seq = layers, hidden, seq

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied head
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 * params + causal attention (QK^T and AV, fwd + bwd)."""
        params = sum(p.numel() for p in self.parameters())
        return 6 * params + 6 * self.layers * self.hidden * self.seq


SIZES = {
    "gpt-350m": dict(vocab=50257, seq=1024, hidden=1024, layers=24, heads=16),
    "gpt-tiny": dict(vocab=512, seq=64, hidden=64, layers=2, heads=4),
}


# ---------------------------------------------------------------------- GPU throughput
def _timed_steps(step, n_warmup: int, n_steps: int, device: torch.device) -> float:
    """Seconds per step (median of the timed steps)."""
    for _ in range(n_warmup):
        step()
    times = []
    for _ in range(n_steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _amp_baseline(size: dict, batch: int, device: torch.device, tokens: torch.Tensor):
    model = GPT(**size).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


def _tachyon(size: dict, batch: int, stage: int, tokens: torch.Tensor):
    import tachyon

    model = GPT(**size)
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 50_000_000},
    }
    engine, *_ = tachyon.initialize(model=model, config=config, dist_init_required=False)

    def step():
        engine.backward(engine(tokens))
        engine.step()

    return engine, step


def gpu_part(args) -> list[dict]:
    smoke = args.smoke
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = SIZES["gpt-tiny" if smoke else "gpt-350m"]
    batch = 2 if smoke else 8
    n_warmup, n_steps = (1, 2) if smoke else (3, 5 if args.quick else 10)
    tokens = torch.randint(0, size["vocab"], (batch, size["seq"]), device=device)
    peaks = gpu_peaks()
    measured_peak = measure_matmul_peak() if device.type == "cuda" else float("nan")
    rows = []
    variants = [("torch AMP + AdamW(fused)", None)] + [(f"tachyon ZeRO-{s}", s) for s in (0, 1, 2)]
    for name, stage in variants:
        gc.collect()  # the previous engine (parameters <-> gradient hooks form cycles)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if stage is None:
            model, step = _amp_baseline(size, batch, device, tokens)
        else:
            model, step = _tachyon(size, batch, stage, tokens)
        seconds = _timed_steps(step, n_warmup, n_steps, device)
        module = model.module if stage is not None else model
        params = sum(p.numel() for p in module.parameters())
        flops = module.flops_per_token() * batch * size["seq"]
        tflops = flops / seconds / 1e12
        row = {
            "variant": name,
            "params_M": round(params / 1e6, 1),
            "batch x seq": f"{batch}x{size['seq']}",
            "ms/step": round(seconds * 1e3, 2),
            "tokens/s": round(batch * size["seq"] / seconds),
            "TFLOP/s": round(tflops, 1),
            "MFU (datasheet)": f"{tflops / peaks['bf16']:.1%}" if peaks else "n/a",
            "of measured bf16 matmul": f"{tflops * 1e12 / measured_peak:.1%}" if measured_peak == measured_peak else "n/a",
            "peak GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else "n/a",
        }
        rows.append(row)
        del model, step
    title = f"bf16 GPT training, world size 1, {device.type}" + (" (SMOKE: tiny model, not a measurement)" if smoke else "")
    print_table(rows, title=title)
    return rows


# ---------------------------------------------------------------------- CPU memory table
def _memory_rank(rank: int, world: int, port: int, psi_config: dict, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import tachyon
    from tachyon.parallel.distributed import init_distributed

    init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120), verbose=False)
    out = []
    for precision, accum in (("fp16", None), ("bf16", None), ("bf16", "fp32")):
        for stage in (0, 1, 2):
            torch.manual_seed(0)
            model = GPT(**psi_config)
            config = {
                "train_micro_batch_size_per_gpu": 1,
                "gradient_accumulation_steps": 1,
                precision: {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                "zero_optimization": {"stage": stage},
            }
            if accum:
                config["data_types"] = {"grad_accum_dtype": accum}
            engine, *_ = tachyon.initialize(model=model, config=config)
            tokens = torch.randint(0, psi_config["vocab"], (1, psi_config["seq"]))
            while engine.global_steps == engine.skipped_steps:  # until a step creates the Adam state
                engine.backward(engine(tokens))
                engine.step()
            engine.backward(engine(tokens))  # measured after the boundary backward, before its step
            memory = engine.memory_breakdown()
            engine.step()
            out.append({"precision": precision, "accum": accum or precision, "stage": stage,
                        "psi": engine.zero.flat.num_params, **memory})
    queue.put((rank, out))
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(target, world: int, *args, timeout: float = 1800) -> dict[int, object]:
    """Run ``target(rank, world, port, *args, queue)`` on ``world`` spawned processes; returns
    {rank: what the rank put on the queue}."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=timeout) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
    return results


def cpu_memory_part(args) -> list[dict]:
    from tachyon.engine.zero import model_state_bytes

    size = dict(vocab=1000, seq=32, hidden=128, layers=2, heads=4)
    rows = []
    for world in (1, 2, 4):
        results = _spawn(_memory_rank, world, size, timeout=600)
        for entry in results[0]:
            psi, n = entry["psi"], world
            formula = model_state_bytes(psi, n, entry["stage"], grad_accum_bytes=4 if entry["accum"] == "fp32" else 2)
            rows.append({
                "N": n,
                "precision": entry["precision"],
                "grad accum": entry["accum"],
                "stage": entry["stage"],
                "Psi": psi,
                "params B": entry["parameters"],
                "grads B": entry["gradients"],
                "master B": entry["master_weights"],
                "optim B": entry["optimizer_states"],
                "model states B": entry["model_states"],
                "bytes/param": round(entry["model_states"] / psi, 2),
                "formula bytes/param": round(formula["model_states"] / psi, 2),
                "buckets B": entry["buckets"],
            })
    print_table(rows, title="model-state bytes per rank after the boundary backward, default config "
                            "(engine.memory_breakdown on gloo ranks)")
    return rows


# ---------------------------------------------------------------------- live storages vs DeepSpeed (CPU, gloo)
class MLP(torch.nn.Sequential):
    """``depth`` Linear(width, width) layers: 8 x 1024 is the 8.4M-parameter model of the report
    that DeepSpeed's default config was first compared on. x: [batch, width] -> [batch, width]."""

    def __init__(self, width: int = 1024, depth: int = 8):
        super().__init__(*[torch.nn.Linear(width, width) for _ in range(depth)])
        self.width = width


BUCKETS = {
    "default": {},  # DeepSpeed's default keys: reduce/allgather_bucket_size 5e8, overlap_comm false
    "tuned": {"reduce_bucket_size": 200_000, "allgather_bucket_size": 200_000, "overlap_comm": True},
}
POINTS = ("after backward", "in step", "after step")


def _compare_config(side: str, precision: str, accum: str | None, stage: int, buckets: str, gas: int) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        precision: {"enabled": True},
        "zero_optimization": {"stage": stage, **BUCKETS[buckets]},
    }
    if accum:
        config["data_types"] = {"grad_accum_dtype": accum}
    if side == "deepspeed":  # torch.optim.AdamW inside (no compiled op on this machine)
        config["optimizer"] = {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True, "adam_w_mode": True}}
    else:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
    return config


def _classify(new: dict, module: torch.nn.Module, inner: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of ``new`` ({storage key: bytes}) by kind: the module's parameters, the tensors the
    inner torch optimizer updates (master weights, unless they are the parameters), its state,
    and everything else (gradients, bucket buffers, anything a library keeps besides)."""
    def key(t: torch.Tensor) -> tuple[str, int]:
        return (t.device.type, t.untyped_storage().data_ptr())

    params = {key(p) for p in module.parameters()}
    masters = {key(p) for g in inner.param_groups for p in g["params"]} - params
    states = {key(v) for st in inner.state.values() for v in st.values() if torch.is_tensor(v)}
    out = dict.fromkeys(("parameters", "master_weights", "optimizer_states", "other"), 0)
    for k, nbytes in new.items():
        kind = ("parameters" if k in params else "master_weights" if k in masters
                else "optimizer_states" if k in states else "other")
        out[kind] += nbytes
    out["total"] = sum(new.values())
    return out


def _measure(side: str, precision: str, accum: str | None, stage: int, buckets: str, gas: int) -> dict:
    """Build one engine on `MLP`, train two steps (Adam's state exists), then count every live
    tensor storage of the process that was not alive before the model was built: at every
    gradient hook of the third step's backward ("in backward", which also sees the activations
    Python still references), after its backward, inside the inner optimizer's step and after
    the step."""
    import tachyon
    from tachyon.engine.zero import live_tensor_storages

    base = live_tensor_storages()
    torch.manual_seed(0)
    model = MLP()
    config = _compare_config(side, precision, accum, stage, buckets, gas)
    if side == "deepspeed":
        import deepspeed

        engine = deepspeed.initialize(model=model, config=config)[0]
        inner = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    else:
        engine = tachyon.initialize(model=model, config=config)[0]
        inner = engine.optimizer
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    x = torch.randn(4, model.width, generator=torch.Generator().manual_seed(1)).to(dtype)
    peaks: dict[str, dict] = {}

    def snapshot(point: str) -> None:
        now = live_tensor_storages()
        new = {k: v for k, v in now.items() if base.get(k) != v}
        got = _classify(new, model, inner)
        if point not in peaks or got["total"] > peaks[point]["total"]:
            peaks[point] = got

    def micro_step() -> None:
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        del loss

    for _ in range(2 * gas):
        micro_step()
        engine.step()
    original = inner.step
    handles = [p.register_post_accumulate_grad_hook(lambda _: snapshot("in backward")) for p in model.parameters()]

    def counted_step(*args, **kwargs):
        snapshot("in step")
        return original(*args, **kwargs)

    inner.step = counted_step
    try:
        for _ in range(gas):
            micro_step()
            snapshot("after backward")
            engine.step()
        snapshot("after step")
    finally:
        inner.step = original
        for h in handles:
            h.remove()
    psi = sum(p.numel() for p in model.parameters())
    optimizer = type(engine.optimizer).__name__
    del engine, model, inner
    return {"psi": psi, "optimizer": optimizer, "points": peaks}


def _warm_up(side: str) -> None:
    config = _compare_config(side, "bf16", None, 2, "default", 1)
    model = MLP(width=64, depth=2)
    if side == "deepspeed":
        import deepspeed

        engine = deepspeed.initialize(model=model, config=config)[0]
    else:
        import tachyon

        engine = tachyon.initialize(model=model, config=config)[0]
    engine.backward(engine(torch.randn(4, 64, dtype=torch.bfloat16)).float().square().mean())
    engine.step()
    del engine, model
    gc.collect()


def _compare_rank(rank: int, world: int, port: int, variants: list[tuple], gas: int, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)
    import logging

    import tachyon  # noqa: F401

    try:
        import deepspeed
    except ImportError:
        deepspeed = None
    if deepspeed is not None:
        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    else:
        from tachyon.parallel.distributed import init_distributed

        init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=600), verbose=False)
    for side in ("tachyon",) + (("deepspeed",) if deepspeed is not None else ()):
        _warm_up(side)  # one-time global tensors of each library (not model state) land before any baseline
    out = []
    for side, precision, accum, stage, buckets in variants:
        if side == "deepspeed" and deepspeed is None:
            continue
        row = {"side": side, "precision": precision, "accum": accum, "stage": stage, "buckets": buckets}
        try:
            row.update(_measure(side, precision, accum, stage, buckets, gas))
        except Exception as error:  # noqa: BLE001 - reported in the table, not hidden
            row["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:140]}"
        gc.collect()
        out.append(row)
    queue.put((rank, out))
    torch.distributed.destroy_process_group()


def _variants(quick: bool) -> list[tuple]:
    """(side, precision, grad accum, stage, buckets): tachyon's defaults, tachyon bf16 with fp32
    accumulation (the choice the table decides), DeepSpeed's defaults. A warm-up variant of each
    library runs first, so one-time global tensors land before any baseline."""
    out = []
    for buckets in ("default",) if quick else ("default", "tuned"):
        for precision in ("bf16",) if quick else ("bf16", "fp16"):
            for stage in (0, 1, 2):
                out.append(("tachyon", precision, None, stage, buckets))
                if precision == "bf16":
                    out.append(("tachyon", precision, "fp32", stage, buckets))
                out.append(("deepspeed", precision, None, stage, buckets))
    return out


def summarize_live(rows: list[dict]) -> list[dict]:
    """One row per (N, buckets, precision, stage): bytes per parameter at each point, the
    largest over the ranks, for tachyon (default accumulation and fp32), DeepSpeed, and ratios of
    the largest point (tachyon / DeepSpeed)."""
    def cell(group, side, accum, point):
        got = [r for r in group if r["side"] == side and r["accum"] == accum]
        if not got:
            return None
        if any("error" in r for r in got):
            return "error"
        return round(max(r["points"][point]["total"] for r in got) / got[0]["psi"], 2)

    out = []
    keys = ("N", "buckets", "precision", "stage")
    for key in dict.fromkeys(tuple(r[k] for k in keys) for r in rows):
        group = [r for r in rows if tuple(r[k] for k in keys) == key]
        row = dict(zip(keys, key))
        for name, side, accum in (("tachyon", "tachyon", None), ("tachyon fp32 accum", "tachyon", "fp32"),
                                  ("DS", "deepspeed", None)):
            values = [cell(group, side, accum, p) for p in POINTS]
            if values[0] is None:
                continue
            row[f"{name} B/Psi (backward/step/after)"] = "/".join(str(v) for v in values)
            row[f"{name} max"] = "error" if "error" in values else max(values)
            row[f"{name} in backward"] = cell(group, side, accum, "in backward")
        for name in ("tachyon", "tachyon fp32 accum"):
            t, d = row.get(f"{name} max"), row.get("DS max")
            if isinstance(t, float) and isinstance(d, float):
                row[f"{name} / DS"] = round(t / d, 3)
        errors = {r["side"]: r["error"] for r in group if "error" in r}
        row["errors"] = "; ".join(f"{k}: {v}" for k, v in errors.items())[:100]
        out.append(row)
    return out


def live_memory_part(args) -> list[dict]:
    """Every live tensor storage per rank, tachyon against DeepSpeed (when importable), on 2 and
    4 gloo ranks, the default config and tuned buckets."""
    try:
        import deepspeed

        ds_version = deepspeed.__version__
    except ImportError as error:
        print(f"DeepSpeed figures skipped: `import deepspeed` fails here ({error}); tachyon's alone.")
        ds_version = None
    rows = []
    for world in (2,) if args.quick else (2, 4):
        results = _spawn(_compare_rank, world, _variants(args.quick), args.ds_gas, timeout=3600)
        for rank in sorted(results):
            for entry in results[rank]:
                row = {"N": world, "rank": rank, "gas": args.ds_gas, **{k: v for k, v in entry.items() if k != "points"}}
                row["accum"] = entry["accum"]
                row["points"] = entry.get("points", {})
                rows.append(row)
    table = summarize_live(rows)
    title = (f"every live tensor storage per rank, bytes per parameter (largest rank), tachyon vs DeepSpeed "
             f"{ds_version or '(not installed)'}, gas {args.ds_gas}, 8 x Linear(1024, 1024), CPU, gloo")
    print_table(table, title=title)
    flat = []
    for r in rows:
        base = {k: v for k, v in r.items() if k != "points"}
        for point, got in r["points"].items():
            flat.append({**base, "point": point, **{f"{k} B": v for k, v in got.items()}})
        if not r["points"]:
            flat.append(base)
    keys = list(dict.fromkeys(k for r in flat for k in r))
    return [{k: r.get(k, "") for k in keys} for r in flat]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer timed steps")
    parser.add_argument("--cpu-only", action="store_true", help="only the memory_breakdown table")
    parser.add_argument("--deepspeed-only", action="store_true",
                        help="only the live-storage comparison (with DeepSpeed when it imports)")
    parser.add_argument("--ds-gas", type=int, default=1, help="gradient accumulation steps in the live-storage comparison")
    parser.add_argument("--smoke", action="store_true", help="tiny GPT: check the GPU-part code runs")
    args = parser.parse_args()
    if not args.deepspeed_only:
        rows = cpu_memory_part(args)
        write_csv(output_dir() / "bench_engine_memory.csv", rows, "engine_memory")
    if not (args.cpu_only or args.deepspeed_only):
        if torch.cuda.is_available() or args.smoke:
            gpu_rows = gpu_part(args)
            if not args.smoke:
                write_csv(output_dir() / "bench_engine_throughput.csv", gpu_rows, "engine_throughput")
        else:
            print("GPU part skipped: no CUDA device (use --smoke to exercise it on CPU)")
    live_rows = [] if args.cpu_only else live_memory_part(args)
    if live_rows:
        write_csv(output_dir() / "bench_engine_live_memory.csv", live_rows, "engine_live_memory_vs_deepspeed")


if __name__ == "__main__":
    main()

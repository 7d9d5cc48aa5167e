"""ZeRO stages 1, 2 and 3, with and without offload: bytes per rank and bytes on the wire per step.

On N gloo ranks (2 and 4; CPU), a stack of Linear(H, H) layers (default 8 x 1024: 8.4M parameters,
each Linear a stage-3 unit, the root holding none) trained in bf16 with fp32 masters and AdamW
(tachyon's FusedAdam from the config) through tachyon.initialize, for: stages 1, 2, 3; ZeRO-Offload
of the optimizer (``offload_optimizer: {device: cpu}``) at each; and stage 3 with the parameters
offloaded too (``offload_param``). After the first step, one more step is measured:

- model-state bytes per rank from ``engine.memory_breakdown()`` after that step's backward (its
  parameters / gradients / master_weights / optimizer_states, and ``offloaded``: the part that
  lives in host memory -- on a CPU-only machine host and device are the same memory, so this
  says where the engine put each tensor, not a saving), beside the formulas (stages 1 and 2:
  `tachyon.engine.zero.model_state_bytes`, 2 Psi + 14 Psi / N in bf16; stage 3: the ZeRO
  paper's 16 Psi / N);
- every live tensor storage of the rank's process that was not there before the model was built
  (`tachyon.engine.zero.live_tensor_bytes`), at the same point;
- bytes on the wire per step: every torch.distributed call of the step counted by
  `tachyon.parallel.CommCounter` (payload, and what a rank sends with ring algorithms), beside
  data parallel's 2 (N-1)/N Psi elements and stage 3's 3 (N-1)/N Psi;
- the step's wall time (CPU, 2 ranks sharing the cores: noise, printed only as a sanity check).

    python benchmarks/bench_zero3.py                    # N = 2 and 4, 8 x Linear(1024, 1024)
    python benchmarks/bench_zero3.py --ranks 2 --layers 2 --hidden 64     # quick

Rows are appended to benchmarks/results/latest/bench_zero3.csv (or $TACHYON_BENCH_OUT).

GPU part (``--gpu``; one CUDA device, a one-rank nccl process group; without CUDA a SystemExit
says so), the GPT of ``tachyon train --model gpt`` (`tachyon.train.models.GPT`: tachyon
TransformerLayers, tied embeddings, learned positions), bf16 with fp32 masters, AdamW:

- step time: hidden 2048, 16 heads, 8 layers, vocab 32000, batch 8 x 1024 tokens (470M
  parameters, ~23 TFLOP per step: ~50-100 ms on an H100) trained through `tachyon.initialize` at
  stage 3 (fp32 reductions, as the baseline), against plain FSDP2 on an identical copy of the model
  (``fully_shard`` per TransformerLayer and the position embedding -- the units stage 3 picks --
  then the root; ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``;
  ``torch.optim.AdamW(fused=True)`` on the sharded fp32 parameters), and stage 3 with
  ``offload_optimizer`` and with ``offload_optimizer`` + ``offload_param``. All four models live at
  once; after warm-up steps (excluded) they take turns in rounds of a few steps each (the order
  alternates each round), each step timed with CUDA events, and the rows give the median ms per
  step over all rounds and its ratio to FSDP2's (the goal for stage 3 without offload: <= 1.05).
- largest model: the same GPT at hidden 2048 with a growing number of layers, batch 1 x 1024,
  built in bf16 on the device, one full step (forward, backward, optimizer) per size, for stage 3
  without offload and for stage 3 with ``offload_optimizer`` + ``offload_param``. Without
  offload, layers double from a third of what the device could hold at 16 bytes per parameter
  until a try runs out of memory (``torch.cuda.OutOfMemoryError``, or an NCCL / cuBLAS error
  saying so), then bisect. With offload the model states are in host memory, at an estimated 24
  bytes per parameter; sizes above what the host's available memory holds at that rate are not
  tried (a host that runs out kills the process instead of raising), and the sweep starts at that
  bound (each try is slow) and bisects downwards if it fails. Every try is freed (engine
  destroyed, gc, empty_cache) before the next, and a try that would not finish in the time left
  (predicted from the previous one) is not started. Each row gives the parameter count, the peak
  device memory and the host bytes of the model states; the summary row per mode the largest
  that completed a step and why the sweep stopped (a size that ran out of memory, the bound, or
  the time budget).

Every row is printed (flushed) and appended to $TACHYON_BENCH_OUT/bench_zero3_gpu_*.csv as soon
as it is measured, so a run cut off keeps what it measured.

    python benchmarks/bench_zero3.py --gpu --quick      # ~100 s on an H100 (budget: --budget, 110 s)
    python benchmarks/bench_zero3.py --gpu-smoke        # the same code on CPU at tiny sizes (a check)

``--gpu-smoke`` runs the GPU part's code on the CPU (one gloo rank, bf16, a GPT of hidden 32)
with a fake memory limit: a step raises ``torch.cuda.OutOfMemoryError`` when 16 bytes per
parameter exceed 70% of a made-up capacity, so the sweep grows, bisects and frees as on a GPU, and
checks that each freed try left no live tensor behind. Its timings are noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import socket
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--gpu" in sys.argv:  # before torch is imported: the largest-model sweep is less fragmented with it
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from benchmarks.common import format_table, output_dir, print_table, write_csv  # noqa: E402

VARIANTS = [  # (stage, offload_optimizer, offload_param)
    (1, False, False), (2, False, False), (3, False, False),
    (1, True, False), (2, True, False), (3, True, False), (3, True, True),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, layers: int, hidden: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch

    import tachyon
    from tachyon.engine.zero import live_tensor_bytes
    from tachyon.parallel import CommCounter

    torch.set_num_threads(1)
    tachyon.init_distributed("gloo", verbose=False)
    rows = []
    for stage, offload_optimizer, offload_param in VARIANTS:
        torch.manual_seed(0)
        base = live_tensor_bytes()
        model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
        zero: dict = {"stage": stage}
        if stage == 3:
            zero["shard_module_classes"] = ["Linear"]
        if offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if offload_param:
            zero["offload_param"] = {"device": "cpu"}
        cfg = {"train_batch_size": 4 * world, "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
               "zero_optimization": zero, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
        engine, _, _, _ = tachyon.initialize(model=model, config=cfg)
        x = torch.randn(4, hidden, dtype=torch.bfloat16)
        engine.backward(engine(x).float().square().mean())
        engine.step()
        started = time.perf_counter()
        with CommCounter() as comm:
            engine.backward(engine(x).float().square().mean())
            memory = engine.memory_breakdown()
            live = live_tensor_bytes(collect=False) - base
            engine.step()
        elapsed = time.perf_counter() - started
        psi = sum(p.numel() for p in model.parameters())
        rows.append({"stage": stage, "offload": "param+optimizer" if offload_param else
                     "optimizer" if offload_optimizer else "none", "psi": psi, **memory, "live": live,
                     "payload": comm.bytes(), "sent": comm.bytes(field="sent"), "calls": len(comm.calls),
                     "step_s": elapsed})
        engine.destroy()
        del engine, model
    queue.put((rank, rows))
    tachyon.shutdown_distributed()


def run(world: int, layers: int, hidden: int) -> list[dict]:
    import torch.multiprocessing as mp

    from tachyon.engine.zero import model_state_bytes

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, layers, hidden, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
    rows = []
    for r in results[0]:
        psi, n = r["psi"], world
        formula = 16 * psi / n if r["stage"] == 3 else model_state_bytes(psi, n, r["stage"])["model_states"]
        ring = (n - 1) / n * psi * 2  # one collective over Psi bf16 values, per rank
        rows.append({
            "N": n, "stage": r["stage"], "offload": r["offload"], "params": psi,
            "model_states_MB": r["model_states"] / 1e6, "formula_MB": formula / 1e6,
            "offloaded_MB": r.get("offloaded", 0) / 1e6, "live_MB": r["live"] / 1e6,
            "wire_sent_MB": r["sent"] / 1e6, "wire_x_dp": r["sent"] / (2 * ring),
            "collectives": r["calls"], "step_s_cpu": round(max(x["step_s"] for x in _rank_rows(results, r)), 3),
            "parameters": r["parameters"], "gradients": r["gradients"], "master_weights": r["master_weights"],
            "optimizer_states": r["optimizer_states"], "model_states": r["model_states"], "live": r["live"],
            "payload": r["payload"], "sent": r["sent"],
        })
    return rows


def _rank_rows(results: dict, row: dict) -> list[dict]:
    """The same variant's row on every rank."""
    return [x for rows in results.values() for x in rows if (x["stage"], x["offload"]) == (row["stage"], row["offload"])]


# ---------------------------------------------------------------------- GPU part (--gpu, --gpu-smoke)
@dataclasses.dataclass(frozen=True)
class GPTSize:
    vocab: int
    hidden: int
    heads: int
    layers: int
    seq: int
    batch: int


STEP_SIZE = GPTSize(vocab=32000, hidden=2048, heads=16, layers=8, seq=1024, batch=8)
SWEEP_SIZE = GPTSize(vocab=32000, hidden=2048, heads=16, layers=1, seq=1024, batch=1)
SMOKE_STEP_SIZE = GPTSize(vocab=128, hidden=32, heads=2, layers=2, seq=16, batch=2)
SMOKE_SWEEP_SIZE = GPTSize(vocab=128, hidden=32, heads=2, layers=1, seq=16, batch=1)
STEP_VARIANTS = [  # (row name, offload_optimizer, offload_param); None: plain FSDP2
    ("FSDP2", None, None),
    ("stage 3", False, False),
    ("stage 3 + offload_optimizer", True, False),
    ("stage 3 + offload_optimizer + offload_param", True, True),
]
SWEEP_MODES = [("stage 3", False), ("stage 3 + offload_optimizer + offload_param", True)]
# model-state bytes per parameter a sweep sizes against: on the device without offload (fp32
# shard, fp32 gradient, Adam's two moments), on the host with offload (those plus the bf16
# parameter and gradient shards FSDP2's CPU offload policy keeps there, and slack for the copies
# made while sharding: a host that runs out kills the process instead of raising)
BYTES_PER_PARAM = {False: 16, True: 24}
HOST_RESERVE = 10 << 30  # host bytes the offload sweep leaves to everything else
# a guess of one try's seconds per billion parameters (build, shard, one step, free), used only to
# size the first try to the time left; later tries are predicted from the previous one
PRIOR_S_PER_GPARAM = {False: 2.0, True: 10.0}
SMOKE_CAPACITY = {False: 2_000_000, True: 2_400_000}  # --gpu-smoke's made-up device / host bytes (up to 9 / 7 layers)
SMOKE_FILL = 0.7  # --gpu-smoke: a step "runs out of memory" past this fraction of SMOKE_CAPACITY
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
GPU_CSV = {"step": "bench_zero3_gpu_step.csv", "try": "bench_zero3_gpu_sweep.csv",
           "largest": "bench_zero3_gpu_largest.csv"}


class GpuRun:
    """What the GPU part's sections share: the device, the clock and budget, and the output."""

    def __init__(self, smoke: bool, quick: bool, budget: float) -> None:
        self.smoke, self.quick = smoke, quick
        self.device = torch.device("cpu" if smoke else "cuda")
        self.started = time.perf_counter()
        self.deadline = self.started + budget
        self.out = output_dir()
        self.rows: dict[str, list[dict]] = {kind: [] for kind in GPU_CSV}
        self.errors: list[str] = []

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def allocated(self, collect: bool = True) -> int:
        """Bytes of live tensors: the CUDA allocator's count, or on CPU every reachable storage
        (``collect``: garbage-collect first)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated()
        from tachyon.engine.zero import live_tensor_bytes

        return live_tensor_bytes(collect=collect)

    def emit(self, kind: str, row: dict) -> None:
        """Print ``row`` and append it to its CSV now (a run cut off keeps it)."""
        row = {"elapsed_s": round(time.perf_counter() - self.started, 1), **row}
        self.rows[kind].append(row)
        print(f"[{kind}] " + "; ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
        write_csv(self.out / GPU_CSV[kind], [row], "zero3_gpu_smoke" if self.smoke else "zero3_gpu")

    def error(self, where: str) -> str:
        """Report the exception being handled (printed whole) and remember that the run failed."""
        text = traceback.format_exc()
        print(f"FAILED: {where}\n{text}", file=sys.stderr, flush=True)
        self.errors.append(where)
        return text.strip().splitlines()[-1][:200]


def _start_one_rank(device_type: str) -> None:
    """A one-rank default process group (nccl on CUDA, gloo on CPU)."""
    import tachyon

    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise SystemExit("bench_zero3.py --gpu measures one device: run it as one process, not under a launcher "
                         f"(WORLD_SIZE={os.environ['WORLD_SIZE']})")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())), ("RANK", "0"),
                       ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    tachyon.init_distributed("nccl" if device_type == "cuda" else "gloo", verbose=False)


def _gpt(size: GPTSize, device, dtype):
    """tachyon train's GPT at ``size``, built directly on ``device`` (seeded: equal builds are equal)."""
    from tachyon.train.models import GPT

    torch.manual_seed(0)
    with torch.device(device):
        return GPT(size.vocab, size.hidden, size.layers, size.heads, max_seq_len=size.seq, dtype=dtype)


def _param_counts(size: GPTSize) -> tuple[int, int]:
    """(parameters outside the layers, parameters per layer) of the GPT at ``size``, built on meta."""
    counts = [sum(p.numel() for p in _gpt(dataclasses.replace(size, layers=n), "meta", torch.float32).parameters())
              for n in (1, 2)]
    return 2 * counts[0] - counts[1], counts[1] - counts[0]


def _batch(size: GPTSize, device) -> tuple:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size.vocab, (size.batch, size.seq + 1), generator=g).to(device)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _tachyon_engine(model, size: GPTSize, offload_optimizer: bool, offload_param: bool):
    import tachyon

    zero: dict = {"stage": 3}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    config = {"train_batch_size": size.batch, "train_micro_batch_size_per_gpu": size.batch,
              "bf16": {"enabled": True}, "communication_data_type": "fp32", "steps_per_print": 10**9,
              "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}}}
    engine, _, _, _ = tachyon.initialize(model=model, config=config)
    return engine


def _tachyon_step(engine, batch, after_forward=None):
    def step() -> None:
        loss = engine(batch[0], labels=batch[1])
        if after_forward is not None:
            after_forward()
        engine.backward(loss)
        engine.step()
    return step


def _fsdp2_step(model, device, batch):
    """Plain FSDP2 on ``model`` (fp32): the units stage 3 shards, then the root; bf16 compute, fp32
    reductions; fused AdamW on the sharded fp32 parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units = [*model.layers] + ([model.position_embedding] if model.position_embedding is not None else [])
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)

    def step() -> None:
        model(batch[0], labels=batch[1]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step, optimizer


def _time_steps(run: GpuRun, step, n: int) -> list[float]:
    """ms of each of ``n`` steps run back to back: CUDA events around each (one synchronize at the
    end, so the host may run ahead as in training), perf_counter on CPU."""
    if run.device.type == "cuda":
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for start, end in marks:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in marks]
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _free(holder: dict, run: GpuRun) -> None:
    """Destroy an engine, drop every reference, collect and return cached device memory."""
    engine = holder.pop("engine", None)
    if engine is not None:
        engine.destroy()
    del engine
    holder.clear()
    gc.collect()
    if run.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def step_time_section(run: GpuRun) -> None:
    """Median ms per step of stage 3 (without and with offload) against plain FSDP2 (module docstring).

    On an H100 (estimate, --quick): building the four models ~15 s (the offloaded ones pin ~8 GB
    of host memory each), warm-up ~10 s (two steps each; an offloaded step is ~1 s of CPU Adam over
    470M parameters), 3 rounds of 4 + 4 device steps (~70 ms each) and 1 + 1 offloaded ones: ~10 s."""
    size = SMOKE_STEP_SIZE if run.smoke else STEP_SIZE
    rounds, steps, offload_steps, warmup = (2, 1, 1, 1) if run.smoke else (3, 4, 1, 2) if run.quick else (5, 10, 2, 3)
    batch = _batch(size, run.device)
    base, per_layer = _param_counts(size)
    params = base + size.layers * per_layer
    live, times, info = [], {}, {}
    for name, offload_optimizer, offload_param in STEP_VARIANTS:
        holder: dict = {}
        try:
            before = run.allocated()
            t0 = time.perf_counter()
            model = holder["model"] = _gpt(size, run.device, torch.float32)
            if offload_optimizer is None:
                step, holder["optimizer"] = _fsdp2_step(model, run.device, batch)
            else:
                holder["engine"] = _tachyon_engine(model, size, offload_optimizer, offload_param)
                step = _tachyon_step(holder["engine"], batch)
            del model
            built = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(warmup):
                step()
            run.sync()
            host = holder["engine"].memory_breakdown().get("offloaded", 0) if "engine" in holder else 0
            info[name] = {"build_s": round(built, 2), "warmup_s": round(time.perf_counter() - t0, 2),
                          "device_GB": (run.allocated() - before) / 1e9, "host_GB": host / 1e9}
            live.append((name, step, offload_steps if offload_optimizer else steps, holder))
            times[name] = []
            print(f"built {name}: {info[name]}", flush=True)
        except Exception:
            info[name] = {"error": run.error(f"step time: building or warming up {name}")}
            _free(holder, run)
    for r in range(rounds):
        for name, step, n, _ in live if r % 2 == 0 else live[::-1]:
            try:
                times[name] += _time_steps(run, step, n)
            except Exception:
                info[name]["error"] = run.error(f"step time: round {r} of {name}")
        for *_, holder in (v for v in live if "error" in info[v[0]]):
            _free(holder, run)
        live = [v for v in live if "error" not in info[v[0]]]
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{name} {statistics.median(times[name]):.2f} ms"
                                                      for name, *_ in live), flush=True)
    reference = statistics.median(times["FSDP2"]) if times.get("FSDP2") else None
    for name, *_ in STEP_VARIANTS:
        ms = statistics.median(times[name]) if times.get(name) else None
        run.emit("step", {
            "variant": name, "params": params, "hidden": size.hidden, "layers": size.layers, "batch": size.batch,
            "seq": size.seq, "steps": len(times.get(name, [])), "median_ms": ms,
            "min_ms": min(times[name]) if times.get(name) else None,
            "max_ms": max(times[name]) if times.get(name) else None,
            "x_fsdp2": ms / reference if ms and reference else None,
            "tokens_per_s": size.batch * size.seq / (ms * 1e-3) if ms else None,
            "device_GB": info[name].get("device_GB"), "host_GB": info[name].get("host_GB"),
            "build_s": info[name].get("build_s"), "warmup_s": info[name].get("warmup_s"),
            "error": info[name].get("error", ""),
        })
    for *_, holder in live:
        _free(holder, run)


def _fake_memory_limit(params: int, offload: bool) -> None:
    """--gpu-smoke's stand-in for a device (or host) running out: raise as CUDA would."""
    need = BYTES_PER_PARAM[offload] * params
    if need > SMOKE_FILL * SMOKE_CAPACITY[offload]:
        raise torch.cuda.OutOfMemoryError(f"fake memory limit: {need} bytes of model states > "
                                          f"{SMOKE_FILL} x {SMOKE_CAPACITY[offload]}")


def _one_step(run: GpuRun, holder: dict, size: GPTSize, offload: bool, params: int) -> None:
    model = holder["model"] = _gpt(size, run.device, torch.bfloat16)
    holder["engine"] = _tachyon_engine(model, size, offload, offload)
    del model
    check = (lambda: _fake_memory_limit(params, offload)) if run.smoke else None
    _tachyon_step(holder["engine"], _batch(size, run.device), check)()
    run.sync()
    holder["host"] = holder["engine"].memory_breakdown().get("offloaded", 0)


def _try_size(run: GpuRun, mode: str, offload: bool, size: GPTSize, params: int, before: int) -> dict:
    """One training step of the GPT at ``size``; the row says whether it completed or ran out of
    memory, and how many bytes above ``before`` are still allocated once the try is freed."""
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    holder: dict = {}
    status, error, t0 = "ok", "", time.perf_counter()
    try:
        _one_step(run, holder, size, offload, params)
    except torch.cuda.OutOfMemoryError as exc:
        status, error = "out of memory", str(exc).strip().splitlines()[0][:160]
    except RuntimeError as exc:  # NCCL and cuBLAS allocate outside torch's allocator and say it in words
        if "out of memory" not in str(exc).lower():
            raise
        status, error = "out of memory", f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"
    host = holder.get("host", 0)
    peak = torch.cuda.max_memory_allocated() - before if run.device.type == "cuda" else None
    _free(holder, run)
    seconds = time.perf_counter() - t0
    row = {"mode": mode, "layers": size.layers, "params": params, "status": status,
           "peak_device_GB": peak / 1e9 if peak is not None else None, "host_GB": host / 1e9,
           "seconds": round(seconds, 2), "leaked_MB": (run.allocated(collect=False) - before) / 1e6, "error": error}
    run.emit("try", row)
    return row


def largest_section(run: GpuRun, mode: str, offload: bool, deadline: float) -> dict:
    """The largest GPT (layers at fixed width) that completes a step in ``mode`` (module docstring).

    On an H100 (estimate): without offload a try at 2-4B parameters builds in ~2 s and steps in
    well under a second (first-step optimizer states included), ~3-6 s a try with the freeing, and
    the sweep takes ~5 tries with --quick (~30 s). With offload the host is the limit (~4-5B
    parameters in 128 GB) and the sweep starts there: a try pins ~70 GB of host memory and steps
    Adam on the CPU, tens of seconds, so --quick may finish after one or two tries and say that
    the time budget stopped it (its first try is sized to the time left by PRIOR_S_PER_GPARAM)."""
    size = SMOKE_SWEEP_SIZE if run.smoke else SWEEP_SIZE
    base, per_layer = _param_counts(size)
    if run.smoke:
        capacity, where = SMOKE_CAPACITY[offload], "made-up capacity"
    elif offload:
        from tachyon.engine.zero.offload import available_host_bytes

        capacity, where = (available_host_bytes() or 0) - HOST_RESERVE, "host memory available"
    else:
        capacity, where = torch.cuda.mem_get_info()[1], "device memory"
    max_layers = int((capacity / BYTES_PER_PARAM[offload] - base) // per_layer)
    if max_layers < 1:
        raise RuntimeError(f"{mode}: {where} ({capacity / 1e9:.1f} GB) cannot hold even one layer's model states")
    # offload: start at the host's limit (each try is expensive); without: a third of the device
    start = max_layers if offload else max(1, int((capacity / 3 / BYTES_PER_PARAM[offload] - base) // per_layer))
    tolerance = (lambda lo: max(1, lo // 8)) if run.quick else (lambda lo: 1)
    before = run.allocated()
    ok: dict | None = None
    failed: dict | None = None
    last: tuple[float, int] | None = None  # (seconds, layers) of the latest try
    layers, stop, tries = start, "", 0
    fit = int(((deadline - time.perf_counter()) / PRIOR_S_PER_GPARAM[offload] * 1e9 - base) // per_layer)
    if fit < layers:  # the first try sized to the time left (by the prior guess)
        layers = max(1, fit)
    while True:
        params = base + layers * per_layer
        predicted = last[0] * layers / last[1] if last else PRIOR_S_PER_GPARAM[offload] * params / 1e9
        if time.perf_counter() + predicted > deadline:
            stop = f"time budget (the next try, {layers} layers, would not finish in it)"
            break
        row = _try_size(run, mode, offload, dataclasses.replace(size, layers=layers), params, before)
        tries += 1
        last = (row["seconds"], layers)
        if row["status"] == "ok":
            ok = row
        else:
            failed = row
        if failed is None:  # growing
            if layers >= max_layers:
                stop = (f"{layers + 1} layers would need more than the {where} ({capacity / 1e9:.1f} GB) at "
                        f"{BYTES_PER_PARAM[offload]} bytes per parameter: not tried")
                break
            layers = min(2 * layers, max_layers)
        elif ok is None:  # shrinking from a start that failed
            if layers == 1:
                stop = "one layer ran out of memory"
                break
            layers = max(1, layers // 2)
        else:
            if failed["layers"] - ok["layers"] <= tolerance(ok["layers"]):
                stop = f"out of memory at {failed['layers']} layers"
                break
            layers = (ok["layers"] + failed["layers"]) // 2
    summary = {"mode": mode, "hidden": size.hidden, "heads": size.heads, "batch": size.batch, "seq": size.seq,
               "largest_layers": ok["layers"] if ok else 0, "largest_params": ok["params"] if ok else 0,
               "peak_device_GB": ok["peak_device_GB"] if ok else None, "host_GB": ok["host_GB"] if ok else None,
               "failed_layers": failed["layers"] if failed else None, "tries": tries, "stopped_by": stop}
    run.emit("largest", summary)
    return summary


def gpu_main(smoke: bool, quick: bool, budget: float | None, parts: str) -> int:
    """The GPU part (or, ``smoke``, its code on the CPU at tiny sizes); returns the exit status."""
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench_zero3.py --gpu needs a CUDA device and torch.cuda.is_available() is False here; "
                         "--gpu-smoke runs the same code on the CPU at tiny sizes")
    import tachyon
    import tachyon.nn as tnn

    for name in ("TransformerLayer", "LayerNorm", "RMSNorm"):  # import the lazy modules outside torch.device()
        getattr(tnn, name)
    # tachyon's layers return a view of their output; FSDP2 warns about it at every forward
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    run = GpuRun(smoke, quick, budget if budget is not None else 110.0 if quick else 480.0)
    _start_one_rank(run.device.type)
    print(f"# bench_zero3 {'--gpu-smoke (CPU; timings are noise)' if smoke else '--gpu'}: "
          f"{torch.cuda.get_device_name() if not smoke else 'cpu'}, budget {run.left():.0f} s", flush=True)
    try:
        if parts in ("all", "step"):
            try:
                step_time_section(run)
            except Exception:
                run.error("step time")
        if parts in ("all", "largest"):
            # --quick on an H100 (estimates): imports and the nccl group ~10 s, step time ~35 s, then
            # ~30 s for each sweep; without offload first, offload gets the rest of the budget
            share = run.left() * 0.45
            for mode, offload in SWEEP_MODES:
                deadline = time.perf_counter() + share if not offload else run.deadline
                try:
                    largest_section(run, mode, offload, deadline)
                except Exception:
                    run.error(f"largest model: {mode}")
    finally:
        tachyon.shutdown_distributed()
    for kind, title in (("step", "ms per step against FSDP2"), ("largest", "largest GPT that completes a step")):
        if run.rows[kind]:
            print(f"\n## {title}\n\n" + format_table(run.rows[kind]), flush=True)
    if run.errors:
        print(f"\n{len(run.errors)} part(s) failed: {run.errors}", flush=True)
    return 1 if run.errors else 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma-separated (default 2,4)")
    parser.add_argument("--layers", type=int, default=8, help="Linear layers (default 8)")
    parser.add_argument("--hidden", type=int, default=1024, help="their width (default 1024)")
    parser.add_argument("--quick", action="store_true",
                        help="bytes: 2 ranks only; --gpu: fewer steps, a coarser sweep, a 110 s budget")
    parser.add_argument("--gpu", action="store_true", help="the GPU part: step time against FSDP2, largest model")
    parser.add_argument("--gpu-smoke", action="store_true", help="the GPU part's code on the CPU at tiny sizes")
    parser.add_argument("--budget", type=float, default=None,
                        help="--gpu: seconds for the whole part (default 110 with --quick, else 480)")
    parser.add_argument("--part", choices=("all", "step", "largest"), default="all", help="--gpu: which sections")
    args = parser.parse_args(argv)
    if args.gpu or args.gpu_smoke:
        raise SystemExit(gpu_main(args.gpu_smoke, args.quick, args.budget, args.part))
    rows = []
    for world in (int(w) for w in ("2" if args.quick else args.ranks).split(",")):
        rows += run(world, args.layers, args.hidden)
    print_table(rows, ["N", "stage", "offload", "params", "model_states_MB", "formula_MB", "offloaded_MB", "live_MB",
                       "wire_sent_MB", "wire_x_dp", "collectives", "step_s_cpu"],
                title=f"ZeRO bytes per rank and per step: {args.layers} x Linear({args.hidden}, {args.hidden}), bf16, AdamW")
    write_csv(output_dir() / "bench_zero3.csv", rows, "zero3")


if __name__ == "__main__":
    main()

"""Parallel layouts (dp x pp x tp): bytes on the wire per training step, and throughput on GPUs.

CPU part (always, gloo ranks): a small GPT (tachyon.train.models.GPT for pp = 1, its pipeline
form tachyon.parallel.pipeline.gpt for pp > 1) trained one warm-up step and one counted step per
layout. Every torch.distributed call of the counted step is recorded by
tachyon.parallel.CommCounter (the data-parallel gradient all-reduce is done by hand, one call per
parameter, where the engine would do it) and compared, per rank, per mesh axis and per kind, with
the analytic formulas below. Columns: payload bytes (the tensors handed to the collectives;
exact) measured and by formula, and bytes sent per rank with ring algorithms (CommCounter's
wire model: all-reduce 2(g-1)/g N, all-gather (g-1) N, reduce-scatter (g-1)/g N, send N).

Formulas, fp32 (b = 4 bytes), T = tokens per data-parallel replica per step, h hidden, L layers
(L_s on this rank's stages), V vocabulary, m micro-batches, P = pp x stages_per_rank stages:

    tp (pp = 1, tied embedding vocab-parallel, LM head column-parallel + gathered logits)
        no sp: all-reduce (4L + 2) T h b, all-gather T V/tp b
        sp:    reduce-scatter 4L T h b, all-gather (4L + 2) T/tp h b + T V/tp b,
               all-reduce 2 T h b + 6 L h b (norm and bias gradients)
    tp (pp > 1, layers only)
        no sp: all-reduce 4 L_s T h b
        sp:    reduce-scatter 4 L_s T h b, all-gather (4 L_s + 2 k) T/tp h b (k local stages),
               all-reduce 6 L_s h b m
    pp     send / recv: one [T/m, h] activation per micro-batch per boundary crossing of this
           rank's stages (forward out of every stage but the last, backward out of every stage
           but the first); all-reduce V h b of the tied embedding on the ranks holding it;
           broadcast of the 4-byte loss
    dp     all-reduce of every local gradient: the rank's parameter bytes, themselves checked
           against a formula (param_bytes_formula: 1/tp of the split layers, replicated rest)

GPU part (``--gpu``, run under torchrun on a machine with several GPUs; none has been available):
a ~1.1B-parameter GPT (hidden 2048, 20 layers, 16 heads, vocab 50304, sequence 2048) trained
through ONE ``tachyon.initialize`` per layout, as a user runs it: the config's
``tensor_parallel`` / ``pipeline`` sections (a PipelineModule over Mesh(dp, pp, tp) and
``engine.train_batch`` for pp > 1), ZeRO-1, bf16 with fp32 masters, AdamW, 8 micro-batches of a
global batch of 16 sequences: ms per step, tokens/s and MFU = (6 N + 12 L h S) x tokens/s /
(GPUs x bf16 peak), against the datasheet peak (benchmarks/common.py).

Usage:
    python benchmarks/bench_parallel.py [--layouts dp2xtp2,pp2-1f1b,...]
    torchrun --nproc_per_node 8 benchmarks/bench_parallel.py --gpu [--layouts ...]
    python benchmarks/bench_parallel.py --smoke      # the GPU-part code on a tiny GPT, CPU, 2 ranks
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import gpu_peaks, output_dir, print_table, write_csv  # noqa: E402

CPU_LAYOUTS = ("dp4", "tp2", "tp2sp", "pp2-gpipe", "pp2-1f1b", "pp2-interleaved", "dp2xtp2", "dp2xpp2-1f1b",
               "pp2xtp2sp-1f1b")
CPU_MODEL = dict(vocab_size=128, hidden_size=64, num_layers=4, num_heads=4, intermediate_size=256, max_seq_len=32)
CPU_BATCH, CPU_MICRO = 8, 4
GPU_MODEL = dict(vocab_size=50304, hidden_size=2048, num_layers=20, num_heads=16, intermediate_size=8192,
                 max_seq_len=2048)
FP32 = 4


@dataclasses.dataclass(frozen=True)
class Layout:
    """A layout name like "dp2xpp2xtp2sp-1f1b": sizes, sequence parallelism, pipeline schedule."""

    name: str
    dp: int = 1
    pp: int = 1
    tp: int = 1
    sp: bool = False
    schedule: str = "1F1B"

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.schedule == "interleaved_1F1B" else 1

    @classmethod
    def parse(cls, name: str) -> Layout:
        body, _, schedule = name.partition("-")
        sizes: dict = {}
        for part in body.split("x"):
            sp = part.endswith("sp")
            part = part[:-2] if sp else part
            axis, count = part[:2], part[2:]
            if axis not in ("dp", "pp", "tp") or not count.isdigit():
                raise ValueError(f"layout {name!r}: parts must look like dp2, pp2, tp2 or tp2sp joined by 'x'")
            sizes[axis] = int(count)
            sizes["sp"] = sizes.get("sp", False) or sp
        names = {"": "1F1B", "1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "interleaved_1F1B"}
        if schedule not in names:
            raise ValueError(f"layout {name!r}: schedule must be gpipe, 1f1b or interleaved")
        return cls(name, schedule=names[schedule], **sizes)


# ---------------------------------------------------------------------------------- one rank


def _build(layout: Layout, mesh, model_cfg: dict, micro: int, device=None):
    """(model, step function(batch ids, labels) -> loss, local stages' layer counts)."""
    from tachyon.parallel.tensor import parallelize

    if layout.pp == 1:
        from tachyon.train.models import GPT

        torch.manual_seed(0)
        model = GPT(**model_cfg).to(device or "cpu")
        parallelize(model, mesh, sequence_parallel=layout.sp)

        def step(ids, labels):
            loss = model(ids, labels=labels)
            loss.backward()
            return loss

        return model, step, [model_cfg["num_layers"]]
    from tachyon.parallel.pipeline import PipelineModule, PipelineSchedule
    from tachyon.parallel.pipeline.gpt import GPTBlock, gpt_layer_specs, gpt_loss

    torch.manual_seed(0)
    net = PipelineModule(gpt_layer_specs(**model_cfg), topology=mesh, loss_fn=gpt_loss, partition_method="type:GPTBlock",
                         stages_per_rank=layout.stages_per_rank)
    net.to(device or "cpu")
    parallelize(net, mesh, sequence_parallel=layout.sp)
    runner = PipelineSchedule(net, micro_batches=micro, schedule=layout.schedule, device=device)

    def step(ids, labels):
        return runner.train_batch(iter(list(zip(ids.chunk(micro), labels.chunk(micro)))))

    blocks = [sum(isinstance(f, GPTBlock) for f in stage.ordered_layers()) for stage in net.stage_modules]
    return net, step, blocks


def _dp_all_reduce(model, mesh) -> None:
    if mesh.size("dp") > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=mesh.group("dp"))
                p.grad.div_(mesh.size("dp"))


def _cpu_rank(rank: int, world: int, port: int, layout: Layout, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from tachyon.parallel import CommCounter, Mesh
    from tachyon.parallel.distributed import init_distributed, shutdown_distributed

    init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=300), verbose=False)
    try:
        mesh = Mesh(dp=layout.dp, pp=layout.pp, tp=layout.tp)
        micro = CPU_MICRO if layout.pp > 1 else 1
        model, step, blocks = _build(layout, mesh, CPU_MODEL, micro)
        g = torch.Generator().manual_seed(0)
        seq, vocab = CPU_MODEL["max_seq_len"], CPU_MODEL["vocab_size"]
        ids = torch.randint(0, vocab, (CPU_BATCH, seq), generator=g).chunk(layout.dp)[mesh.rank("dp")]
        labels = torch.randint(0, vocab, (CPU_BATCH, seq), generator=g).chunk(layout.dp)[mesh.rank("dp")]
        step(ids, labels)  # warm-up: pipeline stages exchange shapes once
        model.zero_grad()
        with CommCounter(mesh) as comm:
            step(ids, labels)
            _dp_all_reduce(model, mesh)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        queue.put((rank, {"calls": comm.calls, "blocks": blocks, "stage_ids": getattr(model, "stage_ids", [0]),
                          "parts": getattr(model, "parts", None), "param_bytes": param_bytes}))
    finally:
        shutdown_distributed()


# ---------------------------------------------------------------------------------- formulas


def param_bytes_formula(layout: Layout, stage_ids: list[int], parts: list[int] | None) -> int:
    """fp32 bytes of this rank's parameters. A layer: QKV 3h^2 + 3h, proj h^2, fc1 f h + f, fc2 h f
    split over tp; two norms (4h) and the proj / fc2 biases (2h) replicated. pp = 1: the tied
    embedding V h / tp (vocab-parallel), positions S h, final norm 2h. pp > 1 (gpt_layer_specs:
    embedding, positions, L blocks, norm, tied head): this rank's layers by the partition, the
    tied embedding (replicated) once per rank holding it."""
    m = CPU_MODEL
    h, L, S, f, V, tp = m["hidden_size"], m["num_layers"], m["max_seq_len"], m["intermediate_size"], \
        -(-m["vocab_size"] // 64) * 64, layout.tp
    block = (4 * h * h + 3 * h + 2 * f * h + f) // tp + 6 * h
    if layout.pp == 1:
        return FP32 * (L * block + V * h // tp + S * h + 2 * h)
    sizes = [V * h, S * h, *[block] * L, 2 * h, V * h]  # layer index -> elements; the head is the tied embedding
    local = {i for s in stage_ids for i in range(parts[s], parts[s + 1])}
    tied = {0, L + 3} & local
    return FP32 * (sum(sizes[i] for i in local - {0, L + 3}) + (V * h if tied else 0))


def formula(layout: Layout, blocks: list[int], stage_ids: list[int], param_bytes: int) -> dict:
    """{(kind, axis): payload bytes} one rank should move in one step (module docstring)."""
    m = CPU_MODEL
    h, L, V = m["hidden_size"], m["num_layers"], -(-m["vocab_size"] // 64) * 64
    T = CPU_BATCH // layout.dp * m["max_seq_len"]
    tp, out = layout.tp, {}

    def add(kind, axis, nbytes):
        if nbytes:
            out[(kind, axis)] = out.get((kind, axis), 0) + nbytes

    if tp > 1:
        if layout.pp == 1:
            if layout.sp:
                add("reduce_scatter", "tp", 4 * L * T * h * FP32)
                add("all_gather", "tp", (4 * L + 2) * T // tp * h * FP32 + T * V // tp * FP32)
                add("all_reduce", "tp", 2 * T * h * FP32 + 6 * L * h * FP32)
            else:
                add("all_reduce", "tp", (4 * L + 2) * T * h * FP32)
                add("all_gather", "tp", T * V // tp * FP32)
        else:
            Ls, micro = sum(blocks), CPU_MICRO
            if layout.sp:
                add("reduce_scatter", "tp", 4 * Ls * T * h * FP32)
                add("all_gather", "tp", (4 * Ls + 2 * len(blocks)) * T // tp * h * FP32)
                add("all_reduce", "tp", 6 * Ls * h * FP32 * micro)
            else:
                add("all_reduce", "tp", 4 * Ls * T * h * FP32)
    if layout.pp > 1:
        stages = layout.pp * layout.stages_per_rank
        activation = T // CPU_MICRO * h * FP32
        sends = sum((s < stages - 1) + (s > 0) for s in stage_ids)
        add("send", "pp", sends * CPU_MICRO * activation)
        add("recv", "pp", sends * CPU_MICRO * activation)
        if 0 in stage_ids or stages - 1 in stage_ids:  # the tied embedding lives on the first and last stage
            add("all_reduce", "pp", V * h * FP32)
        add("broadcast", "pp", 4)
    if layout.dp > 1:
        add("all_reduce", "dp", param_bytes)
    return out


def cpu_part(layouts: list[Layout]) -> list[dict]:
    rows = []
    for layout in layouts:
        results = _spawn(_cpu_rank, layout.world, layout)
        for rank in sorted(results):
            got = results[rank]
            params = param_bytes_formula(layout, got["stage_ids"], got["parts"])
            rows.append({"layout": layout.name, "rank": rank, "kind": "parameters", "axis": "-",
                         "payload B": got["param_bytes"], "formula B": params,
                         "match": "yes" if params == got["param_bytes"] else "NO", "sent B (ring)": 0})
            expected = formula(layout, got["blocks"], got["stage_ids"], params)
            measured: dict = {}
            for c in got["calls"]:
                entry = measured.setdefault((c.kind, c.axis), [0, 0.0])
                entry[0] += c.payload
                entry[1] += c.sent
            for key in sorted(set(expected) | set(measured)):
                payload, sent = measured.get(key, (0, 0.0))
                rows.append({"layout": layout.name, "rank": rank, "kind": key[0], "axis": key[1],
                             "payload B": payload, "formula B": expected.get(key, 0),
                             "match": "yes" if payload == expected.get(key, 0) else "NO", "sent B (ring)": int(sent)})
    return rows


# ---------------------------------------------------------------------------------- GPU part


def _engine(layout: Layout, cfg: dict, batch: int, micro: int, precision: str):
    """(engine, step function(ids) -> loss) for ``layout`` through ONE tachyon.initialize: ZeRO-1,
    AdamW, the config's tensor_parallel / pipeline sections (a PipelineModule over
    Mesh(dp, pp, tp) for pp > 1)."""
    import tachyon
    from tachyon.parallel import Mesh

    config = {"train_batch_size": batch, "gradient_accumulation_steps": micro, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "tensor_parallel": {"tp_size": layout.tp, "sequence_parallel": layout.sp}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    torch.manual_seed(0)
    if layout.pp == 1:
        from tachyon.train.models import GPT

        engine, *_ = tachyon.initialize(model=GPT(**cfg), config=config)

        def step(ids):
            loss = None
            for chunk in ids.chunk(micro):
                loss = engine(chunk, labels=chunk)
                engine.backward(loss)
                engine.step()
            return loss

        return engine, step
    from tachyon.parallel.pipeline import PipelineModule
    from tachyon.parallel.pipeline.gpt import gpt_layer_specs, gpt_loss

    net = PipelineModule(gpt_layer_specs(**cfg), topology=Mesh(dp=layout.dp, pp=layout.pp, tp=layout.tp),
                         loss_fn=gpt_loss, partition_method="type:GPTBlock", stages_per_rank=layout.stages_per_rank)
    config["pipeline"] = {"stages": layout.pp, "schedule": layout.schedule}
    engine, *_ = tachyon.initialize(model=net, config=config)

    def step(ids):
        return engine.train_batch(iter(list(zip(ids.chunk(micro), ids.chunk(micro)))))

    return engine, step


def gpu_part(layouts: list[Layout], smoke: bool) -> list[dict]:
    """Runs inside torchrun (or --smoke: 2 gloo ranks on CPU, tiny model, fp32): tokens/s and MFU
    of a training step through tachyon.initialize (ZeRO-1, bf16, AdamW) for each layout."""
    from tachyon.parallel.distributed import init_distributed

    init_distributed(verbose=False)
    on_gpu = torch.cuda.is_available() and not smoke
    cfg = dict(CPU_MODEL) if smoke else dict(GPU_MODEL)
    batch, micro, steps = (8, 2, 2) if smoke else (16, 8, 10)
    rows = []
    for layout in layouts:
        if layout.world != dist.get_world_size():
            if dist.get_rank() == 0:
                print(f"skipping {layout.name}: needs {layout.world} ranks, running {dist.get_world_size()}")
            continue
        engine, step = _engine(layout, cfg, batch, micro, "bf16" if on_gpu else "fp32")
        seq = cfg["max_seq_len"]
        ids = torch.randint(0, cfg["vocab_size"], (batch // layout.dp, seq), device=engine.device)
        times = []
        for i in range(steps + 2):
            if on_gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(ids)
            if on_gpu:
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        seconds = sorted(times)[len(times) // 2]
        n_params = 12 * cfg["num_layers"] * cfg["hidden_size"] ** 2 + cfg["vocab_size"] * cfg["hidden_size"]
        tokens = batch * seq / seconds
        flops = (6 * n_params + 12 * cfg["num_layers"] * cfg["hidden_size"] * seq) * tokens
        peaks = gpu_peaks()
        mfu = flops / (dist.get_world_size() * peaks["bf16"] * 1e12) if peaks else float("nan")
        rows.append({"layout": layout.name, "GPUs": dist.get_world_size(), "params": n_params, "ms/step": seconds * 1e3,
                     "tokens/s": tokens, "model TFLOP/s per GPU": flops / dist.get_world_size() / 1e12, "MFU": mfu,
                     "peak GiB": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else 0.0})
        engine.destroy()
        del engine, step
    return rows


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(target, world: int, *args, timeout: float = 900) -> dict[int, dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=timeout) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return results


def _smoke_rank(rank: int, world: int, port: int, layouts: list[Layout], queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from tachyon.parallel.distributed import shutdown_distributed

    try:
        queue.put((rank, gpu_part(layouts, smoke=True)))
    finally:
        shutdown_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default=None, help=f"comma-separated (default CPU: {','.join(CPU_LAYOUTS)})")
    parser.add_argument("--gpu", action="store_true", help="the GPU part (run under torchrun on several GPUs)")
    parser.add_argument("--smoke", action="store_true", help="the GPU-part code on a tiny GPT, 2 gloo ranks on CPU")
    args = parser.parse_args()
    if args.gpu:
        names = args.layouts.split(",") if args.layouts else ["dp8", "tp8", "pp8-1f1b", "dp2xpp2xtp2sp-1f1b", "dp4xtp2sp"]
        rows = gpu_part([Layout.parse(n) for n in names], smoke=False)
        if dist.get_rank() == 0:
            print_table(rows, title="GPT ~1.1B per layout through tachyon.initialize (ZeRO-1, bf16)")
            write_csv(output_dir() / "bench_parallel_gpu.csv", rows, "parallel_throughput")
        return
    if args.smoke:
        layouts = [Layout.parse(n) for n in (args.layouts.split(",") if args.layouts else ["dp2", "tp2sp", "pp2-1f1b"])]
        results = _spawn(_smoke_rank, 2, layouts)
        print_table(results[0], title="smoke run of the GPU part (CPU, tiny GPT: not a measurement)")
        return
    layouts = [Layout.parse(n) for n in (args.layouts.split(",") if args.layouts else CPU_LAYOUTS)]
    rows = cpu_part(layouts)
    print_table(rows, title=f"bytes per training step, GPT {CPU_MODEL}, batch {CPU_BATCH}, fp32, micro-batches "
                            f"{CPU_MICRO} (pp > 1)")
    bad = [r for r in rows if r["match"] != "yes"]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} (layout, rank, kind, axis) totals match the formulas")
    write_csv(output_dir() / "bench_parallel_bytes.csv", rows, "parallel_bytes")
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()

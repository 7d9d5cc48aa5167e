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

Rows are appended to benchmarks/results/latest/bench_zero3.csv (or $TACHYON_BENCH_OUT). Not
measured here (they need a GPU): step time against plain FSDP2, and the largest GPT one GPU
trains with and without offload.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import output_dir, print_table, write_csv  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma-separated (default 2,4)")
    parser.add_argument("--layers", type=int, default=8, help="Linear layers (default 8)")
    parser.add_argument("--hidden", type=int, default=1024, help="their width (default 1024)")
    args = parser.parse_args()
    rows = []
    for world in (int(w) for w in args.ranks.split(",")):
        rows += run(world, args.layers, args.hidden)
    print_table(rows, ["N", "stage", "offload", "params", "model_states_MB", "formula_MB", "offloaded_MB", "live_MB",
                       "wire_sent_MB", "wire_x_dp", "collectives", "step_s_cpu"],
                title=f"ZeRO bytes per rank and per step: {args.layers} x Linear({args.hidden}, {args.hidden}), bf16, AdamW")
    write_csv(output_dir() / "bench_zero3.csv", rows, "zero3")


if __name__ == "__main__":
    main()

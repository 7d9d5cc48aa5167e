"""ZeRO stage 3 bytes per rank: tachyon (FSDP2) against DeepSpeed, on the model and config of
bench_zero3.py, counted by the same live-tensor counter on CPU (gloo).

One library per run (``--library tachyon`` under the repository's .venv, ``--library deepspeed``
under a venv with DeepSpeed; tachyon's counter is imported from this checkout's src/, so that venv
needs no tachyon install). On N spawned gloo ranks: 8 x ``Linear(1024, 1024)`` (Psi = 8,396,800),
bf16, AdamW (DeepSpeed: ``Adam`` with ``torch_adam`` and ``adam_w_mode``, i.e. torch.optim.AdamW;
tachyon: ``AdamW``), micro-batch 4, ``zero_optimization: {"stage": 3}`` (tachyon: also
``shard_module_classes: ["Linear"]``, each Linear a unit, as bench_zero3.py; DeepSpeed shards
every parameter anyway); with ``--buckets tuned`` also ``reduce_bucket_size`` and
``stage3_prefetch_bucket_size`` 200,000 (DeepSpeed's defaults, 5e8 and 5e7 elements, size its
buffers; tachyon's stage 3 ignores the first and reads the second as prefetch on/off). Each
library first builds and steps a small warm-up engine, so its one-time global tensors are in
the baseline. Two optimizer steps create Adam's state; in the
third, every live tensor storage of the rank's process that was not alive before the model was
built (`tachyon.engine.zero.live_tensor_storages`: every tensor the garbage collector tracks and
the ``.grad`` of leaves, each storage once) is counted at every gradient hook of the backward
("in backward"; also sees the activations Python still references), after the backward, on
entry to the inner torch optimizer's ``step`` and after the step. Reported per point: total and
by kind (the module's parameters, the tensors the inner optimizer updates, its state, the rest),
with the rest's four largest storages (MB) to say what they are.

    .venv/bin/python benchmarks/bench_zero3_vs_deepspeed.py --library tachyon
    /work/ds-venv/bin/python benchmarks/bench_zero3_vs_deepspeed.py --library deepspeed [--buckets tuned]

Rows are appended to benchmarks/results/latest/bench_zero3_vs_deepspeed.csv (or $TACHYON_BENCH_OUT).
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "src"))

POINTS = ("in backward", "after backward", "in step", "after step")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BUCKETS = {
    "default": {},  # each library's defaults (DeepSpeed: reduce_bucket_size 5e8, stage3_prefetch_bucket_size 5e7)
    "tuned": {"reduce_bucket_size": 200_000, "stage3_prefetch_bucket_size": 200_000},
}


def _config(library: str, stage: int = 3, buckets: str = "default") -> dict:
    zero: dict = {"stage": stage, **BUCKETS[buckets]}
    if library == "tachyon" and stage == 3:
        zero["shard_module_classes"] = ["Linear"]
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "bf16": {"enabled": True}, "zero_optimization": zero}
    if library == "deepspeed":  # torch.optim.AdamW inside (no compiled op on this machine)
        config["optimizer"] = {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True, "adam_w_mode": True}}
    else:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
    return config


def _model(width: int, depth: int):
    import torch

    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])


def _initialize(library: str, model, config: dict):
    if library == "deepspeed":
        import deepspeed

        engine = deepspeed.initialize(model=model, config=config)[0]
        inner = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    else:
        import tachyon

        engine = tachyon.initialize(model=model, config=config)[0]
        inner = engine.optimizer
    return engine, inner


def _classify(new: dict, module, inner) -> dict[str, int]:
    import torch

    def key(t: torch.Tensor) -> tuple[str, int]:
        t = getattr(t, "_local_tensor", t)  # an FSDP2 (DTensor) parameter: this rank's shard
        return (t.device.type, t.untyped_storage().data_ptr())

    params = {key(p) for p in module.parameters() if not p.is_meta}
    masters = {key(p) for g in inner.param_groups for p in g["params"]} - params
    states = {key(v) for st in inner.state.values() for v in st.values() if torch.is_tensor(v)}
    out: dict = dict.fromkeys(("parameters", "master_weights", "optimizer_states", "other"), 0)
    others = []
    for k, nbytes in new.items():
        kind = ("parameters" if k in params else "master_weights" if k in masters
                else "optimizer_states" if k in states else "other")
        out[kind] += nbytes
        if kind == "other":
            others.append(nbytes)
    out["total"] = sum(new.values())
    out["largest_other"] = " ".join(f"{b / 1e6:.4g}" for b in sorted(others, reverse=True)[:4])
    return out


def _measure(library: str, width: int, depth: int, buckets: str) -> dict:
    import torch

    from tachyon.engine.zero.memory import live_tensor_storages

    gc.collect()
    base = live_tensor_storages()
    torch.manual_seed(0)
    model = _model(width, depth)
    psi = sum(p.numel() for p in model.parameters())
    engine, inner = _initialize(library, model, _config(library, buckets=buckets))
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    peaks: dict[str, dict] = {}

    def snapshot(point: str) -> None:
        now = live_tensor_storages()
        got = _classify({k: v for k, v in now.items() if base.get(k) != v}, model, inner)
        if point not in peaks or got["total"] > peaks[point]["total"]:
            peaks[point] = got

    def micro_step() -> None:
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        del loss

    for _ in range(2):
        micro_step()
        engine.step()
    original = inner.step
    handles = [p.register_post_accumulate_grad_hook(lambda _: snapshot("in backward")) for p in model.parameters()]

    def counted_step(*args, **kwargs):
        snapshot("in step")
        return original(*args, **kwargs)

    inner.step = counted_step
    try:
        micro_step()
        snapshot("after backward")
        engine.step()
        snapshot("after step")
    finally:
        inner.step = original
        for h in handles:
            h.remove()
    optimizer = f"{type(engine.optimizer).__name__}/{type(inner).__name__}"
    del engine, model, inner
    gc.collect()
    return {"psi": psi, "optimizer": optimizer, "points": peaks}


def _warm_up(library: str) -> None:
    import torch

    engine, _ = _initialize(library, _model(64, 2), _config(library))
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 64, dtype=torch.bfloat16)).float().square().mean())
        engine.step()
    del engine
    gc.collect()


def _rank(rank: int, world: int, port: int, library: str, width: int, depth: int, buckets: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    try:
        import torch

        torch.set_num_threads(1)
        if library == "deepspeed":
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        else:
            import tachyon

            tachyon.init_distributed("gloo", verbose=False)
        _warm_up(library)
        queue.put((rank, True, _measure(library, width, depth, buckets)))
    except BaseException:  # report the failure to the parent, whatever it is
        queue.put((rank, False, traceback.format_exc()))


def run(library: str, world: int, width: int, depth: int, buckets: str = "default") -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, library, width, depth, buckets, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = dict((r, (ok, value)) for r, ok, value in (queue.get(timeout=1800) for _ in range(world)))
    for p in procs:
        p.join(timeout=60)
    failed = {r: v for r, (ok, v) in results.items() if not ok}
    if failed:
        raise RuntimeError(f"{library} on {world} ranks failed:\n" + "\n".join(f"--- rank {r} ---\n{v}"
                                                                                 for r, v in sorted(failed.items())))
    rows = []
    for rank, (_, got) in sorted(results.items()):
        for point in POINTS:
            if point not in got["points"]:
                continue
            kinds = got["points"][point]
            rows.append({"library": library, "buckets": buckets, "N": world, "rank": rank, "point": point,
                         "params": got["psi"],
                         "optimizer": got["optimizer"], "total_MB": kinds["total"] / 1e6,
                         "parameters_MB": kinds["parameters"] / 1e6, "master_weights_MB": kinds["master_weights"] / 1e6,
                         "optimizer_states_MB": kinds["optimizer_states"] / 1e6, "other_MB": kinds["other"] / 1e6,
                         "formula_16psi_over_n_MB": 16 * got["psi"] / world / 1e6, **kinds})
    return rows


def _versions(library: str) -> str:
    import torch

    out = f"python {sys.version.split()[0]}, torch {torch.__version__}"
    if library == "deepspeed":
        import deepspeed

        out += f", deepspeed {deepspeed.__version__}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", choices=("tachyon", "deepspeed"), required=True)
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma-separated (default 2,4)")
    parser.add_argument("--layers", type=int, default=8, help="Linear layers (default 8)")
    parser.add_argument("--hidden", type=int, default=1024, help="their width (default 1024)")
    parser.add_argument("--buckets", choices=tuple(BUCKETS), default="default",
                        help="default: zero_optimization {stage: 3} alone; tuned: reduce_bucket_size and "
                             "stage3_prefetch_bucket_size 200,000")
    args = parser.parse_args()
    from benchmarks.common import output_dir, print_table, write_csv

    rows = []
    for world in (int(w) for w in args.ranks.split(",")):
        rows += run(args.library, world, args.hidden, args.layers, args.buckets)
    print(_versions(args.library))
    print_table(rows, ["library", "buckets", "N", "rank", "point", "total_MB", "parameters_MB", "master_weights_MB",
                       "optimizer_states_MB", "other_MB", "largest_other", "formula_16psi_over_n_MB", "optimizer"],
                title=f"ZeRO-3 live bytes per rank: {args.layers} x Linear({args.hidden}, {args.hidden}), bf16, AdamW")
    write_csv(output_dir() / "bench_zero3_vs_deepspeed.csv", rows, "zero3_vs_deepspeed")


if __name__ == "__main__":
    main()

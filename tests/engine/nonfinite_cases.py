"""Rank-side pieces of the non-finite gradient and preemption tests (imported by spawned ranks).

`poisoned_run` trains the small model of `zero_cases` and, on chosen steps and on ONE rank only,
makes the loss nan (every gradient non-finite) or puts an inf into one element of one
parameter's gradient; it records, per step, whether the parameters, the fp32 masters and every
optimizer state stayed bit-identical, and what the engine logged.
"""

from __future__ import annotations

import logging

import torch

from tests.engine.zero_cases import LR, Case, _snapshot, batch, loss_fn, make_model

POISONED_PARAM = "3.bias"
"""The parameter whose gradient gets an inf on "grad" steps (the last Linear's bias)."""


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def poisoned_run(case: Case, poison: dict[int, str], poison_rank: int, extra: dict | None = None) -> dict:
    """Train ``case.steps`` steps; on step s (0-based) with ``poison[s]`` in ("loss", "grad"),
    rank ``poison_rank`` alone poisons its loss (nan) or the gradient of `POISONED_PARAM` (inf).
    Returns per step whether everything stayed unchanged, the counters, the log lines, the
    final parameters (to compare across ranks) and whether they are finite."""
    import torch.distributed as dist

    import tachyon

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = make_model()
    config = case.config(world)
    config.update(extra or {})
    records = _Records()
    logger = logging.getLogger("tachyon.engine")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    optimizer = None if case.optimizer.startswith("config") else (lambda g: torch.optim.AdamW(g, lr=LR))
    if case.optimizer.startswith("config") and "optimizer" not in config:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR}}
    engine, _, _, _ = tachyon.initialize(model=model, config=config, optimizer=optimizer)
    state = {"grad": False}

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if state["grad"]:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    model[3].bias.register_hook(hook)
    unchanged, error = [], None
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case.precision]
    try:
        for step in range(case.steps):
            before = _snapshot(engine) if step > 0 else None
            kind = poison.get(step) if rank == poison_rank else None
            for micro in range(case.gas):
                state["grad"] = kind == "grad" and micro == case.gas - 1
                x, y = batch(step, micro, rank, dtype)
                loss = loss_fn(engine(x), y)
                if kind == "loss" and micro == 0:
                    loss = loss * float("nan")
                engine.backward(loss)
                engine.step()
            after = _snapshot(engine)
            unchanged.append(before is not None and all(torch.equal(a, b) for a, b in zip(before, after)))
    except Exception as exc:  # the consecutive-skip limit: every rank raises the same
        error = f"{type(exc).__name__}: {exc}"
    finally:
        logger.removeHandler(records)
    return {
        "rank": rank,
        "unchanged": unchanged,
        "skipped_steps": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "finite": all(bool(torch.isfinite(t).all()) for t in _snapshot(engine)),
        "params": [p.detach().float().clone() for p in model.parameters()],
        "logs": records.lines,
        "error": error,
        "grad_norm": engine.get_global_grad_norm(),
    }


def nonfinite_save(root: str, allow: bool) -> dict:
    """Train 2 steps and save; then rank 1 alone puts a nan into its master partition (ZeRO-2)
    and saves again: refused on every rank unless ``allow``."""
    import torch.distributed as dist

    import tachyon
    from tachyon.engine.checkpoint import CheckpointError

    rank = dist.get_rank()
    config = Case(stage=2, precision="bf16").config(dist.get_world_size())
    config["checkpoint"] = {"allow_nonfinite": allow}
    model = make_model()
    engine, _, _, _ = tachyon.initialize(model=model, config=config, optimizer=lambda g: torch.optim.AdamW(g, lr=LR))
    for step in range(2):
        x, y = batch(step, 0, rank, torch.bfloat16)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    engine.save_checkpoint(root)
    if rank == 1:
        with torch.no_grad():
            engine.zero.masters[0][0] = float("nan")
    out = {"error": None}
    try:
        out["saved"] = engine.save_checkpoint(root, tag="bad")
    except CheckpointError as error:
        out["error"] = str(error)
    return out


def disk_full_on_rank_1(root: str) -> str | None:
    """Save once, then a save whose shard write fails with ENOSPC on rank 1 alone: the error
    every rank raises."""
    import errno

    import torch.distributed as dist

    import tachyon
    from tachyon.engine.checkpoint import CheckpointError
    from tachyon.engine.checkpoint import save as save_module

    rank = dist.get_rank()
    config = Case(stage=1).config(dist.get_world_size())
    engine, _, _, _ = tachyon.initialize(model=make_model(), config=config, optimizer=lambda g: torch.optim.AdamW(g, lr=LR))
    x, y = batch(0, 0, rank, torch.float32)
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    engine.save_checkpoint(root)
    writer = save_module.dcp.FileSystemWriter

    class FullOnRank1(writer):
        def write_data(self, plan, planner):
            if rank == 1:
                raise OSError(errno.ENOSPC, "No space left on device", f"{self.path}/__1_0.distcp")
            return super().write_data(plan, planner)

    save_module.dcp.FileSystemWriter = FullOnRank1
    try:
        engine.save_checkpoint(root, tag="full")
    except CheckpointError as error:
        return str(error)
    finally:
        save_module.dcp.FileSystemWriter = writer
    return None


def rank_main(runs: list[tuple], root: str) -> dict:
    """Every 2-rank scenario of test_nonfinite in one spawn."""
    out = {name: poisoned_run(*args) for name, *args in runs}
    out["refused"] = nonfinite_save(f"{root}/refused", allow=False)
    out["allowed"] = nonfinite_save(f"{root}/allowed", allow=True)
    out["disk_full"] = disk_full_on_rank_1(f"{root}/full")
    return out


def preempted_run(root: str, signal_rank: int, at_step: int) -> dict:
    """Rank ``signal_rank`` alone gets SIGUSR1 (from itself) after step ``at_step``; with the
    preemption section on, every rank must stop after the same step with a checkpoint."""
    import os
    import signal

    import torch.distributed as dist

    import tachyon
    from tachyon.engine.preemption import Preempted

    rank = dist.get_rank()
    config = Case(stage=2, precision="bf16").config(dist.get_world_size())
    config["preemption"] = {"enabled": True, "save_dir": f"{root}/ckpt", "signals": ["SIGUSR1"]}
    before = signal.getsignal(signal.SIGUSR1)
    engine, _, _, _ = tachyon.initialize(model=make_model(), config=config,
                                         optimizer=lambda g: torch.optim.AdamW(g, lr=LR))
    installed = signal.getsignal(signal.SIGUSR1) is not before
    engine.preemption.client_state = lambda: {"where": rank}
    out = {"installed": installed, "stopped": None}
    try:
        for step in range(20):
            x, y = batch(step, 0, rank, torch.bfloat16)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
            if step + 1 == at_step and rank == signal_rank:
                os.kill(os.getpid(), signal.SIGUSR1)
    except Preempted as stop:
        out["stopped"] = {"code": stop.code, "step": stop.step, "checkpoint": stop.checkpoint,
                          "signal": stop.signal_name, "global_steps": engine.global_steps}
    out["restored"] = signal.getsignal(signal.SIGUSR1) is before
    # a fresh engine resumes from it
    engine2, _, _, _ = tachyon.initialize(model=make_model(), config=Case(stage=2, precision="bf16").config(2),
                                          optimizer=lambda g: torch.optim.AdamW(g, lr=LR))
    path, client_state = engine2.load_checkpoint(f"{root}/ckpt")
    out["resumed"] = (path, client_state, engine2.global_steps)
    return out


def handlers_untouched_when_off() -> bool:
    import signal

    import tachyon

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    tachyon.initialize(model=make_model(), config=Case(stage=0).config(1), optimizer=lambda g: torch.optim.SGD(g, lr=LR))
    return all(signal.getsignal(s) is h for s, h in before.items())

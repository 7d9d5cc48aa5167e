"""Rank side of tests/engine/test_zero_one_adam.py (kept apart so spawned ranks import little)."""

from __future__ import annotations

import torch


def rank_main() -> dict:
    import torch.distributed as dist

    import tachyon

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
              "optimizer": {"type": "ZeroOneAdam", "params": {
                  "lr": 0.02, "var_freeze_step": 4, "var_update_scaler": 1, "local_step_scaler": 2,
                  "local_step_clipper": 2}}}
    engine, *_ = tachyon.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=gen)
    xs = torch.randn(14, 8, 8, generator=gen)
    rank = dist.get_rank()
    losses, averaged, same = [], [], []
    for step in range(14):
        averaged.append(not engine.optimizer.in_compression_stage)
        x = xs[step, rank * 4:(rank + 1) * 4]
        loss = torch.nn.functional.mse_loss(engine(x), x @ w)
        engine.backward(loss)
        engine.step()
        flat = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(gathered, flat)
        same.append(torch.equal(gathered[0], gathered[1]))
        with torch.no_grad():
            full = torch.nn.functional.mse_loss(engine.module(xs[0]), xs[0] @ w).item()
        losses.append(full)
    return {"averaged": averaged, "same": same, "losses": losses, "frozen": engine.optimizer.freeze_key}

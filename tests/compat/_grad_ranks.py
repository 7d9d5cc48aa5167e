"""Rank side of tests/compat/test_param_grads.py (kept apart so spawned ranks import little)."""

from __future__ import annotations

import torch

BATCH = 4  # two ranks x micro-batch 2


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 3, generator=gen)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def reference_grads() -> list[torch.Tensor]:
    """Gradients of the mean loss over the whole batch (what the ranks' averaged gradients equal)."""
    net = model()
    x, y = data()
    torch.nn.functional.mse_loss(net(x), y).backward()
    return [p.grad.clone() for p in net.parameters()]


def rank_main(stages: tuple[int, ...]) -> dict:
    import torch.distributed as dist

    import tachyon.compat.deepspeed as deepspeed
    from tachyon.compat.deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_set_full_grad,
    )

    rank = dist.get_rank()
    x, y = data()
    x, y = x[2 * rank: 2 * rank + 2], y[2 * rank: 2 * rank + 2]
    out = {}
    for stage in stages:
        net = model()
        config = {"train_batch_size": BATCH, "zero_optimization": {"stage": stage, "reduce_bucket_size": 16},
                  "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}}}
        engine, *_ = deepspeed.initialize(model=net, config=config)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        params = list(net.parameters())
        out[stage] = {
            "param_grads": [None if p.grad is None else p.grad.clone() for p in params],
            "full_grads": [safe_get_full_grad(p).clone() for p in params],
        }
        halved = [g * 0.5 for g in out[stage]["full_grads"]]
        for p, g in zip(params, halved):
            safe_set_full_grad(p, g)
        before = [safe_get_full_fp32_param(p).clone() for p in params]
        engine.step()
        out[stage]["applied"] = engine.was_step_applied()
        out[stage]["moved"] = [b - p.detach() for b, p in zip(before, params)]
        out[stage]["momentum"] = [safe_get_full_optimizer_state(p, "momentum_buffer").clone() for p in params]
        out[stage]["after_step"] = [safe_get_full_grad(p) for p in params]
        engine.destroy()
    return out

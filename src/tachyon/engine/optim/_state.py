"""What the fused optimizers share: checking Adam-family hyperparameters, their per-parameter
state (torch.optim.AdamW's layout), and keeping its fp32 tensors fp32 through load_state_dict."""

from __future__ import annotations

import itertools

import torch


def advance_adam_state(state: dict, p: torch.Tensor) -> int:
    """Count one more step in ``p``'s optimizer ``state`` and return the new step count; on first
    use create it as torch.optim.AdamW does: ``step`` (a float32 CPU scalar tensor), ``exp_avg``
    and ``exp_avg_sq`` (fp32 zeros shaped like ``p``, whatever ``p``'s dtype)."""
    if len(state) == 0:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
    state["step"] += 1
    return int(state["step"].item())


def restore_fp32_states(optimizer: torch.optim.Optimizer, state_dict: dict, keys: tuple[str, ...]) -> None:
    """torch.optim.Optimizer.load_state_dict casts every floating state to its param's dtype; the
    fused optimizers keep ``keys`` in fp32 whatever the param dtype, so reload those from
    ``state_dict`` (the dict that was just loaded) for params that are not fp32. Group options
    the checkpoint lacks (a torch.optim.AdamW checkpoint has no ``adam_w_mode``) take the
    optimizer's defaults."""
    for group in optimizer.param_groups:
        for key, value in optimizer.defaults.items():
            group.setdefault(key, value)
    saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    params = itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)
    for saved_id, p in zip(saved_ids, params):
        saved = state_dict["state"].get(saved_id)
        if saved is None or p.dtype == torch.float32:
            continue
        for key in keys:
            if key in saved:
                optimizer.state[p][key] = saved[key].to(device=p.device, dtype=torch.float32, copy=True)


def check_adam_hyperparameters(name: str, lr, betas, eps, weight_decay) -> None:
    """ValueError naming the first of lr, betas, eps, weight_decay outside its allowed range."""
    if not (isinstance(lr, (int, float)) and lr >= 0):
        raise ValueError(f"{name}: lr must be a number >= 0; got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0 <= b < 1 for b in betas)):
        raise ValueError(f"{name}: betas must be a pair of numbers in [0, 1); got {betas!r}")
    if not eps >= 0:
        raise ValueError(f"{name}: eps must be >= 0; got {eps!r}")
    if not weight_decay >= 0:
        raise ValueError(f"{name}: weight_decay must be >= 0; got {weight_decay!r}")

"""A parameter's whole gradient, fp32 master weight and optimizer state, wherever ZeRO keeps them.

DeepSpeed's ``deepspeed.utils.safe_get_full_grad`` and friends (`tachyon.compat.deepspeed.utils`)
are these functions. With ZeRO stages 1 and 2 a parameter's gradient, fp32 master and optimizer
states live in pieces on the data-parallel ranks that own them (`tachyon.engine.zero.shards`);
reading one whole is a SUM all-reduce of a zero-filled fp32 tensor into which each rank wrote
its own pieces, so it is **collective**: every data-parallel rank must call it for the same
parameter. Writing (``set_*``) needs no communication: each rank keeps the pieces it owns of a
value that must be the same on every rank. At stage 0 everything is whole on every rank and no
call communicates.

What each returns (as DeepSpeed's):

- `full_grad`: ``param.grad`` when it is set (stage 0, where it is a view of the accumulated
  gradient, or stage 1 between accumulation boundaries); else the accumulated gradient from the
  accumulator -- averaged over the ranks after the boundary backward, multiplied by the loss
  scale under fp16 -- in the accumulation dtype at stage 0 and in fp32 at stages 1/2; None when
  no gradient has been accumulated since the last step.
- `full_master`: the fp32 master weight, shaped like the parameter.
- `full_optimizer_state`: ``optimizer.state[master][key]``'s piece for the parameter (a state
  shaped like the flat master, e.g. Adam's ``exp_avg``); None before the optimizer's first step.

The setters write the same places: the gradient the next ``step()`` uses, the master the
optimizer updates (the model's weight follows at the next step, or at once where the master is
the model's own fp32 buffer), the optimizer state.
"""

from __future__ import annotations

import torch

from .base import _OWNER, ZeroStrategy


def owner_of(param: torch.Tensor) -> ZeroStrategy | None:
    """The ZeRO strategy (of a live engine) that trains ``param``, or None."""
    ref = _OWNER.get(id(param))
    strategy = ref() if ref is not None else None
    if strategy is None or id(param) not in strategy._slot_of:
        return None
    return strategy


def _slot(strategy: ZeroStrategy, param: torch.Tensor):
    return strategy._slot_of[id(param)]


def _pieces(strategy: ZeroStrategy, slot) -> list[tuple[int, int, int]]:
    """(lo, hi, offset in this rank's master of the group) of the parameter's elements here."""
    if strategy.partitioned_masters:
        return strategy.shards.partition_pieces(slot, strategy.rank)
    start = strategy.flat.regions[slot.group].start
    return [(0, slot.numel, slot.offset - start)] if slot.numel else []


def _gather(strategy: ZeroStrategy, slot, flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The parameter's elements of ``flat`` (laid out like this rank's master of its group), whole:
    read directly at stage 0, SUM all-reduced from the owners' pieces at stages 1/2 (fp32)."""
    if not strategy.partitioned_masters:
        (lo, hi, at), = _pieces(strategy, slot) or [(0, 0, 0)]
        return flat.narrow(0, at, hi - lo).view_as(like)
    out = torch.zeros(slot.numel, dtype=torch.float32, device=strategy.device)  # a collective: on the training device
    for lo, hi, at in _pieces(strategy, slot):
        out.narrow(0, lo, hi - lo).copy_(flat.narrow(0, at, hi - lo))
    if strategy.world_size > 1:
        strategy.comm.sum_(out)
    return out.view_as(like)


def _scatter(strategy: ZeroStrategy, slot, flat: torch.Tensor, value: torch.Tensor) -> None:
    """Write this rank's pieces of ``value`` (the whole parameter's) into ``flat``."""
    if tuple(value.shape) != tuple(slot.param.shape):
        raise ValueError(f"the value has shape {tuple(value.shape)}; the parameter's is {tuple(slot.param.shape)}")
    source = value.detach().reshape(-1).to(device=flat.device)
    with torch.no_grad():
        for lo, hi, at in _pieces(strategy, slot):
            flat.narrow(0, at, hi - lo).copy_(source.narrow(0, lo, hi - lo))


def _accumulated(strategy: ZeroStrategy, slot) -> torch.Tensor | None:
    """This rank's accumulated gradient for ``slot``'s group, laid out like its master (or None)."""
    if strategy._accumulator is not None:
        return strategy._accumulator_views(strategy._accumulator)[slot.group]
    master_grad = strategy.masters[slot.group].grad
    return master_grad  # inside a step, after the accumulator became the master gradient


def full_grad(strategy: ZeroStrategy, param: torch.Tensor) -> torch.Tensor | None:
    """``param``'s whole gradient (module docstring). Collective at ZeRO stages 1/2."""
    if param.grad is not None:
        return param.grad
    slot = _slot(strategy, param)
    flat = _accumulated(strategy, slot)
    return None if flat is None else _gather(strategy, slot, flat, param)


def set_full_grad(strategy: ZeroStrategy, param: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``value`` (the whole gradient, the same on every rank) ``param``'s gradient for the next step."""
    if param.grad is not None:
        with torch.no_grad():
            param.grad.copy_(value)
        return
    slot = _slot(strategy, param)
    flat = _accumulated(strategy, slot)
    if flat is None:
        flat = strategy._accumulator_views(strategy.accumulator())[slot.group]
    _scatter(strategy, slot, flat, value)


def full_master(strategy: ZeroStrategy, param: torch.Tensor) -> torch.Tensor:
    """``param``'s fp32 master weight, whole. Collective at ZeRO stages 1/2."""
    slot = _slot(strategy, param)
    return _gather(strategy, slot, strategy.masters[slot.group].detach(), param).float()


def set_full_master(strategy: ZeroStrategy, param: torch.Tensor, value: torch.Tensor) -> None:
    slot = _slot(strategy, param)
    _scatter(strategy, slot, strategy.masters[slot.group], value)


def _state(strategy: ZeroStrategy, optimizer: torch.optim.Optimizer, slot, key: str) -> torch.Tensor | None:
    master = strategy.masters[slot.group]
    state = optimizer.state.get(master, {})
    if key not in state:
        return None
    value = state[key]
    if not (torch.is_tensor(value) and value.shape == master.shape):
        raise ValueError(f"optimizer state {key!r} is not a per-element tensor (shape "
                         f"{tuple(getattr(value, 'shape', ()))}); per-parameter pieces exist only for states shaped "
                         "like the parameters")
    return value


def full_optimizer_state(strategy: ZeroStrategy, optimizer: torch.optim.Optimizer, param: torch.Tensor,
                         key: str) -> torch.Tensor | None:
    """``param``'s piece of the optimizer state ``key``, whole. Collective at ZeRO stages 1/2."""
    slot = _slot(strategy, param)
    state = _state(strategy, optimizer, slot, key)
    return None if state is None else _gather(strategy, slot, state.detach(), param)


def set_full_optimizer_state(strategy: ZeroStrategy, optimizer: torch.optim.Optimizer, param: torch.Tensor,
                             value: torch.Tensor, key: str) -> None:
    slot = _slot(strategy, param)
    state = _state(strategy, optimizer, slot, key)
    if state is None:
        raise ValueError(f"the optimizer has no state {key!r} yet (it is created by its first step)")
    _scatter(strategy, slot, state, value)


__all__ = ["full_grad", "full_master", "full_optimizer_state", "owner_of", "set_full_grad", "set_full_master",
           "set_full_optimizer_state"]

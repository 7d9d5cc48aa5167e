"""What initialize checks and builds before the Engine's state exists: the inputs' refusals, the
param groups, the optimizer bound to ZeRO's flat fp32 masters, and the scheduler (client-given or
from the config)."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from tachyon.config import ConfigError, TachyonConfig

from .lr_schedules import build_scheduler
from .optim import ZeroOneAdam, build_optimizer
from .optim.lamb import Lamb
from .pld import PLD_KWARGS
from .zero import DataParallelComm, ZeroStrategy
from .zero.offload import check_offload_inputs


def check_engine_inputs(model: Any, config: TachyonConfig, optimizer: Any, lr_scheduler: Any) -> None:
    """Every check that can fail, before any training state is created."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model should be a torch.nn.Module; got {describe(model)}")
    if optimizer is not None and config.optimizer is not None:
        raise ConfigError(
            "`optimizer` is given both in the config and as the optimizer= argument; keep one"
        )
    if lr_scheduler is not None and config.scheduler is not None:
        raise ConfigError(
            "`scheduler` is given both in the config and as the lr_scheduler= argument; keep one"
        )
    if optimizer is not None and not (isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)):
        raise ValueError(f"optimizer should be a torch.optim.Optimizer or a callable; got {describe(optimizer)}")
    if isinstance(optimizer, torch.optim.Optimizer) and any(len(s) for s in optimizer.state.values()):
        raise ValueError("optimizer already has state; pass a freshly built optimizer")
    if isinstance(optimizer, ZeroOneAdam) and config.zero_stage != 0:
        ZeroOneAdam.check_zero_stage(config.zero_stage)
    if config.progressive_layer_drop.enabled:
        check_pld_forward(model)
    if config.zero_stage == 3:
        from .zero.stage3 import check_stage3_inputs

        check_stage3_inputs(model, config, optimizer)
    check_offload_inputs(model, config)
    from .zero.stage3 import check_built_sharded

    check_built_sharded(model, config)


def world_comm() -> DataParallelComm:
    from tachyon.parallel.distributed import get_timeout

    return DataParallelComm(None, get_timeout())


def check_pld_forward(model: torch.nn.Module) -> None:
    """With PLD on, the engine calls ``model(..., progressive_layer_drop=True, pld_theta=t)``:
    refuse a model whose forward cannot take those keywords before anything is built."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # no introspectable signature: let the call decide
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    names = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    missing = [key for key in PLD_KWARGS if key not in names]
    if missing:
        raise ConfigError(
            f"`progressive_layer_drop.enabled: true` makes the engine call the model's forward with "
            f"progressive_layer_drop=True, pld_theta=<theta>, but {type(model).__name__}.forward takes no "
            f"{', '.join(missing)}; add them and pass them to its layers (docs/progressive_layer_drop.md), "
            "or disable progressive_layer_drop"
        )


def param_groups_of(optimizer: Any, model_parameters: Any, model: torch.nn.Module) -> list[dict]:
    """Torch-style param groups: the optimizer's, else model_parameters', else all parameters."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [dict(group) for group in optimizer.param_groups]
    params = model.parameters() if model_parameters is None else model_parameters
    if isinstance(params, torch.Tensor):
        raise ValueError("model_parameters should be an iterable of parameters or param-group dicts, not a tensor")
    params = list(params) if isinstance(params, Iterable) else params
    if not isinstance(params, list) or not params:
        raise ValueError(f"model_parameters should be a non-empty iterable; got {describe(params)}")
    if all(isinstance(p, dict) for p in params):
        return [dict(g, params=list(g["params"])) for g in params]
    if all(isinstance(p, torch.Tensor) for p in params):
        return [{"params": params}]
    raise ValueError("model_parameters should hold either parameters or param-group dicts, not a mix")


def bind_optimizer(client: Any, config: TachyonConfig, zero: ZeroStrategy):
    """Point the optimizer at the flat fp32 masters (one tensor per param group). Only LAMB
    needs to know which parameters a flat master holds (its per-parameter trust ratios): the
    ``segments`` table (24 bytes per parameter piece) is added for it alone."""
    optimizer = build_bound_optimizer(client, config, zero, zero.optimizer_param_groups(with_segments=False))
    if optimizer is not None and isinstance(optimizer, Lamb):
        for group, ours in zip(optimizer.param_groups, zero.optimizer_param_groups(with_segments=True)):
            group.update({k: v for k, v in ours.items() if k != "params"})
    return optimizer


def build_bound_optimizer(client: Any, config: TachyonConfig, zero: ZeroStrategy, groups: list[dict]):
    if isinstance(client, torch.optim.Optimizer):
        for group, ours in zip(client.param_groups, groups):
            group.update(ours)
        optimizer = client
    elif client is not None:
        # DeepSpeed hands the callable plain parameters; do so when there is one plain group
        plain = len(groups) == 1 and not zero.flat.regions[0].options
        optimizer = client(list(groups[0]["params"]) if plain else groups)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"the optimizer callable returned {describe(optimizer)}, not a torch optimizer")
        if len(optimizer.param_groups) != len(groups):
            raise ValueError(
                f"the optimizer callable built {len(optimizer.param_groups)} param groups from "
                f"{len(groups)}; keep one group per given group"
            )
        for group, ours in zip(optimizer.param_groups, groups):
            group.update({k: v for k, v in ours.items() if k != "params"})
    elif config.optimizer is not None:
        optimizer = build_optimizer(config.optimizer, groups, host=zero.offload.any)
    else:
        return None
    optimizer.norm_reducer = zero.norm_reducer
    return optimizer


def build_scheduler_of(client: Any, config: TachyonConfig, optimizer: Any):
    if client is not None:
        if hasattr(client, "step") and hasattr(client, "state_dict"):
            return client
        if callable(client):
            return client(optimizer)
        raise ValueError(f"lr_scheduler should be a scheduler or a callable; got {describe(client)}")
    if config.scheduler is not None:
        if optimizer is None:
            raise ConfigError("`scheduler` needs an optimizer (config 'optimizer' or optimizer=)")
        return build_scheduler(config.scheduler, optimizer)
    return None


def describe(value: Any) -> str:
    if torch.is_tensor(value):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:120]

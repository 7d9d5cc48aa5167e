"""``deepspeed.utils``: gradient / master-weight / optimizer-state access under ZeRO, RepeatingLoader, logging.

``safe_get_full_grad(param)`` and the other ``safe_*_full_*`` helpers are
`tachyon.engine.zero.fragments` with DeepSpeed's signatures: they find the engine that trains
``param`` and read or write its whole gradient, fp32 master weight or optimizer state wherever
ZeRO keeps it. Reads at ZeRO stages 1/2 are collective (every data-parallel rank calls them for
the same parameter), as in DeepSpeed. A parameter no engine trains answers like DeepSpeed's for a
plain parameter: ``param.grad`` for the gradient, None for the rest.

The ``safe_*_local_*`` helpers act on ZeRO-3 partitions in DeepSpeed; tachyon has no ZeRO-3 and
they raise NotImplementedError pointing at the full versions.

``RepeatingLoader`` iterates a loader forever (a new epoch when it ends); ``logger``,
``log_dist`` and ``log_dist_once`` log on chosen ranks as DeepSpeed's do.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from tachyon.compat._names import module_getattr, unsupported
from tachyon.engine.zero import fragments

logger = logging.getLogger("DeepSpeed")
"""DeepSpeed's logger name, so scripts that configure it keep working."""


def _owner(param: torch.Tensor):
    return fragments.owner_of(param)


def _optimizer_of(strategy: Any) -> torch.optim.Optimizer:
    from tachyon.engine.compat_surface import engine_of

    engine = engine_of(strategy)
    if engine is None or engine.optimizer is None:
        raise ValueError("this parameter's engine has no optimizer, so it has no optimizer state")
    return engine.optimizer


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole gradient of ``param`` (see `tachyon.engine.zero.fragments.full_grad`)."""
    strategy = _owner(param)
    return param.grad if strategy is None else fragments.full_grad(strategy, param)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the whole gradient of ``param`` (the same ``value`` on every rank) for the next step."""
    strategy = _owner(param)
    if strategy is None:
        if param.grad is not None:
            param.grad.copy_(value)
        return
    fragments.set_full_grad(strategy, param, value)


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The fp32 master weight of ``param``, whole (None for a parameter no engine trains)."""
    strategy = _owner(param)
    return None if strategy is None else fragments.full_master(strategy, param)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    strategy = _owner(param)
    if strategy is not None:
        fragments.set_full_master(strategy, param, value)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """``param``'s piece of optimizer state ``optim_state_key`` (e.g. "exp_avg"), whole."""
    strategy = _owner(param)
    if strategy is None:
        return None
    return fragments.full_optimizer_state(strategy, _optimizer_of(strategy), param, optim_state_key)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    strategy = _owner(param)
    if strategy is not None:
        fragments.set_full_optimizer_state(strategy, _optimizer_of(strategy), param, value, optim_state_key)


def safe_update_full_grad_vectorized(param_list: Iterable[torch.Tensor],
                                     update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """``grad <- update_func(grad, param)`` for each parameter (its whole gradient)."""
    for param in param_list:
        grad = safe_get_full_grad(param)
        if grad is not None:
            safe_set_full_grad(param, update_func(grad, param))


def _zero3_only(name: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"deepspeed.utils.{name} reads a ZeRO-3 partition; tachyon has no ZeRO-3 (stages "
                                  f"0-2): use {name.replace('_local_', '_full_')}")
    refuse.__name__ = name
    return refuse


safe_get_local_grad = _zero3_only("safe_get_local_grad")
safe_set_local_grad = _zero3_only("safe_set_local_grad")
safe_get_local_fp32_param = _zero3_only("safe_get_local_fp32_param")
safe_set_local_fp32_param = _zero3_only("safe_set_local_fp32_param")
safe_get_local_optimizer_state = _zero3_only("safe_get_local_optimizer_state")
safe_set_local_optimizer_state = _zero3_only("safe_set_local_optimizer_state")


class RepeatingLoader:
    """Iterate ``loader`` forever: when it ends, start it again (its sampler's ``set_epoch`` is
    called with the new epoch where it has one, so a shuffling DistributedSampler reshuffles)."""

    def __init__(self, loader: Iterable):
        self.loader = loader
        self.epoch = 0
        self.data_iter = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.epoch += 1
            sampler = getattr(self.loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def _should_log(ranks: Iterable[int] | None) -> bool:
    """DeepSpeed's rule: log without torch.distributed, or when ``ranks`` holds -1 or this rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    ranks = list(ranks or [])
    return bool(ranks) and (ranks[0] == -1 or dist.get_rank() in ranks)


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the given ranks (``[-1]``: every rank), prefixed with the rank."""
    if _should_log(ranks):
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else -1
        logger.log(level, f"[Rank {rank}] {message}")


@functools.lru_cache(maxsize=None)
def _log_once(message: str, ranks: tuple, level: int) -> None:
    log_dist(message, list(ranks), level)


def log_dist_once(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """`log_dist`, once per (message, ranks, level) in this process."""
    _log_once(message, tuple(ranks or ()), level)


_TABLE = {
    "groups": unsupported("DeepSpeed's process-group registry is not provided; use tachyon.parallel.Mesh (or "
                          "engine.mpu) for the data / tensor / pipeline groups"),
    "zero_to_fp32": unsupported("DeepSpeed's zero_to_fp32 script reads DeepSpeed's checkpoint files; tachyon's "
                                "checkpoints are layout-free already: use engine.save_16bit_model or tachyon's "
                                "consolidated export (docs/checkpoints.md)"),
    "OnDevice": unsupported("building a model directly on the meta device is not implemented by tachyon"),
    "instrument_w_nvtx": unsupported("NVTX ranges are not provided; use torch.cuda.nvtx.range"),
}
_OWN = ["RepeatingLoader", "log_dist", "log_dist_once", "logger", "safe_get_full_fp32_param", "safe_get_full_grad",
        "safe_get_full_optimizer_state", "safe_get_local_fp32_param", "safe_get_local_grad",
        "safe_get_local_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_grad",
        "safe_set_full_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
        "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized"]
__getattr__ = module_getattr(__name__, "deepspeed.utils", _TABLE, lambda: _OWN)
__all__ = _OWN

"""DeepSpeed's learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest.

Class names, arguments, defaults and formulas are DeepSpeed's (deepspeed/runtime/lr_schedules.py),
so a DeepSpeed ``scheduler`` config section means the same here. ``step()`` is called once per
optimizer step and sets ``group["lr"]`` for every param group; ``last_batch_iteration`` counts
the steps taken (-1 = not started). With i = last_batch_iteration and W = max(2, warmup_num_steps):

- WarmupLR: lr = min + (max - min) * gamma, gamma = (1 / log(W)) * log(i + 1) ("log", computed
  in that order, as DeepSpeed, so the floats agree bit for bit) or i / W ("linear") while i < W,
  then 1. Construction (i = -1) sets lr = warmup_min_lr. Without warmup_max_lr each param group
  warms up to its own lr.
- WarmupDecayLR: the same warmup, then gamma = max(0, (T - i) / max(1, T - W)) with
  T = total_num_steps: linear decay that reaches warmup_min_lr at step T and stays there.
- WarmupCosineLR: lr = base_lr * ratio, base_lr = each group's lr at construction. Warmup:
  ratio = r0 + (1 - r0) * gamma (r0 = warmup_min_ratio); then with
  progress = min(1, (i - W + 1) / max(1, T - W)): ratio = c + (1 - c) * (1 + cos(pi * progress)) / 2
  (c = cos_min_ratio), which holds at c past T. Construction sets lr = 0.
- OneCycle: with b = i + 1 and total = first + second step size, x = the position in the current
  cycle in [0, 1): scale = x / s (s = first / total) on the way up, (x - 1) / (s - 1) on the way
  down; lr = cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale and momentum (betas[0] of
  Adam-family optimizers) = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale. Stair counts
  quantise scale to floor(position * stairs) / stairs. After the cycle (i >= total) with
  d = i - total + 1: lr = cycle_min_lr / (1 + decay_lr_rate * d / decay_step_size) and momentum
  = cycle_max_mom * (1 + decay_mom_rate * d / decay_step_size) (no decay when the rate or
  decay_step_size is 0).
- LRRangeTest: lr = lr_range_test_min_lr * (1 + step_rate * interval), interval = (i + 1) /
  step_size, floored with ``lr_range_test_staircase``.

A param group whose lr is a tensor keeps its tensor: the schedule fills it in place (DeepSpeed's
``update_lr``), so code holding the tensor (a compiled optimizer step) sees the new value.

Deliberate differences from DeepSpeed: an unknown warmup_type is a ValueError (DeepSpeed warns and
uses "log"); OneCycle keeps each group's own beta2 where DeepSpeed writes 0.99; WarmupCosineLR's
state_dict also holds the base lrs, so a resumed schedule does not take the already-scheduled
optimizer lr as its base; get_last_lr() before any lr was set raises RuntimeError.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch

WARMUP_TYPES = ("log", "linear")
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle")


def _number(value: Any) -> Any:
    """A float, or a tensor lr kept as a tensor (cloned, so filling the group's lr leaves it)."""
    return value.detach().clone() if torch.is_tensor(value) else float(value)


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list:
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} values but the optimizer has {n} param groups")
        return [_number(v) for v in value]
    return [_number(value)] * n


def set_lrs(param_groups: list[dict], lrs: list) -> list:
    """Write ``lrs`` into the groups (filling a tensor lr in place); returns the groups' lrs."""
    for group, lr in zip(param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def _check_int(name: str, value: Any, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}; got {value!r}")
    return value


class _Schedule:
    """Shared plumbing: step(), get_last_lr(), state_dict() / load_state_dict()."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.last_batch_iteration = _check_int("last_batch_iteration", last_batch_iteration, -1)
        self._last_lr: list[float] | None = None

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def _apply(self) -> None:
        self._last_lr = set_lrs(self.optimizer.param_groups, self.get_lr())

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: one more) and set the groups' lr."""
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        self._apply()

    def get_last_lr(self) -> list[float]:
        """The lrs last written to the optimizer."""
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr(): no lr set yet; call step() first")
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.last_batch_iteration = state_dict["last_batch_iteration"]


def _warmup_gamma(i: int, warmup_num_steps: int, warmup_type: str) -> float:
    if warmup_type == "log":
        return (1.0 / math.log(warmup_num_steps)) * math.log(i + 1)
    return i / warmup_num_steps


def _check_warmup_type(warmup_type: Any) -> str:
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type={warmup_type!r} is not supported; allowed: {', '.join(map(repr, WARMUP_TYPES))}")
    return warmup_type


class WarmupLR(_Schedule):
    """warmup_min_lr -> warmup_max_lr over warmup_num_steps ("log" or "linear"), then constant.
    warmup_max_lr=None warms each param group up to its own lr. Floats or one value per group."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None, warmup_num_steps: int = 1000,
        warmup_type: str = "log", last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, _check_int("warmup_num_steps", warmup_num_steps, 1))
        self.warmup_type = _check_warmup_type(warmup_type)
        if last_batch_iteration == -1:
            self._apply()

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + d * gamma for lo, d in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay from warmup_max_lr to warmup_min_lr at total_num_steps."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0, warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _check_int("total_num_steps", total_num_steps, 1)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"WarmupDecayLR: total_num_steps {total_num_steps} is less than warmup_num_steps {self.warmup_num_steps}",
                          stacklevel=2)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """Ratio of each group's base lr: warmup_min_ratio -> 1 over warmup_num_steps, then a cosine
    down to cos_min_ratio at total_num_steps."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = _check_int("total_num_steps", total_num_steps, 1)
        for name, value in (("warmup_min_ratio", warmup_min_ratio), ("cos_min_ratio", cos_min_ratio)):
            if not (isinstance(value, (int, float)) and 0 <= value <= 1):
                raise ValueError(f"{name} must be a number in [0, 1]; got {value!r}")
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_num_steps = max(2, _check_int("warmup_num_steps", warmup_num_steps, 1))
        self.warmup_type = _check_warmup_type(warmup_type)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"WarmupCosineLR: total_num_steps {total_num_steps} is less than warmup_num_steps {self.warmup_num_steps}",
                          stacklevel=2)
        self.org_lrs = [_number(group["lr"]) for group in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._apply()

    def get_lr_ratio(self) -> float:
        i = self.last_batch_iteration
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            gamma = _warmup_gamma(i, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (i - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration, "org_lrs": list(self.org_lrs)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if "org_lrs" in state_dict:  # DeepSpeed's own state_dict has only last_batch_iteration
            self.org_lrs = list(state_dict["org_lrs"])


class OneCycle(_Schedule):
    """1cycle: lr up cycle_min_lr -> cycle_max_lr over cycle_first_step_size steps, back down over
    cycle_second_step_size (default: the first), then decay; momentum (betas[0]) the other way."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, cycle_min_lr: float, cycle_max_lr: float,
        decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        first = _check_int("cycle_first_step_size", cycle_first_step_size, 1)
        second = first if cycle_second_step_size is None else _check_int("cycle_second_step_size", cycle_second_step_size, 0)
        self.first_step_size, self.second_step_size = float(first), float(second)
        self.total_size = float(first + second)
        self.step_ratio = first / self.total_size
        self.first_stair_count = _check_int("cycle_first_stair_count", cycle_first_stair_count, 0)
        self.second_stair_count = (self.first_stair_count if cycle_second_stair_count is None
                                   else _check_int("cycle_second_stair_count", cycle_second_stair_count, 0))
        self.decay_step_size = _check_int("decay_step_size", decay_step_size, 0)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.skip_lr_decay = self.decay_step_size == 0 or self.decay_lr_rate == 0
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and "betas" not in optimizer.defaults:
            warnings.warn(f"OneCycle: cycle_momentum is off because {type(optimizer).__name__} has no betas", stacklevel=2)
            self.cycle_momentum = False
        self.decay_mom_rate = float(decay_mom_rate)
        self.skip_mom_decay = self.decay_step_size == 0 or self.decay_mom_rate == 0
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        if last_batch_iteration == -1:
            self._last_lr = set_lrs(optimizer.param_groups, self.min_lrs)
            if self.cycle_momentum:
                self._set_momentum(self.min_moms)

    def _scale_factor(self) -> float:
        b = self.last_batch_iteration + 1
        cycle = math.floor(1 + b / self.total_size)
        x = 1.0 + b / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # quantise from the integer position, not the float scale (exact stair edges)
            pos = b % self.total_size
            if pos <= self.first_step_size:
                position = pos * stairs / self.first_step_size
            else:
                position = (self.total_size - pos) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_interval()
        return [lo / factor for lo in self.min_lrs]

    def _moms(self) -> list[float]:
        """betas[0] per group at the current step."""
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decay_interval()
        return [hi * factor for hi in self.max_moms]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """(betas[0], betas[1]) per group at the current step, as DeepSpeed's (None when momentum
        is not cycled); betas[1] is the group's own."""
        if not self.cycle_momentum:
            return None
        return [(mom, group["betas"][1]) for mom, group in zip(self._moms(), self.optimizer.param_groups)]

    def _set_momentum(self, moms: list[float]) -> None:
        for group, mom in zip(self.optimizer.param_groups, moms):
            group["betas"] = (mom, group["betas"][1])

    def step(self, last_batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            self._set_momentum(self._moms())


class LRRangeTest(_Schedule):
    """The learning-rate range test: lr grows from lr_range_test_min_lr by step_rate every
    step_size steps (continuously, or in stairs)."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False, last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _check_int("lr_range_test_step_size", lr_range_test_step_size, 1)
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        if last_batch_iteration == -1:
            self._last_lr = set_lrs(optimizer.param_groups, self.min_lr)

    def _interval(self) -> float:
        interval = float(self.last_batch_iteration + 1) / self.step_size
        return math.floor(interval) if self.staircase else interval

    def get_lr(self) -> list[float]:
        increase = 1 + self.step_rate * self._interval()
        return [lr * increase for lr in self.min_lr]


SCHEDULERS = (*SCHEDULERS, "LRRangeTest")
_CLASSES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR, "OneCycle": OneCycle,
            "LRRangeTest": LRRangeTest}


def build_scheduler(scheduler_config: Any, optimizer: torch.optim.Optimizer) -> _Schedule:
    """The schedule the ``scheduler`` config section (a SchedulerConfig or {"type", "params"}) asks for."""
    if isinstance(scheduler_config, Mapping):
        kind, params = scheduler_config.get("type"), scheduler_config.get("params") or {}
    else:
        kind, params = getattr(scheduler_config, "type", None), getattr(scheduler_config, "params", None) or {}
    canonical = {n.lower(): n for n in SCHEDULERS}.get(kind.lower()) if isinstance(kind, str) else None
    if canonical is None:
        raise ValueError(f"scheduler.type={kind!r} is not supported; allowed: {', '.join(SCHEDULERS)}")
    cls = _CLASSES[canonical]
    allowed = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "optimizer")]
    for key in params:
        if key not in allowed:
            raise ValueError(f"scheduler.params.{key} is not a parameter of {canonical}; allowed: {', '.join(allowed)}")
    return cls(optimizer, **params)


__all__ = ["SCHEDULERS", "WARMUP_TYPES", "LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR",
           "build_scheduler", "set_lrs"]

"""DeepSpeed's step bookkeeping on tachyon's Engine: ``step(lr_kwargs=)``, ``was_step_applied``,
the optimizer's ``overflow`` / ``loss_scale_config``, and the callable ``engine.loss_scale``
(used by `tachyon.engine.compat_surface`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


class LossScale(float):
    """The current loss scale (a float). Called, it answers DeepSpeed's ``engine.loss_scale()``:
    the config's static ``fp16.loss_scale`` (0 = dynamic)."""

    def __new__(cls, current: float, configured: float):
        value = super().__new__(cls, current)
        value.configured = configured
        return value

    def __call__(self) -> float:
        return self.configured

    def __reduce__(self):  # pickles (a rank's result, a checkpoint) with both values
        return LossScale, (float(self), self.configured)


class LossScaleState:
    """DeepSpeed's ``optimizer.loss_scale_config``: the loss scaler's state, read live from the
    engine's precision object (``cur_scale``, ``cur_iter``, ``scale_window``, ...)."""

    def __init__(self, precision: Any, config: Any):
        self._precision, self._fp16 = precision, config.fp16
        self.dynamic_loss_scale = config.fp16.enabled and config.fp16.loss_scale == 0
        self.scale_window = config.fp16.loss_scale_window
        self.min_loss_scale = config.fp16.min_loss_scale

    @property
    def cur_scale(self) -> float:
        return self._precision.loss_scale

    def _scaler(self, name: str, default: Any) -> Any:
        return getattr(getattr(self._precision, "scaler", None), name, default)

    @property
    def cur_iter(self) -> int:
        return self._scaler("iteration", 0)

    @property
    def cur_hysteresis(self) -> int:
        return self._scaler("hysteresis_left", self._fp16.hysteresis)

    @property
    def last_overflow_iter(self) -> int:
        return self._scaler("last_overflow_iteration", -1)


class _SchedulerWithKwargs:
    """The engine's lr scheduler for one ``step(lr_kwargs=...)``: its ``step()`` gets the kwargs."""

    def __init__(self, scheduler: Any, kwargs: dict):
        self._scheduler, self._kwargs = scheduler, kwargs

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self._scheduler.step(*args, **{**self._kwargs, **kwargs})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)


def _count_step(engine: Any, run: Callable[[], Any]) -> Any:
    """Run one step call and record whether it updated the weights (DeepSpeed's ``_step_applied``)."""
    steps, skipped = engine.global_steps, engine.skipped_steps
    engine._step_applied = False
    result = run()
    took_step = engine.global_steps > steps
    engine._step_applied = took_step and engine.skipped_steps == skipped
    if took_step and engine.optimizer is not None:
        engine.optimizer.overflow = engine.skipped_steps != skipped  # DeepSpeed's optimizer.overflow
    return result


def deepspeed_step(step: Callable) -> Callable:
    """Wraps ``Engine.step`` with DeepSpeed's ``step(lr_kwargs=None)``: records
    ``was_step_applied``, refuses a step inside ``no_sync()`` (as DeepSpeed), and passes
    ``lr_kwargs`` to the lr scheduler's ``step``."""

    @functools.wraps(step)
    def wrapper(self, lr_kwargs: dict | None = None) -> None:
        if self._inside_no_sync:
            raise RuntimeError("engine.step() inside engine.no_sync(): leave the no_sync block first (its gradients "
                               "are reduced by the next backward outside it), as DeepSpeed requires")
        if not lr_kwargs or self.lr_scheduler is None:
            return _count_step(self, lambda: step(self))
        scheduler = self.lr_scheduler
        self.lr_scheduler = _SchedulerWithKwargs(scheduler, dict(lr_kwargs))
        try:
            return _count_step(self, lambda: step(self))
        finally:
            self.lr_scheduler = scheduler

    return wrapper


def records_step(method: Callable) -> Callable:
    """Wraps a method that may take an optimizer step (``train_batch``) to record ``was_step_applied``."""

    @functools.wraps(method)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        return _count_step(self, lambda: method(self, *args, **kwargs))

    return wrapper


__all__ = ["LossScale", "LossScaleState", "deepspeed_step", "records_step"]

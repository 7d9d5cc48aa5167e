"""Loss scalers for fp16 training: a static scale, or DeepSpeed's dynamic scaler.

Dynamic loss scaling (DeepSpeed's DynamicLossScaler semantics). The loss is multiplied by the
scale before backward so small fp16 gradients do not underflow; the gradients are divided by
it before the step. After every boundary step, `update(overflow)`:

- overflow (an inf/nan in any gradient on any rank): the step is skipped. If ``hysteresis`` is
  1, or only one unit of hysteresis is left, the scale is divided by 2 (never below
  ``min_scale``); otherwise one unit of hysteresis is spent and the scale kept.
- no overflow: with ``consecutive_hysteresis`` the hysteresis is restored at once (so only
  consecutive overflows lower the scale); and every ``window`` steps since the last overflow
  the scale doubles (restoring the hysteresis without ``consecutive_hysteresis``).

Concretely, with iteration counter ``it`` (all boundary steps, skipped ones included) and
``last_overflow`` the ``it`` of the latest overflow (-1 at the start), a clean step doubles the
scale when ``stable = it - last_overflow - 1`` is positive and a multiple of ``window``: on the
clean step that follows ``window`` clean steps (the ``window + 1``-th), then every ``window``
clean steps, exactly as DeepSpeed's ``update_scale``.

One deliberate difference: an overflow at ``min_scale`` keeps the scale there and skips the step
(DeepSpeed raises by default, ``raise_error_at_min_scale``); ``engine.skipped_steps`` counts them.
"""

from __future__ import annotations

from typing import Any


class StaticLossScaler:
    """A fixed loss scale (fp16 ``loss_scale > 0``); overflowing steps are still skipped."""

    dynamic = False

    def __init__(self, scale: float):
        if not scale > 0:
            raise ValueError(f"loss scale must be > 0; got {scale!r}")
        self.scale = float(scale)

    def update(self, overflow: bool) -> None:
        del overflow

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler:
    """DeepSpeed-compatible dynamic loss scale (see the module docstring).

    Args:
        init_scale: starting scale (``2 ** initial_scale_power``).
        window: clean steps between doublings (``loss_scale_window``).
        min_scale: floor (``min_loss_scale``).
        hysteresis: overflows tolerated before the scale is lowered (``hysteresis``).
        consecutive_hysteresis: only consecutive overflows count toward the hysteresis.
        factor: multiply/divide by this (2).
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        window: int = 1000,
        min_scale: float = 1.0,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        factor: float = 2.0,
    ):
        for name, value in (("init_scale", init_scale), ("min_scale", min_scale), ("factor", factor)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0; got {value!r}")
        if window < 1 or hysteresis < 1:
            raise ValueError(f"window and hysteresis must be >= 1; got {window!r}, {hysteresis!r}")
        self.scale = float(init_scale)
        self.window, self.min_scale, self.factor = int(window), float(min_scale), float(factor)
        self.hysteresis, self.consecutive_hysteresis = int(hysteresis), bool(consecutive_hysteresis)
        self.hysteresis_left = self.hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            stable = self.iteration - self.last_overflow_iteration - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= self.factor
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "hysteresis_left": self.hysteresis_left,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])

"""``deepspeed.runtime.progressive_layer_drop.ProgressiveLayerDrop``: DeepSpeed's stateful PLD
schedule (``update_state(global_step)`` then ``get_theta()`` / ``get_state()``) over
`tachyon.engine.pld.ProgressiveLayerDrop`'s formula, so the keep ratio is DeepSpeed's to the
bit. As in DeepSpeed, ``theta`` may be anywhere in [0, 1] here (tachyon's engine config takes
(0, 1]: theta 0 drops the last layer always in the long run)."""

from __future__ import annotations

from typing import Any

from tachyon.engine.pld import ProgressiveLayerDrop as _Schedule


class ProgressiveLayerDrop:
    """DeepSpeed's ``ProgressiveLayerDrop(theta=0.5, gamma=0.001)``."""

    def __init__(self, theta: float = 0.5, gamma: float = 0.001):
        if not 0.0 <= theta <= 1.0:
            raise ValueError(f"ProgressiveLayerDrop: theta must be in [0, 1]; got {theta!r}")
        self.theta, self.gamma = theta, gamma
        self._schedule = _Schedule(1.0, gamma)
        self._schedule.theta = float(theta)  # the formula is the same for every theta in [0, 1]
        self.current_theta = 1.0

    def get_state(self) -> dict[str, Any]:
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def get_theta(self) -> float:
        return self.current_theta

    def update_state(self, global_step: int) -> None:
        self.current_theta = self._schedule.theta_at(global_step)


__all__ = ["ProgressiveLayerDrop"]

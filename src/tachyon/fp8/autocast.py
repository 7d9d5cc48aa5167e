"""``fp8_autocast``: the context in which FP8-capable modules run their GEMMs in FP8.

    with tachyon.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
        y = model(x)
    y.sum().backward()          # outside the context, as in Transformer Engine

Contexts nest; the innermost one's settings are in force. The forward amaxes recorded inside are
turned into new scales when the outermost context exits (reduced over ``fp8_group`` first when
one is given). The settings live in a process-wide stack rather than a thread-local, because
autograd may run a backward on its own device threads and the backward must see whether an
autocast is open (running backward inside one is an error).

``enabled`` and ``calibrating`` are independent, as in Transformer Engine:

    enabled  calibrating   GEMM numerics      amax statistics recorded (and scales updated)
    False    False         high precision     no   (the same as no fp8_autocast)
    False    True          high precision     yes  (calibration: scales for a later FP8 run)
    True     False         FP8                yes
    True     True          FP8                yes

An activation-checkpointed region recomputed in the backward re-enters the autocast settings
its forward ran under (:mod:`tachyon.fp8.checkpoint`); while it does, :func:`recomputing` is
true, nothing is registered for a scale update and a nested fp8_autocast never counts as the
outermost one.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from tachyon.fp8.recipe import DelayedScaling
from tachyon.fp8.scaling import GemmScaling, update_scales


@dataclasses.dataclass(frozen=True)
class AutocastSettings:
    """What one fp8_autocast asked for."""

    enabled: bool
    calibrating: bool
    recipe: DelayedScaling
    group: object = None

    @property
    def fp8(self) -> bool:
        """GEMMs run with FP8 numerics: ``enabled`` decides, whatever ``calibrating`` says."""
        return self.enabled

    @property
    def records(self) -> bool:
        """amax statistics are recorded: FP8 runs, and calibration runs in high precision."""
        return self.enabled or self.calibrating


_stack: list[AutocastSettings] = []
# GEMMs that ran a forward in the open outermost context: id -> (scaling, recipe, group)
_pending: dict[int, tuple[GemmScaling, DelayedScaling, object]] = {}
# > 0 while an activation-checkpointed region is being recomputed (tachyon.fp8.checkpoint)
_recompute_depth = [0]


def recomputing() -> bool:
    """True while a checkpointed region's forward is recomputed in the backward."""
    return _recompute_depth[0] > 0


def current_settings() -> AutocastSettings | None:
    """The innermost open fp8_autocast's settings, or None outside any."""
    return _stack[-1] if _stack else None


def autocast_active() -> bool:
    """True inside any fp8_autocast (enabled or not)."""
    return bool(_stack)


def is_fp8_enabled() -> bool:
    """True where GEMMs of FP8-capable modules run in FP8 now."""
    settings = current_settings()
    return settings is not None and settings.fp8


def register_forward(scaling: GemmScaling, settings: AutocastSettings) -> None:
    """Called by an FP8 GEMM's forward: update its input/weight scales when the context exits.

    A no-op in a recomputation: the original forward registered the GEMM already."""
    if recomputing():
        return
    _pending[id(scaling)] = (scaling, settings.recipe, settings.group)


def _flush_pending() -> None:
    items = list(_pending.values())
    _pending.clear()
    update_scales(
        (state, recipe, group) for scaling, recipe, group in items for state in (scaling.input, scaling.weight)
    )


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: DelayedScaling | None = None,
    fp8_group: object = None,
) -> Iterator[None]:
    """Run the GEMMs of FP8-capable modules (Linear, LayerNormLinear, LayerNormMLP, ...) in FP8.

    enabled: the GEMMs run with FP8 numerics (and record amaxes). calibrating: record the amax
    statistics and update the scales even when ``enabled`` is False, so that a model trained in
    high precision can be saved with FP8 scales ready for an FP8 run (Transformer Engine's
    meaning; with ``enabled=True`` it changes nothing). fp8_recipe: a :class:`DelayedScaling`
    (default ``DelayedScaling()``). fp8_group: a torch.distributed process group over which
    amaxes are all-reduced (MAX) at exit, when the recipe's ``reduce_amax`` is true. Wrap only
    the forward; call backward after exiting.
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"fp8_autocast: enabled must be a bool; got {enabled!r}")
    if not isinstance(calibrating, bool):
        raise ValueError(f"fp8_autocast: calibrating must be a bool; got {calibrating!r}")
    recipe = DelayedScaling() if fp8_recipe is None else fp8_recipe
    if not isinstance(recipe, DelayedScaling):
        raise ValueError(f"fp8_autocast: fp8_recipe must be a tachyon.fp8.DelayedScaling; got {type(fp8_recipe).__name__}")
    outermost = not _stack and not recomputing()
    _stack.append(AutocastSettings(enabled, calibrating, recipe, fp8_group))
    ok = False
    try:
        yield
        ok = True
    finally:
        _stack.pop()
        if outermost:
            if ok:
                _flush_pending()
            else:  # the forward failed: drop this step's updates, keep the old scales
                _pending.clear()


__all__ = [
    "AutocastSettings", "autocast_active", "current_settings", "fp8_autocast", "is_fp8_enabled", "recomputing",
    "register_forward",
]

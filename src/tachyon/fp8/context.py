"""``tachyon.autocast``: the context in which FP8-capable modules run their GEMMs in FP8.

    with tachyon.autocast(enabled=True, recipe=Float8CurrentScaling()):
        y = model(x)
    y.sum().backward()          # outside the context, as in Transformer Engine

Transformer Engine 2.x's signature: ``autocast(enabled=True, calibrating=False, recipe=None,
amax_reduction_group=None, _graph=False)``; ``fp8_autocast(enabled, calibrating, fp8_recipe,
fp8_group)`` (its 1.x name) is the same context. Contexts nest; the innermost one's settings are
in force. The delayed-scaling amaxes recorded inside are turned into new scales when the
outermost context exits (reduced over ``amax_reduction_group`` first when one is given;
:mod:`tachyon.fp8.pending`), unless it was opened with ``_graph=True`` (a CUDA-graph capture,
whose wrapper updates them itself). The settings live in a process-wide stack rather than a
thread-local, because autograd may run a backward on its own device threads and the backward
must see whether an autocast is open (running backward inside one is an error).

``enabled`` and ``calibrating`` are independent, as in Transformer Engine:

    enabled  calibrating   GEMM numerics      amax statistics recorded (and scales updated)
    False    False         high precision     no   (the same as no autocast)
    False    True          high precision     yes  (calibration: delayed-scaling scales for a later FP8 run)
    True     False         FP8                yes  (delayed scaling; the other recipes keep no statistics)
    True     True          FP8                yes

Entering with ``enabled=True`` checks that this machine runs the recipe (MXFP8BlockScaling needs
compute capability 10.x; :func:`recipe_support`), and opens nothing when it does not.

An activation-checkpointed region recomputed in the backward re-enters the autocast settings
its forward ran under (:mod:`tachyon.fp8.checkpoint`); while it does, :func:`recomputing` is
true, nothing is registered for a scale update and a nested autocast never counts as the
outermost one.
"""

from __future__ import annotations

import dataclasses

import torch

from tachyon.fp8 import pending
from tachyon.fp8.recipe import DelayedScaling, MXFP8BlockScaling, Recipe
from tachyon.fp8.scaling import GemmScaling


@dataclasses.dataclass(frozen=True)
class AutocastSettings:
    """What one autocast asked for (``group``: its amax_reduction_group)."""

    enabled: bool
    calibrating: bool
    recipe: Recipe
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
# > 0 while an activation-checkpointed region is being recomputed (tachyon.fp8.checkpoint)
_recompute_depth = [0]


def recomputing() -> bool:
    """True while a checkpointed region's forward is recomputed in the backward."""
    return _recompute_depth[0] > 0


def current_settings() -> AutocastSettings | None:
    """The innermost open autocast's settings, or None outside any."""
    return _stack[-1] if _stack else None


def autocast_active() -> bool:
    """True inside any autocast (enabled or not)."""
    return bool(_stack)


def is_fp8_enabled() -> bool:
    """True where GEMMs of FP8-capable modules run in FP8 now."""
    settings = current_settings()
    return settings is not None and settings.fp8


def register_forward(scaling: GemmScaling, settings: AutocastSettings) -> None:
    """Called by a delayed-scaling GEMM's forward: update its input/weight scales when the
    outermost autocast exits. A no-op in a recomputation: the original forward registered it."""
    if recomputing():
        return
    pending.mark_forward(scaling, settings.recipe, settings.group)


def recipe_support(recipe: Recipe, device: torch.device | str | None = None) -> tuple[bool, str]:
    """(runs, why not) for ``recipe`` on ``device`` (default: the current CUDA device, else CPU).
    Every recipe runs everywhere (natively or emulated: :func:`tachyon.fp8.gemm_paths`) but
    MXFP8BlockScaling, which needs a GPU of compute capability 10.x (Transformer Engine's rule)."""
    if not isinstance(recipe, MXFP8BlockScaling):
        return True, ""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type != "cuda":
        return False, (f"MXFP8BlockScaling needs a GPU of compute capability 10.x (Blackwell: B200, GB200, "
                       f"B300); this machine runs on {device.type}. Use Float8BlockScaling (1x128 / 128x128 "
                       "blocks; native on compute capability 9.0) or Float8CurrentScaling")
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if major == 10 or major == 11:
        return True, ""
    return False, (f"MXFP8BlockScaling needs a GPU of compute capability 10.x (Blackwell: B200, GB200, B300); "
                   f"{name} is {major}.{minor}. Use Float8BlockScaling (1x128 / 128x128 blocks; native on "
                   "compute capability 9.0) or Float8CurrentScaling")


def _check_arguments(enabled, calibrating, recipe, graph) -> Recipe:
    if not isinstance(enabled, bool):
        raise ValueError(f"autocast: enabled must be a bool; got {enabled!r}")
    if not isinstance(calibrating, bool):
        raise ValueError(f"autocast: calibrating must be a bool; got {calibrating!r}")
    if not isinstance(graph, bool):
        raise ValueError(f"autocast: _graph must be a bool; got {graph!r}")
    recipe = DelayedScaling() if recipe is None else recipe
    if not isinstance(recipe, Recipe):
        raise ValueError(
            f"autocast: recipe must be a tachyon.fp8 recipe (DelayedScaling, Float8CurrentScaling, "
            f"Float8BlockScaling, MXFP8BlockScaling); got {type(recipe).__name__}"
        )
    if calibrating and not enabled and not recipe.stateful:
        raise ValueError(
            f"autocast: calibrating=True collects the amax statistics delayed scaling computes its scales from; "
            f"{type(recipe).__name__} computes every scale from the tensor being cast and keeps no statistics. "
            "Pass recipe=DelayedScaling(...) to calibrate, or enabled=True to run FP8"
        )
    if enabled:
        runs, why = recipe_support(recipe)
        if not runs:
            raise RuntimeError(f"autocast: {why}")
        if recipe.blockwise and torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing():
            from tachyon.fp8.block_gemm import probe

            probe(recipe)  # cached after the first time: whether the blockwise torch._scaled_mm runs here
    return recipe


class autocast:  # noqa: N801 - Transformer Engine's name for a context manager
    """Run the GEMMs of FP8-capable modules (Linear, LayerNormLinear, LayerNormMLP, ...) in FP8.

    enabled: the GEMMs run with FP8 numerics. calibrating: record delayed-scaling amax statistics
    and update the scales even when ``enabled`` is False, so that a model trained in high
    precision can be saved with FP8 scales ready for an FP8 run (Transformer Engine's meaning;
    DelayedScaling only). recipe: DelayedScaling (default ``DelayedScaling()``),
    Float8CurrentScaling, Float8BlockScaling or MXFP8BlockScaling. amax_reduction_group: a
    torch.distributed process group over which delayed-scaling amaxes are all-reduced (MAX) at
    each update, when the recipe's ``reduce_amax`` is true (the other recipes reduce nothing).
    _graph: a CUDA-graph capture: the outermost exit does not update the scales (the graph's
    wrapper calls :func:`tachyon.fp8.update_module_scales`). Wrap only the forward; call backward
    after exiting. An instance cannot be entered again while it is open.
    """

    __slots__ = ("_graph", "_outermost", "_settings")

    def __init__(self, enabled: bool = True, calibrating: bool = False, recipe: Recipe | None = None,
                 amax_reduction_group: object = None, _graph: bool = False) -> None:
        recipe = _check_arguments(enabled, calibrating, recipe, _graph)
        self._settings = AutocastSettings(enabled, calibrating, recipe, amax_reduction_group)
        self._graph = _graph
        self._outermost: bool | None = None

    @property
    def recipe(self) -> Recipe:
        return self._settings.recipe

    @property
    def settings(self) -> AutocastSettings:
        return self._settings

    def __enter__(self) -> autocast:
        if self._outermost is not None:
            raise RuntimeError("autocast: this context is open already; create a new tachyon.autocast(...) to nest one")
        self._outermost = not _stack and not recomputing()
        _stack.append(self._settings)
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        _stack.pop()
        outermost, self._outermost = self._outermost, None
        if outermost and not self._graph:
            if exc_type is None:
                pending.reduce_and_update_fp8_tensors(forward=True)
            else:  # the forward failed: drop this step's updates, keep the old scales
                pending.discard_forward()


def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Recipe | None = None,
    fp8_group: object = None,
    _graph: bool = False,
) -> autocast:
    """Transformer Engine 1.x's name and argument names for :class:`autocast`: ``fp8_recipe`` is
    ``recipe``, ``fp8_group`` is ``amax_reduction_group``."""
    return autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group,
                    _graph=_graph)


__all__ = [
    "AutocastSettings", "autocast", "autocast_active", "current_settings", "fp8_autocast", "is_fp8_enabled",
    "recipe_support", "recomputing", "register_forward",
]

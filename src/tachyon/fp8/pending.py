"""The delayed-scaling states waiting for a scale update, and the functions that update them.

Delayed scaling records each cast's amax into its state's ``amax_history[0]``; the scale comes
from the history later, for all GEMMs of a pass together (one :func:`update_scales` call, one
amax all-reduce per group), at the points Transformer Engine updates them:

    forward   the input and weight states of every GEMM whose forward ran in an autocast are
              updated when the outermost ``tachyon.autocast`` exits (not with ``_graph=True``)
    backward  the grad_output states of every GEMM whose backward ran in a backward pass are
              updated when that pass ends (a callback queued on the autograd engine; not while a
              CUDA graph is being captured)

:func:`reduce_and_update_fp8_tensors` (Transformer Engine's name) runs either update on demand:
what a CUDA-graph wrapper calls where the autocast exit or the end of the backward pass did not
run it. Replaying a captured graph runs no Python, so nothing is marked pending by a replay:
:func:`update_module_scales` updates the states of given modules' GEMMs instead (the replayed
kernels recorded their amaxes in place). Current and block scaling keep no state: nothing of
theirs is ever pending, and both functions do nothing for them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tachyon.fp8.scaling import GemmScaling, ScalingState, update_scales

# GEMMs whose forward ran in the open outermost autocast: id(scaling) -> (scaling, recipe, group)
_forward: dict[int, tuple[GemmScaling, object, object]] = {}
# grad_output states of GEMMs whose backward ran in the running backward pass
_backward: dict[int, tuple[ScalingState, object, object]] = {}


def mark_forward(scaling: GemmScaling, recipe, group) -> None:
    """This GEMM's input and weight states update at the next forward update."""
    _forward[id(scaling)] = (scaling, recipe, group)


def discard_forward() -> None:
    """Forget the forward states marked so far (a forward that raised: the old scales stay)."""
    _forward.clear()


def mark_backward(state: ScalingState, recipe, group, device: torch.device) -> None:
    """This grad_output state updates when the running backward pass ends: every FP8 GEMM's
    state of the pass in one :func:`update_scales` call (stacked, one all-reduce per group). A GEMM
    run twice in one pass records the larger amax and updates once. Every call queues the update
    (the first one of a pass does the work, the rest find nothing): a pass that raised before its
    end never ran its callbacks, and an update queued only when nothing was pending would then
    never run again. While a CUDA graph is captured nothing is queued (the graph's wrapper calls
    :func:`reduce_and_update_fp8_tensors` or :func:`update_module_scales`)."""
    _backward[id(state)] = (state, recipe, group)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    torch.autograd.Variable._execution_engine.queue_callback(_flush_backward)


def _flush_backward() -> None:
    reduce_and_update_fp8_tensors(forward=False)


def pending_states(forward: bool = True) -> int:
    """How many GEMMs (forward) or grad_output states (backward) wait for an update."""
    return len(_forward if forward else _backward)


def reduce_and_update_fp8_tensors(forward: bool = True) -> int:
    """Update the scales of every pending delayed-scaling state of one pass, now.

    forward=True: the input and weight states of the GEMMs whose forward ran since the last
    forward update; False: the grad_output states of the GEMMs whose backward ran since the last
    backward update. Per amax_reduction_group of the autocast they ran in (when the recipe says
    ``reduce_amax``), the newest amaxes are all-reduced (MAX) in one call; then each history
    becomes a scale and rolls (:func:`tachyon.fp8.update_scales`). Returns the number of states
    updated (0 when nothing is pending, as always for current and block scaling)."""
    pending = _forward if forward else _backward
    if not pending:
        return 0
    items = list(pending.values())
    pending.clear()
    if forward:
        updates = [(state, recipe, group) for scaling, recipe, group in items for state in (scaling.input, scaling.weight)]
    else:
        updates = items
    update_scales(updates)
    return len(updates)


def gemm_scalings(modules: Iterable[torch.nn.Module] | torch.nn.Module) -> list[GemmScaling]:
    """The GemmScaling of every FP8 GEMM in ``modules`` and their submodules, each once."""
    if isinstance(modules, torch.nn.Module):
        modules = [modules]
    seen: dict[int, GemmScaling] = {}
    for root in modules:
        for module in root.modules():
            for scaling in getattr(module, "fp8_scaling", {}).values():
                seen.setdefault(id(scaling), scaling)
    return list(seen.values())


def update_module_scales(modules: Iterable[torch.nn.Module] | torch.nn.Module, recipe, amax_reduction_group=None,
                         forward: bool = True) -> int:
    """Update the delayed-scaling states of every FP8 GEMM of ``modules`` (forward: input and
    weight; backward: grad_output) from the amaxes recorded since their last update, reducing
    them over ``amax_reduction_group`` when the recipe says ``reduce_amax``. For CUDA-graph
    replays, where no Python runs to mark states pending. Pending marks of those states are
    consumed. A stateless recipe (current, block scaling) has nothing to update: returns 0.
    Returns the number of states updated."""
    if not getattr(recipe, "stateful", False):
        return 0
    scalings = gemm_scalings(modules)
    if forward:
        for scaling in scalings:
            _forward.pop(id(scaling), None)
        states = [s for scaling in scalings for s in (scaling.input, scaling.weight)]
    else:
        states = [scaling.grad_output for scaling in scalings]
        for state in states:
            _backward.pop(id(state), None)
    update_scales((state, recipe, amax_reduction_group) for state in states)
    return len(states)


__all__ = ["discard_forward", "gemm_scalings", "mark_backward", "mark_forward", "pending_states",
           "reduce_and_update_fp8_tensors", "update_module_scales"]

"""FP8-faithful activation checkpointing: a recomputed region runs its FP8 GEMMs exactly as before.

    import torch.utils.checkpoint as cp
    with tachyon.fp8_autocast():
        y = cp.checkpoint(block, x, use_reentrant=False, context_fn=tachyon.fp8.fp8_checkpoint_context_fn())
    y.sum().backward()                           # block's recompute: same FP8 numerics as its forward

(``tachyon.checkpointing.checkpoint`` / ``checkpoint_sequential`` pass this context_fn already.)

Why it is needed. A checkpointed region is recomputed during the backward, i.e. after the
fp8_autocast it ran under has exited, and that exit updated the scales. Recomputed naively, the
region's GEMMs would run in high precision (no autocast is open) or, re-entered by hand, with
the new scales and record every amax a second time. Its recomputed activations would differ from
the forward's (torch's checkpoint may even refuse them: the saved FP8 operands become high
precision tensors), and so would the gradients.

What it does (Transformer Engine's checkpoint does the same for its FP8 modules):

- forward context: remembers the open autocast settings (the whole stack) and, for each FP8
  GEMM call inside the region, in order, the scale and scale_inv its input and weight were cast
  with (0-dim copies; for a weight taken from the ``is_first_microbatch`` cache, the cached FP8
  weight itself, which the cache holds anyway). Block recipes keep only the cached weight: their
  scales come from the data, which the recomputation reproduces.
- recompute context: re-enters exactly those autocast settings and makes the k-th call of each
  GEMM use the k-th remembered scales. Nothing is recorded (no amax is added to a history a
  second time), nothing is registered for a scale update, no weight is cached, and an
  fp8_autocast opened inside the region does not count as an outermost one (it updates nothing
  when it exits). So outputs, gradients, amax histories and scales equal the run without
  checkpointing, bit for bit.

Regions nest: a region recomputed inside an outer one's recomputation remembers the scales the
outer replay handed its GEMMs, which are the original ones. A region that runs outside any
fp8_autocast (and opens none) remembers nothing and is unaffected.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch

from tachyon.fp8 import context as _autocast
from tachyon.fp8.scaling import GemmScaling

ContextFn = Callable[[], tuple[AbstractContextManager, AbstractContextManager]]


class GemmCall:
    """What one FP8 GEMM forward used, for its recomputation: the input's scale and scale_inv,
    the weight's (scale None when the weight came from the cache) and the cached FP8 weight
    (per-tensor recipes: the FP8 tensor; block recipes: the CachedWeight, scales all None: the
    recomputation quantizes the same input the same way)."""

    __slots__ = ("cached_weight", "input_scale", "input_scale_inv", "weight_scale", "weight_scale_inv")

    def __init__(self, input_scale: torch.Tensor, input_scale_inv: torch.Tensor, weight_scale: torch.Tensor | None,
                 weight_scale_inv: torch.Tensor, cached_weight: torch.Tensor | None) -> None:
        self.input_scale, self.input_scale_inv = input_scale, input_scale_inv
        self.weight_scale, self.weight_scale_inv = weight_scale, weight_scale_inv
        self.cached_weight = cached_weight


class _RegionRecord:
    """One checkpointed region's forward: the autocast stack at entry and its GEMM calls."""

    def __init__(self) -> None:
        self.autocast_stack: tuple = ()
        self.calls: dict[int, tuple[GemmScaling, list[GemmCall]]] = {}


class _Replay:
    """A recomputation in progress: hands out the k-th remembered call of each GEMM."""

    def __init__(self, record: _RegionRecord) -> None:
        self.record = record
        self.position: dict[int, int] = {}

    def next(self, scaling: GemmScaling) -> GemmCall:
        calls = self.record.calls.get(id(scaling), (scaling, []))[1]
        k = self.position.get(id(scaling), 0)
        if k >= len(calls):
            raise RuntimeError(
                f"a checkpointed region's recomputation ran an FP8 GEMM {k + 1} time(s) but its forward ran it "
                f"{len(calls)} time(s): the region must run the same FP8 GEMMs when it is recomputed "
                "(no data-dependent control flow around FP8 modules)"
            )
        self.position[id(scaling)] = k + 1
        return calls[k]


_recording: list[_RegionRecord] = []  # forward contexts open now, outermost first
_replaying: list[_Replay] = []        # recompute contexts open now


def recording() -> bool:
    """True while a checkpointed region's forward runs under the FP8 forward context."""
    return bool(_recording)


def note_call(scaling: GemmScaling, call: GemmCall) -> None:
    """Remember ``call`` for every checkpointed region open now (regions nest)."""
    for record in _recording:
        record.calls.setdefault(id(scaling), (scaling, []))[1].append(call)


def replay_call(scaling: GemmScaling) -> GemmCall | None:
    """The remembered call this GEMM must repeat (innermost recomputation), or None outside one."""
    return _replaying[-1].next(scaling) if _replaying else None


class _ForwardContext(AbstractContextManager):
    def __init__(self, record: _RegionRecord) -> None:
        self.record = record

    def __enter__(self) -> None:
        self.record.autocast_stack = tuple(_autocast._stack)
        self.record.calls.clear()
        _recording.append(self.record)

    def __exit__(self, *exc: object) -> None:
        _recording.remove(self.record)


class _RecomputeContext(AbstractContextManager):
    """Re-entrant: torch enters the same object for every recomputation of the region."""

    def __init__(self, record: _RegionRecord) -> None:
        self.record = record
        self.saved_stacks: list[list] = []

    def __enter__(self) -> None:
        self.saved_stacks.append(list(_autocast._stack))
        _autocast._stack[:] = self.record.autocast_stack
        _replaying.append(_Replay(self.record))
        _autocast._recompute_depth[0] += 1

    def __exit__(self, *exc: object) -> None:
        _autocast._recompute_depth[0] -= 1
        _replaying.pop()
        _autocast._stack[:] = self.saved_stacks.pop()


class _Chain(AbstractContextManager):
    """Enters ``contexts`` in order and exits them in reverse; re-entrant when they are."""

    def __init__(self, *contexts: AbstractContextManager) -> None:
        self.contexts = contexts
        self.stacks: list[ExitStack] = []

    def __enter__(self) -> None:
        with ExitStack() as stack:
            for context in self.contexts:
                stack.enter_context(context)
            self.stacks.append(stack.pop_all())

    def __exit__(self, *exc: Any) -> bool:
        return bool(self.stacks.pop().__exit__(*exc))


def fp8_checkpoint_contexts() -> tuple[AbstractContextManager, AbstractContextManager]:
    """(forward context, recompute context) for one checkpointed call (see the module docstring);
    a valid ``context_fn`` for ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``."""
    record = _RegionRecord()
    return _ForwardContext(record), _RecomputeContext(record)


def fp8_checkpoint_context_fn(context_fn: ContextFn | None = None) -> ContextFn:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
    context_fn=...)`` that makes the recomputation of FP8 GEMMs faithful (module docstring).

    context_fn: another context_fn to combine with (e.g. torch's selective checkpointing
    ``functools.partial(create_selective_checkpoint_contexts, policy)``); its contexts are
    entered inside the FP8 ones.
    """
    if context_fn is not None and not callable(context_fn):
        raise ValueError(f"fp8_checkpoint_context_fn: context_fn must be a callable returning two context managers or None; "
                         f"got {type(context_fn).__name__}")

    def make_contexts() -> tuple[AbstractContextManager, AbstractContextManager]:
        forward, recompute = fp8_checkpoint_contexts()
        if context_fn is None:
            return forward, recompute
        inner_forward, inner_recompute = context_fn()
        return _Chain(forward, inner_forward), _Chain(recompute, inner_recompute)

    return make_contexts


__all__ = ["GemmCall", "fp8_checkpoint_context_fn", "fp8_checkpoint_contexts", "note_call", "recording", "replay_call"]

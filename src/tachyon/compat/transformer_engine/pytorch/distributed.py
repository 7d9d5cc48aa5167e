"""``transformer_engine.pytorch.distributed.checkpoint``: TE's activation checkpoint on tachyon's.

Transformer Engine's ``checkpoint(function, *args, distribute_saved_activations=False,
get_rng_state_tracker=None, tp_group=None, use_reentrant=True, **kwargs)`` takes its own keywords
besides the function's; tachyon's `tachyon.checkpointing.checkpoint` passes every keyword to the
function, so this adapter takes TE's out first:

- ``distribute_saved_activations=True`` splits saved inputs over a tensor-parallel group, which
  needs tensor parallelism (not in this version of tachyon): NotImplementedError.
- ``get_rng_state_tracker``: Megatron's CUDA RNG tracker for tensor-parallel dropout; tachyon's
  checkpoint restores the CPU and CUDA RNG states itself and tachyon's dropouts are seeded per
  call, so a tracker is not needed; one that is passed is refused rather than ignored.
- ``use_reentrant``: tachyon always uses PyTorch's non-reentrant checkpoint (same gradients,
  works with inputs that do not require grad); either value is accepted.
- ``tp_group`` must be None (no tensor parallelism).

FP8 regions are recomputed with the forward's scales, as TE does (docs/activation_checkpointing.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def checkpoint(function: Callable[..., Any], *args: Any, distribute_saved_activations: bool = False,
               get_rng_state_tracker: Any = None, tp_group: Any = None, use_reentrant: bool = True,
               **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` keeping only its inputs for backward (see the module docstring)."""
    from tachyon.engine.activation_checkpointing import checkpoint as tachyon_checkpoint

    if distribute_saved_activations:
        raise NotImplementedError("te.checkpoint(distribute_saved_activations=True) needs tensor parallelism, "
                                  "which is not in this version of tachyon; pass False")
    if get_rng_state_tracker is not None:
        raise NotImplementedError("te.checkpoint(get_rng_state_tracker=...) is for Megatron's tensor-parallel RNG "
                                  "tracker, which tachyon does not use: its checkpoint restores the RNG states "
                                  "itself; pass None")
    if tp_group is not None:
        raise NotImplementedError("te.checkpoint(tp_group=...) needs tensor parallelism, which is not in this "
                                  "version of tachyon; pass None")
    del use_reentrant
    return tachyon_checkpoint(function, *args, **kwargs)


__all__ = ["checkpoint"]

"""The boundary step's verdict: are the gradients finite, and was a stop requested? The same
answer on every rank, so no rank ever steps alone.

A non-finite gradient (an inf or nan anywhere, in any precision) never reaches the weights: the
step is skipped on every rank together (no parameter, master weight, optimizer moment or lr
schedule changes), counted in ``engine.skipped_steps``, and logged with the step and the first
offending parameter. After ``nonfinite_gradients.max_consecutive_skips`` such steps in a row,
training stops with `NonFiniteGradientsError` (the weights are still the last finite step's).

Cost. The engine computes the global gradient norm for every step anyway (clipping, the step
line), and ``norm = sqrt(sum of squares)`` is finite exactly when every gradient element is
(a square overflows fp32 only above 1.8e19, which the norm then reports as inf too). So the
check adds no pass over the gradients: one all-reduce (MAX) of a two-element flag over every
rank of the job, ``[norm is not finite, stop requested]``, and reading it on the host. The norm
is already equal on every rank where it was reduced (ZeRO-1/2 sum it over the data-parallel
ranks, tensor / pipeline parallelism over the model-parallel ones; at stage 0 every rank holds
the same averaged gradient); the flag all-reduce makes the verdict agree also where it is not
(1-bit optimizers in their compression stage step on each rank's own gradient), and carries
the preemption stop flag (`tachyon.engine.preemption`) in the same message. fp16 reads the norm
of the still-scaled gradients (finite exactly when they are) and unscales after the verdict;
bf16 without ``bf16.check_grad_overflow`` sends the flag only when preemption is on.

Only on a skipped step the strategy's gradient pieces are scanned for the first non-finite
parameter (one more pass and a MIN all-reduce over the data-parallel group); fp16 overflows
while the dynamic loss scale can still be lowered are its calibration: logged at INFO (with the
scale), not named, and not counted toward the stop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("tachyon.engine")


class NonFiniteGradientsError(RuntimeError):
    """Training stopped: too many consecutive steps had non-finite gradients."""


@dataclass
class StepVerdict:
    """What every rank does with this boundary step."""

    skip: bool
    """A gradient is inf or nan on some rank: no update anywhere."""
    stop: bool
    """Some rank got a preemption signal: stop after this step (`tachyon.engine.preemption`)."""
    grad_norm: torch.Tensor | None
    """The global norm of the unscaled gradients (None when skipped)."""


class StepGuard:
    """Decides each boundary step's `StepVerdict` for one engine (see the module docstring).

    Args:
        precision: the engine's `tachyon.engine.precision.Precision`.
        zero: the engine's ZeRO strategy (gradient norm, the pieces of each parameter).
        world_comm: collectives over every rank of the job.
        module: the trained model (parameter names for the log).
        max_consecutive_skips: stop after this many non-finite steps in a row (0: never).
        preemption: the engine's `tachyon.engine.preemption.PreemptionHandler`, or None.
    """

    def __init__(self, precision: Any, zero: Any, world_comm: Any, module: torch.nn.Module,
                 max_consecutive_skips: int, preemption: Any = None) -> None:
        self.precision, self.zero, self.world_comm, self.module = precision, zero, world_comm, module
        self.max_consecutive_skips = max_consecutive_skips
        self.preemption = preemption
        self.consecutive = 0
        """Non-finite steps in a row so far (fp16 calibration overflows not counted)."""
        self.first_bad: str | None = None
        """The first non-finite parameter of the current run of skipped steps."""

    def decide(self, grads: list[torch.Tensor], step: int) -> StepVerdict:
        """The verdict for the boundary step ``step`` (1-based: ``global_steps + 1``) over this
        rank's fp32 master gradients ``grads``; unscales them (fp16) when the step is taken.
        Collective over every rank of the job when a flag is needed."""
        norm = self.zero.grad_norm(grads)
        check = self.precision.checks_nonfinite
        stopping = self.preemption is not None and self.preemption.enabled
        bad = stop = False
        if check or stopping:
            flags = torch.stack([
                (~torch.isfinite(norm)).to(torch.float32) if check else norm.new_zeros((), dtype=torch.float32),
                norm.new_tensor(self.preemption.flag if stopping else 0.0, dtype=torch.float32),
            ])
            if self.world_comm.enabled and self.world_comm.world_size > 1:
                self.world_comm.all_reduce(flags, op=dist.ReduceOp.MAX)
            bad_flag, signum = flags.tolist()
            bad, stop = bool(bad_flag), bool(signum)
            if stop:
                self.preemption.agreed = int(signum)
        if bad:
            self._on_skip(grads, step)
            return StepVerdict(True, stop, None)
        self.consecutive, self.first_bad = 0, None
        return StepVerdict(False, stop, self.precision.unscale_(grads, norm))

    def _on_skip(self, grads: list[torch.Tensor], step: int) -> None:
        drop = getattr(self.zero.comm, "drop_nonfinite_errors", None)  # 1-bit compression's error feedback
        if drop is not None:
            drop()
        precision = self.precision
        if not precision.at_min_scale:  # the dynamic loss scale is still being calibrated
            logger.info("step %d skipped: fp16 gradient overflow at loss scale %g (the scale is lowered)",
                        step, precision.loss_scale)
            return
        name = first_nonfinite_parameter(self.zero, self.module, grads)
        self.consecutive += 1
        if self.first_bad is None:
            self.first_bad = name
        if self._reports():
            scale = f" at loss scale {precision.loss_scale:g}" if precision.name == "fp16" else ""
            logger.warning("step %d skipped: non-finite gradient (inf or nan) in %s%s on some rank; no weight, master "
                           "or optimizer state changed (%d such step(s) in a row)", step,
                           name or "an unnamed parameter", scale, self.consecutive)
        limit = self.max_consecutive_skips
        if limit and self.consecutive >= limit:
            raise NonFiniteGradientsError(
                f"training stopped at step {step}: {self.consecutive} consecutive steps had non-finite gradients "
                f"(first in {self.first_bad or 'an unnamed parameter'}); every one was skipped, so the weights and "
                f"optimizer states are those of step {step - self.consecutive}. Lower the learning rate, check the "
                "data of these steps, or raise nonfinite_gradients.max_consecutive_skips (0: never stop)"
            )

    def _reports(self) -> bool:
        """One log line per model part: data-parallel rank 0 of each."""
        return self.zero.rank == 0


def first_nonfinite_slot(zero: Any, flats: list[torch.Tensor]) -> int | None:
    """Index (in ``zero.flat.slots``) of the first parameter whose piece of ``flats`` (one tensor
    per param group laid out like this rank's master: the master itself, its gradient or an
    optimizer state) holds an inf or nan on this rank; None when none does. Local, no collective."""
    per_slot = zero.master_pieces(zero.rank, whole=not zero.partitioned_masters)
    for index, (slot, pieces) in enumerate(zip(zero.flat.slots, per_slot)):
        flat = flats[zero.master_index(slot)]
        if any(not bool(torch.isfinite(flat.narrow(0, at, hi - lo)).all()) for lo, hi, at in pieces):
            return index
    return None


def slot_name(zero: Any, module: torch.nn.Module, index: int) -> str:
    """The module's name of parameter ``index`` of the flat layout."""
    param = zero.flat.slots[index].param
    return next((n for n, p in module.named_parameters() if p is param), f"parameter #{index}")


def first_nonfinite_parameter(zero: Any, module: torch.nn.Module, grads: list[torch.Tensor]) -> str | None:
    """The name of the first parameter (flat-layout order) whose gradient holds an inf or nan,
    over the data-parallel group (each rank scans its own pieces; a MIN all-reduce picks the
    first); None when this model part has none. Collective over ``zero.comm``."""
    found = first_nonfinite_slot(zero, grads)
    found = len(zero.flat.slots) if found is None else found
    if zero.comm.enabled and zero.world_size > 1:
        flag = torch.tensor([float(found)], device=zero.device)
        zero.comm.all_reduce(flag, op=dist.ReduceOp.MIN)
        found = int(flag.item())
    return None if found >= len(zero.flat.slots) else slot_name(zero, module, found)


__all__ = ["NonFiniteGradientsError", "StepGuard", "StepVerdict", "first_nonfinite_parameter", "first_nonfinite_slot",
           "slot_name"]

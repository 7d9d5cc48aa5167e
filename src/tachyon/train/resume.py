"""What ``tachyon train --resume`` decides beyond loading the checkpoint: save on preemption by
default, a finished run left as it is, and what a changed ``--steps`` does to the lr schedule.

- Preemption: the job's engine section gets ``"preemption": {"enabled": true, "save_dir":
  "<output_dir>/checkpoints"}`` unless it has a ``preemption`` section of its own (``enabled:
  false`` turns it off). On SIGTERM or SIGUSR1 every rank finishes its step, the checkpoint is
  saved with the data position, metrics.csv / validation.csv already hold every step so far,
  and the command exits with 75 (``--resume`` continues).
- A run resumed at or past its ``steps`` trains nothing and rewrites nothing: it says so.
- ``--steps`` changed at a resume: the decaying schedules (WarmupDecayLR, WarmupCosineLR)
  stretch over ``total_num_steps``, which the job sets to ``steps``. The checkpoint records the
  length its schedule had; by default the resumed run keeps it (the lr goes on from where it
  was, and past the old end stays at the schedule's final value), and says so with the lr the
  other choice would give; ``--reschedule`` stretches the schedule over the new ``steps``
  instead (the lr jumps to the stretched schedule's value), and says that.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

__all__ = ["checkpoint_position", "default_preemption", "finished_note", "schedule_note"]


def default_preemption(engine_config: dict[str, Any], output_dir: Path) -> dict[str, Any]:
    """``engine_config`` with the job's preemption default (module docstring) filled in."""
    section = engine_config.get("preemption")
    if section is None:
        engine_config["preemption"] = {"enabled": True, "save_dir": str(output_dir / "checkpoints")}
    elif isinstance(section, dict) and section.get("enabled") and not section.get("save_dir"):
        engine_config["preemption"] = {**section, "save_dir": str(output_dir / "checkpoints")}
    return engine_config


def _total(scheduler: Any) -> int | None:
    total = getattr(scheduler, "total_num_steps", None)
    return total if isinstance(total, int) else None


def checkpoint_position(engine: Any, epoch: int, batches_in_epoch: int, steps: int) -> dict[str, Any]:
    """The client_state of a job checkpoint: the data position, the run's ``steps`` and the
    length of its lr schedule (None for a schedule without one)."""
    return {"epoch": epoch, "batches_in_epoch": batches_in_epoch, "step": engine.global_steps, "steps": steps,
            "schedule_total_steps": _total(engine.lr_scheduler)}


def finished_note(engine: Any, steps: int, output_dir: Path) -> str | None:
    """The note for a resumed run with nothing left to train (None when there is)."""
    if engine.global_steps < steps:
        return None
    return (f"{output_dir} already reached step {engine.global_steps} (this run's steps: {steps}); nothing to train, "
            f"no file changed (pass --steps above {engine.global_steps} to continue it)")


def _lr_at(scheduler: Any, total: int, iteration: int) -> float:
    """The lr ``scheduler`` sets at ``iteration`` with ``total_num_steps`` = ``total`` (on a copy)."""
    probe = copy.copy(scheduler)
    probe.total_num_steps = total
    probe.last_batch_iteration = iteration
    return float(probe.get_lr()[0])


def schedule_note(engine: Any, state: dict[str, Any], steps: int, reschedule: bool) -> str | None:
    """Apply the schedule rule of the module docstring after a resume; the note saying what it
    did (None when the length did not change)."""
    scheduler = engine.lr_scheduler
    new_total, saved_total = _total(scheduler), state.get("schedule_total_steps")
    saved_steps = state.get("steps")
    if new_total is None:
        return None
    if not isinstance(saved_total, int):
        if isinstance(saved_steps, int) and saved_steps != steps:
            return (f"--steps {steps}: the checkpoint does not record its lr schedule's length (saved by an older "
                    f"tachyon); {type(scheduler).__name__} runs over total_num_steps {new_total}")
        return None
    if saved_total == new_total:
        return None
    step = engine.global_steps
    name = type(scheduler).__name__
    following = scheduler.last_batch_iteration + 1  # the schedule's position for step + 1
    kept, stretched = _lr_at(scheduler, saved_total, following), _lr_at(scheduler, new_total, following)
    if reschedule:  # step + 1 already runs on the stretched schedule
        probe = copy.copy(scheduler)
        probe.last_batch_iteration = following
        for group, lr in zip(engine.optimizer.param_groups, probe.get_lr()):
            group["lr"] = lr
        return (f"--reschedule: {name} now runs over {new_total} steps instead of the checkpoint's {saved_total}: "
                f"step {step + 1} runs at lr {stretched:.3g} (on the checkpoint's schedule: {kept:.3g})")
    scheduler.total_num_steps = saved_total
    end = _lr_at(scheduler, saved_total, max(saved_total, following))
    return (f"steps {saved_steps if isinstance(saved_steps, int) else saved_total} -> {steps}: the lr schedule stays "
            f"the checkpoint's ({name} over {saved_total} steps): step {step + 1} runs at lr {kept:.3g}, and from step "
            f"{saved_total + 1} on at {end:.3g}; --reschedule stretches it over {new_total} steps instead (step "
            f"{step + 1} would run at lr {stretched:.3g})")

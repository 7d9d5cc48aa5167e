"""What a training run reports: scalars to TensorBoard/CSV, the periodic step line, wall-clock timers.

The Engine already uses these from its config (`tachyon.engine.telemetry`, ``engine.telemetry``);
use them directly only for a loop that does not go through ``engine.backward``/``engine.step``.

    monitor = Monitor(config, rank)                       # config.tensorboard / config.csv_monitor
    monitor.write_events([("Train/Samples/train_loss", 2.31, 640), ("Train/Samples/lr", 3e-4, 640)])

    step_logger = StepLogger(config.steps_per_print, samples_per_step=config.train_batch_size, rank=rank)
    step_logger.step(step, loss=loss, lr=lr, grad_norm=norm, loss_scale=scale, skipped_steps=skipped)
    # every steps_per_print steps, rank 0 prints:
    # step 100 | loss 2.3100 | lr 3.000e-04 | grad norm 1.052 | loss scale 65536 | skipped 2
    #   | 812.3 samples/s | 415897 tokens/s | step 78.79 ms

    timers = WallClockTimers()                            # when wall_clock_breakdown is on
    timers("forward").start(); ...; timers("forward").stop()
    print(timers.log(["forward", "backward", "reduce", "step"]))   # means over the print window

Only rank 0 writes (other ranks get a Monitor that does nothing), as in DeepSpeed. Event names
follow DeepSpeed's (``Train/Samples/train_loss``, ``Train/Samples/lr``,
``Train/Samples/loss_scale``, ``Train/Samples/elapsed_time_ms_forward``, ...); the step of a
``Train/Samples/*`` event is the number of samples seen.

TensorBoard: ``torch.utils.tensorboard.SummaryWriter`` writing to ``output_path/job_name``; it
needs the optional ``tensorboard`` package (``pip install 'tachyon[tensorboard]'``).
CSV (DeepSpeed's csv_monitor layout): one file per metric, ``output_path/job_name/<name>.csv``
with ``/`` and spaces in the name replaced by ``_``; its first row is ``step,<last part of the
name>``, then one ``step,value`` row per event. Unlike DeepSpeed the header is written only when
the file is new, so a resumed run appends to the same table.
"""

from __future__ import annotations

import csv
import math
import numbers
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from tachyon.config import MonitorConfig, TachyonConfig

__all__ = [
    "CsvWriter", "Monitor", "StepLogger", "TensorBoardWriter", "WallClockTimers", "format_breakdown_line",
    "format_step_line",
]

Event = tuple[str, Any, int]


def _scalar(value: Any, name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"event {name!r}: value must be a scalar; got a tensor of shape {tuple(value.shape)}")
        return float(value.item())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"event {name!r}: value must be a number or a one-element tensor; got {type(value).__name__}")


def _check_events(events: Iterable[Event]) -> list[tuple[str, float, int]]:
    out = []
    for event in events:
        if not isinstance(event, (tuple, list)) or len(event) != 3:
            raise ValueError(f"each event must be a (name, value, step) tuple; got {event!r}")
        name, value, step = event
        if not isinstance(name, str) or not name:
            raise ValueError(f"event name must be a non-empty string; got {name!r}")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"event {name!r}: step must be an int >= 0; got {step!r}")
        out.append((name, _scalar(value, name), int(step)))
    return out


def _log_dir(section: MonitorConfig) -> Path:
    return Path(section.output_path) / section.job_name


def _summary_writer_class() -> type:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ImportError(
            "tensorboard.enabled is true but TensorBoard is not installed; install the `tensorboard` extra: "
            "pip install 'tachyon[tensorboard]' (or disable the tensorboard section)"
        ) from error
    return SummaryWriter


class TensorBoardWriter:
    """Scalars to a TensorBoard event file in ``output_path/job_name`` (created on construction)."""

    def __init__(self, section: MonitorConfig):
        self.log_dir = _log_dir(section)
        self.writer = _summary_writer_class()(log_dir=str(self.log_dir))

    def write(self, events: Sequence[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class CsvWriter:
    """One CSV file per metric in ``output_path/job_name`` (DeepSpeed's csv_monitor layout)."""

    def __init__(self, section: MonitorConfig):
        self.log_dir = _log_dir(section)
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def path_for(self, name: str) -> Path:
        return self.log_dir / (name.replace("/", "_").replace(" ", "_") + ".csv")

    def write(self, events: Sequence[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            path = self.path_for(name)
            new = not path.exists() or path.stat().st_size == 0
            with path.open("a", newline="") as handle:
                writer = csv.writer(handle)
                if new:
                    writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerow([step, repr(value)])

    def close(self) -> None:
        pass


class Monitor:
    """The run's scalar sinks, built from ``config.tensorboard`` and ``config.csv_monitor``.

    Only ``rank`` 0 writes; on other ranks (or with both sections disabled) `write_events` does
    nothing. Raises ImportError naming the ``tensorboard`` extra when TensorBoard is enabled
    but not installed.
    """

    def __init__(self, config: TachyonConfig, rank: int = 0):
        if not isinstance(config, TachyonConfig):
            raise ValueError(f"config must be a TachyonConfig (tachyon.config.load_config); got {type(config).__name__}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an int >= 0; got {rank!r}")
        self.rank = rank
        self.writers: list[TensorBoardWriter | CsvWriter] = []
        if rank != 0:
            return
        if config.tensorboard.enabled:
            self.writers.append(TensorBoardWriter(config.tensorboard))
        if config.csv_monitor.enabled:
            self.writers.append(CsvWriter(config.csv_monitor))

    @property
    def enabled(self) -> bool:
        """True when this rank writes anywhere."""
        return bool(self.writers)

    def write_events(self, events: Iterable[Event]) -> None:
        """Write ``(name, value, step)`` events; values may be numbers or one-element tensors."""
        if not self.writers:
            return
        checked = _check_events(events)
        for writer in self.writers:
            writer.write(checked)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------- the step line


def _number(value: Any) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def format_step_line(
    step: int,
    *,
    loss: Any,
    lr: float | Sequence[float],
    grad_norm: Any = None,
    loss_scale: float | None = None,
    skipped_steps: int = 0,
    samples_per_s: float | None = None,
    tokens_per_s: float | None = None,
    step_time_s: float | None = None,
) -> str:
    """The progress line: ``step 100 | loss 2.3100 | lr 3.000e-04 | grad norm 1.052 | loss scale
    65536 | skipped 2 | 812.3 samples/s | 415897 tokens/s | step 78.79 ms``. Parts given as None
    are left out; ``lr`` may list one rate per parameter group."""
    lrs = [lr] if isinstance(lr, numbers.Real) else list(lr)
    parts = [f"step {step}", f"loss {_number(loss):.4f}", "lr " + ", ".join(f"{x:.3e}" for x in lrs)]
    if grad_norm is not None:
        parts.append(f"grad norm {_number(grad_norm):.4g}")
    if loss_scale is not None:
        parts.append(f"loss scale {loss_scale:g}")
    parts.append(f"skipped {skipped_steps}")
    if samples_per_s is not None:
        parts.append(f"{samples_per_s:.1f} samples/s")
    if tokens_per_s is not None:
        parts.append(f"{tokens_per_s:.0f} tokens/s")
    if step_time_s is not None:
        parts.append(f"step {step_time_s * 1e3:.2f} ms")
    return " | ".join(parts)


class StepLogger:
    """Prints `format_step_line` on rank 0 every ``steps_per_print`` optimizer steps.

    Throughput and step time are averages over the print window: the wall time since the
    previous printed line (or since construction / `restart_window`) divided by the steps in it.
    ``samples_per_step`` is the global batch (train_batch_size), so samples/s is the job's;
    tokens/s is shown when ``tokens_per_sample`` (the sequence length) is given.
    """

    def __init__(
        self,
        steps_per_print: int,
        samples_per_step: int,
        *,
        tokens_per_sample: int | None = None,
        rank: int = 0,
        printer: Callable[[str], None] = print,
        clock: Callable[[], float] = time.perf_counter,
    ):
        for name, value in (("steps_per_print", steps_per_print), ("samples_per_step", samples_per_step)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1; got {value!r}")
        if tokens_per_sample is not None and (not isinstance(tokens_per_sample, int) or tokens_per_sample < 1):
            raise ValueError(f"tokens_per_sample must be an int >= 1 or None; got {tokens_per_sample!r}")
        self.steps_per_print = steps_per_print
        self.samples_per_step = samples_per_step
        self.tokens_per_sample = tokens_per_sample
        self.rank = rank
        self.printer = printer
        self.clock = clock
        self.restart_window()

    def restart_window(self) -> None:
        """Start timing a new window now (e.g. after evaluation or checkpoint saving)."""
        self._window_start = self.clock()
        self._window_steps = 0

    def step(
        self,
        step: int,
        *,
        loss: Any,
        lr: float | Sequence[float],
        grad_norm: Any = None,
        loss_scale: float | None = None,
        skipped_steps: int = 0,
    ) -> str | None:
        """Call after every optimizer step (``step`` counts from 1). Returns the line on print
        steps (printed on rank 0 only), else None; ``loss`` is read (``.item()``) only then."""
        self._window_steps += 1
        if step % self.steps_per_print != 0:
            return None
        elapsed = self.clock() - self._window_start
        steps = self._window_steps
        step_time = elapsed / steps
        samples_per_s = self.samples_per_step / step_time if step_time > 0 else math.inf
        tokens_per_s = samples_per_s * self.tokens_per_sample if self.tokens_per_sample else None
        line = format_step_line(
            step, loss=loss, lr=lr, grad_norm=grad_norm, loss_scale=loss_scale, skipped_steps=skipped_steps,
            samples_per_s=samples_per_s, tokens_per_s=tokens_per_s, step_time_s=step_time,
        )
        if self.rank == 0:
            self.printer(line)
        self.restart_window()
        return line


# --------------------------------------------------------------------------- timers


def format_breakdown_line(ms_per_phase: dict[str, float]) -> str:
    """``time (ms) | forward: 12.10 | backward: 25.31 | reduce: 3.02 | step: 4.50``."""
    return "time (ms) | " + " | ".join(f"{name}: {value:.2f}" for name, value in ms_per_phase.items())


def _cuda_synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _Timer:
    def __init__(self, name: str, timers: WallClockTimers):
        self.name = name
        self._timers = timers
        self._started: float | None = None
        self.intervals: list[float] = []

    def start(self) -> None:
        if self._started is not None:
            raise RuntimeError(f"timer {self.name!r} is already running; stop() it first")
        if self._timers.synchronize:
            _cuda_synchronize()
        self._started = self._timers.clock()

    def stop(self) -> float:
        """Stop and return this interval in seconds."""
        if self._started is None:
            raise RuntimeError(f"timer {self.name!r} was stopped without start()")
        if self._timers.synchronize:
            _cuda_synchronize()
        elapsed = self._timers.clock() - self._started
        self._started = None
        self.intervals.append(elapsed)
        return elapsed

    def mean_ms(self) -> float:
        """Mean interval in milliseconds over the current window (0.0 when none was recorded)."""
        return 1e3 * sum(self.intervals) / len(self.intervals) if self.intervals else 0.0


class WallClockTimers:
    """Named wall-clock timers (DeepSpeed's forward/backward/reduce/step breakdown).

    ``timers(name)`` returns the timer, created on first use; ``start()``/``stop()`` it around a
    phase. With ``synchronize`` (default: when CUDA is available) both call
    ``torch.cuda.synchronize()`` so GPU work is counted in the phase that launched it.
    `log` gives the mean per phase over the intervals since the last reset.
    """

    def __init__(self, synchronize: bool | None = None, clock: Callable[[], float] = time.perf_counter):
        self.synchronize = torch.cuda.is_available() if synchronize is None else synchronize
        self.clock = clock
        self._timers: dict[str, _Timer] = {}

    def __call__(self, name: str) -> _Timer:
        if name not in self._timers:
            self._timers[name] = _Timer(name, self)
        return self._timers[name]

    def _select(self, names: Sequence[str] | None) -> list[str]:
        if names is None:
            return list(self._timers)
        unknown = [n for n in names if n not in self._timers]
        if unknown:
            raise ValueError(f"unknown timers {unknown}; started so far: {list(self._timers)}")
        return list(names)

    def mean_ms(self, name: str) -> float:
        return self._timers[self._select([name])[0]].mean_ms()

    def log(self, names: Sequence[str] | None = None, reset: bool = True) -> str:
        """``time (ms) | forward: 12.34 | backward: 25.10`` (means over the window), then reset them."""
        selected = self._select(names)
        line = format_breakdown_line({n: self._timers[n].mean_ms() for n in selected})
        if reset:
            self.reset(selected)
        return line

    def events(self, step: int, names: Sequence[str] | None = None) -> list[Event]:
        """Monitor events ``Train/Samples/elapsed_time_ms_<name>`` with the window means (no reset)."""
        return [(f"Train/Samples/elapsed_time_ms_{n}", self._timers[n].mean_ms(), step) for n in self._select(names)]

    def reset(self, names: Sequence[str] | None = None) -> None:
        """Forget the recorded intervals (running timers keep running)."""
        for name in self._select(names):
            self._timers[name].intervals.clear()

"""What the Engine reports while it trains, from the config alone (as DeepSpeed's engine does).

The Engine owns one `EngineTelemetry` (``engine.telemetry``) and calls it from ``forward``,
``backward`` and the accumulation-boundary ``step``; a plain loop then gets:

- the step line, every ``steps_per_print`` optimizer steps, printed on global rank 0::

      step 100 | loss 2.3100 | lr 3.000e-04 | grad norm 1.052 | loss scale 65536 | skipped 2
        | 812.3 samples/s | 415897 tokens/s | step 78.79 ms

  (one line; ``loss scale`` only with fp16, ``grad norm`` left out when the step overflowed,
  ``tokens/s`` only after ``engine.set_tokens_per_sample(n)``).
- monitor events (``tensorboard`` / ``csv_monitor`` sections, rank 0 writes) on every boundary
  step: ``Train/Samples/train_loss``, ``Train/Samples/lr``, ``Train/Samples/loss_scale`` (fp16)
  and, with ``wall_clock_breakdown``, ``Train/Samples/elapsed_time_ms_{forward, backward,
  backward_inner, backward_allreduce, step}``.
- with ``wall_clock_breakdown``, a second line after each step line:
  ``time (ms) | forward: 12.10 | backward: 25.31 | reduce: 3.02 | step: 4.50``.

What the numbers mean:

- loss: the loss given to ``engine.backward`` (before the 1/gradient_accumulation_steps and
  loss-scale factors), averaged over the micro-steps of the optimizer step. The printed loss is
  also averaged over the data-parallel ranks: one all-reduce of one number, on print steps only.
  Whether a step prints is decided from ``global_steps``, so every rank joins that all-reduce.
  The ``train_loss`` event is rank 0's own mean (no collective on other steps), as in DeepSpeed.
- step time: wall time from the end of the previous boundary step to the end of this one
  (forward, backward and step of all its micro-steps, plus whatever the loop does between them,
  e.g. loading data). The first step, and the first after `restart_window`, starts at the first
  forward or backward instead. On CUDA the device is synchronized before the clock is read.
  The printed step time is the mean over the steps since the previous line; samples/s =
  train_batch_size / step time (the whole job's throughput); tokens/s = samples/s x tokens per
  sample, which the engine only knows when told (``engine.set_tokens_per_sample(seq_len)``):
  guessing it from an input tensor's shape would be wrong for padded, packed or non-text inputs.
- wall-clock breakdown, in milliseconds per optimizer step (summed over its micro-steps;
  printed as the mean over the steps since the previous line, written per step):
  ``forward`` is ``Engine.forward`` with gradients enabled (evaluation under ``torch.no_grad()``
  is not timed); ``backward`` is ``engine.backward`` up to the end of autograd; ``reduce`` is
  the ZeRO strategy's end-of-backward reduction (``zero.end_backward``: launching the buckets not
  yet launched and waiting for those in flight); ``step`` is the boundary ``engine.step``
  (unscale, overflow check, gradient norm and clipping, optimizer, lr schedule, ZeRO all-gather).
  As in DeepSpeed, bucket reductions that start inside backward hooks and are waited for there
  (``overlap_comm: false``) count in ``backward``. The monitor events use DeepSpeed's names:
  ``backward_inner`` = backward, ``backward_allreduce`` = reduce, ``backward`` = their sum.

Flops profiler (``flops_profiler`` section, DeepSpeed's keys): on global rank 0, the optimizer
step that starts when ``global_steps == profile_step`` is profiled with
`tachyon.profiling.FlopsProfiler` (``count_backward=True``): counting starts at the step's first
training forward and covers the forward and backward of all its micro-batches (a loss computed
outside the model shows as "outside the model"), and stops when the boundary ``step`` begins.
After the step the profile (measured forward and backward FLOPs, fwd / bwd / step / iteration
latency, FLOP/s and MFU, the module tree) goes to the printer (standard output), or is written
to ``output_file``. CUDA is
synchronized around each module's forward and each phase of that step only. Training is not
otherwise changed.

Events are keyed by the global sample count after the step (``global_steps *
train_batch_size``), DeepSpeed's x-axis; unlike DeepSpeed (which writes ``train_loss`` before
the count is advanced) all events of one step share that key.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from tachyon.config import TachyonConfig
from tachyon.parallel.distributed import get_rank

from .monitor import Event, Monitor, WallClockTimers, format_breakdown_line, format_step_line

__all__ = ["PHASES", "EngineTelemetry", "StepStats", "format_breakdown_line"]

PHASES = ("forward", "backward", "reduce", "step")
"""The wall-clock breakdown's phases, in the order they are printed."""


@dataclass
class StepStats:
    """What `EngineTelemetry` measured for one optimizer step (``engine.telemetry.last_step``).

    ``loss``: this rank's mean loss over the step's micro-steps (0-dim fp32 tensor on the
    engine's device; None when no backward ran); ``global_loss``: that mean averaged over the
    data-parallel ranks, computed on print steps only (else None); ``step_time_s``,
    ``samples_per_s``, ``tokens_per_s``: this step alone (not the print-window means);
    ``breakdown_ms``: milliseconds per phase of this step (empty without wall_clock_breakdown).
    """

    step: int
    samples: int
    loss: torch.Tensor | None
    step_time_s: float
    samples_per_s: float | None
    tokens_per_s: float | None
    global_loss: float | None = None
    printed: bool = False
    breakdown_ms: dict[str, float] = field(default_factory=dict)


def _print_flush(line: str) -> None:
    print(line, flush=True)


class EngineTelemetry:
    """The engine's step line, monitor events and wall-clock breakdown (module docstring).

    Args:
        config: the engine's `TachyonConfig` (steps_per_print, wall_clock_breakdown,
            tensorboard, csv_monitor, train_batch_size, fp16).
        comm: the data-parallel collectives (`tachyon.engine.zero.DataParallelComm`), for the
            loss average on print steps.
        device: the engine's device (CUDA: synchronize before reading the clock).
        rank: the global rank (default: torch.distributed's, 0 without a process group);
            only rank 0 prints and writes events.
        printer: called with each line on rank 0 (default: ``print(line, flush=True)``);
            ``tachyon train`` sets its progress bar's ``write`` here.
        clock: seconds, monotonic (tests pass a fake one).

    Raises ImportError (naming the extra) when ``tensorboard.enabled`` and TensorBoard is missing.
    """

    def __init__(self, config: TachyonConfig, comm: Any, device: torch.device, *, rank: int | None = None,
                 printer: Callable[[str], None] | None = None, clock: Callable[[], float] = time.perf_counter):
        self.steps_per_print = config.steps_per_print
        self.train_batch_size = config.train_batch_size
        self.show_loss_scale = config.precision == "fp16"
        self.comm = comm
        self.device = torch.device(device)
        self.rank = get_rank() if rank is None else rank
        self.printer = printer or _print_flush
        self.clock = clock
        self.monitor = Monitor(config, self.rank)
        self.timers: WallClockTimers | None = None
        if config.wall_clock_breakdown:
            self.timers = WallClockTimers(synchronize=self.device.type == "cuda", clock=clock)
        self.tokens_per_sample: int | None = None
        self.last_step: StepStats | None = None
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._step_start: float | None = None
        self._window_time = 0.0
        self._window_steps = 0
        self._window_ms = dict.fromkeys(PHASES, 0.0)
        self.flops_config = config.flops_profiler
        self._model: torch.nn.Module | None = None
        self._engine: Any = None
        self.profiler: Any = None
        """The `FlopsProfiler` of the profiled step while it runs (rank 0, flops_profiler on)."""
        self.profile_written = False
        self.flops_profile: dict[str, Any] | None = None
        """The profiled step's totals once written: fwd_flops, fwd_macs, bwd_flops, bwd_macs,
        outside_flops (forward ops outside the model), params, and the StepTimings."""
        self._profile_start = 0.0
        self._profile_ms = dict.fromkeys(PHASES, 0.0)

    # ------------------------------------------------------------------ called by the engine
    def attach_model(self, model: torch.nn.Module, engine: Any = None) -> None:
        """The model the flops profiler profiles, and the engine it reports batch sizes from."""
        self._model, self._engine = model, engine

    def begin_forward(self, global_steps: int, first_micro_step: bool) -> None:
        """Called at each engine forward: starts the flops profile on the first training forward
        of step ``flops_profiler.profile_step`` (rank 0)."""
        cfg = self.flops_config
        if (not cfg.enabled or self.rank != 0 or self.profiler is not None or self.profile_written
                or self._model is None or global_steps != cfg.profile_step or not first_micro_step
                or not torch.is_grad_enabled()):
            return
        from tachyon.profiling import FlopsProfiler

        self._sync()
        self._profile_start = self.clock()
        self._profile_ms = dict.fromkeys(PHASES, 0.0)
        self.profiler = FlopsProfiler(self._model, ds_engine=self._engine,
                                      recompute_fwd_factor=cfg.recompute_fwd_factor, count_backward=True)
        self.profiler.start_profile()

    def set_tokens_per_sample(self, tokens: int | None) -> None:
        """Tokens in one sample (the sequence length), for tokens/s; None turns tokens/s off."""
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise ValueError(f"tokens_per_sample must be an int >= 1 or None; got {tokens!r}")
        self.tokens_per_sample = tokens

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time ``name`` (one of `PHASES`) when wall_clock_breakdown is on; any phase also marks
        the start of the step's wall time if it has not started yet."""
        if self._step_start is None:
            self._step_start = self.clock()
        profiling, start = self.profiler is not None, 0.0
        if profiling:
            if name == "step" and self.profiler.started:
                self.profiler.stop_profile()  # the optimizer step is not model work
            self._sync()
            start = self.clock()
        try:
            yield from self._timed(name)
        finally:
            if profiling:
                self._sync()
                self._profile_ms[name] += 1e3 * (self.clock() - start)

    def _timed(self, name: str) -> Iterator[None]:
        if self.timers is None:
            yield
            return
        timer = self.timers(name)
        timer.start()
        try:
            yield
        finally:
            timer.stop()

    def forward_phase(self):
        """`phase` ("forward") for training forwards; a no-op context under torch.no_grad()."""
        return self.phase("forward") if torch.is_grad_enabled() else nullcontext()

    def record_loss(self, loss: torch.Tensor) -> None:
        """Add one micro-step's (unscaled) loss to the step's mean; no host sync."""
        value = loss.detach().float().reshape(())
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._loss_count += 1

    def restart_window(self) -> None:
        """Start the next step's wall time at its first forward/backward, not now: call after
        work between steps that should not count as training (evaluation, checkpoint saving)."""
        self._step_start = None

    def end_step(self, step: int, *, lr: Sequence[float], grad_norm: torch.Tensor | None,
                 loss_scale: float, skipped_steps: int) -> StepStats:
        """Called by the engine after each boundary step; ``step`` is the new ``global_steps``.
        Writes this step's events and, on print steps, prints (rank 0). Collective on print
        steps: every data-parallel rank must call it for the same steps."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = self.clock()
        step_time = now - (self._step_start if self._step_start is not None else now)
        self._step_start = now
        loss = None if self._loss_sum is None else self._loss_sum / self._loss_count
        self._loss_sum, self._loss_count = None, 0
        stats = StepStats(step=step, samples=step * self.train_batch_size, loss=loss, step_time_s=step_time,
                          samples_per_s=self._samples_per_s(step_time), tokens_per_s=None,
                          breakdown_ms=self._collect_breakdown())
        stats.tokens_per_s = self._tokens_per_s(stats.samples_per_s)
        self._window_time += step_time
        self._window_steps += 1
        self._write_events(stats, lr, loss_scale)
        if step % self.steps_per_print == 0:
            stats.global_loss = self._mean_over_ranks(loss)
            stats.printed = True
            self._print(stats, lr, grad_norm, loss_scale, skipped_steps)
        self.last_step = stats
        if self.profiler is not None:
            self._write_profile(step - 1, now)
        return stats

    def close(self) -> None:
        """Close the monitor's writers (later events are dropped); drop an unfinished profile."""
        self.monitor.close()
        if self.profiler is not None:
            self.profiler.end_profile()
            self.profiler = None

    # ------------------------------------------------------------------ internals
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _write_profile(self, profile_step: int, now: float) -> None:
        """End the flops profile of the step that just finished and print / write it."""
        from tachyon.profiling.flops import StepTimings

        prof, self.profiler = self.profiler, None
        prof.stop_profile()
        ms = self._profile_ms
        world = self.comm.world_size
        prof.step_timings = StepTimings(
            backward_s=(ms["backward"] + ms["reduce"]) / 1e3, step_s=ms["step"] / 1e3,
            iteration_s=now - self._profile_start,
            samples=self.train_batch_size // world, world_size=world,
        )
        cfg = self.flops_config
        if cfg.output_file is None:  # through the printer (tachyon train writes above its progress bar)
            from tachyon.profiling.report import format_profile

            self.printer(format_profile(prof, profile_step=profile_step, module_depth=cfg.module_depth,
                                        top_modules=cfg.top_modules, detailed=cfg.detailed))
        else:
            prof.print_model_profile(profile_step=profile_step, module_depth=cfg.module_depth,
                                     top_modules=cfg.top_modules, detailed=cfg.detailed, output_file=cfg.output_file)
        self.flops_profile = {
            "step": profile_step, "fwd_flops": prof.get_total_flops(), "fwd_macs": prof.get_total_macs(),
            "bwd_flops": prof.get_total_backward_flops(), "bwd_macs": prof.get_total_backward_macs(),
            "outside_flops": prof.outside_flops, "params": prof.get_total_params(), "timings": prof.step_timings,
        }
        prof.end_profile()
        self.last_profiler = prof  # engine.flops_profiler after the profiled step (its flops / macs / params)
        self.profile_written = True

    def _samples_per_s(self, step_time: float) -> float | None:
        return self.train_batch_size / step_time if step_time > 0 else None

    def _tokens_per_s(self, samples_per_s: float | None) -> float | None:
        if samples_per_s is None or self.tokens_per_sample is None:
            return None
        return samples_per_s * self.tokens_per_sample

    def _collect_breakdown(self) -> dict[str, float]:
        """This step's ms per phase (sum over its micro-steps); clears the timers."""
        if self.timers is None:
            return {}
        out = {}
        for name in PHASES:
            timer = self.timers(name)
            out[name] = 1e3 * sum(timer.intervals)
            timer.intervals.clear()
            self._window_ms[name] += out[name]
        return out

    def _mean_over_ranks(self, loss: torch.Tensor | None) -> float:
        value = torch.full((1,), math.nan, dtype=torch.float32, device=self.device) if loss is None else (
            loss.reshape(1).to(device=self.device, dtype=torch.float32, copy=True))
        if self.comm.world_size > 1:
            self.comm.all_reduce(value)
            value /= self.comm.world_size
        return float(value.item())

    def _write_events(self, stats: StepStats, lr: Sequence[float], loss_scale: float) -> None:
        if not self.monitor.enabled:
            return
        samples = stats.samples
        events: list[Event] = []
        if stats.loss is not None:
            events.append(("Train/Samples/train_loss", stats.loss, samples))
        if lr:
            events.append(("Train/Samples/lr", float(lr[0]), samples))
        if self.show_loss_scale:
            events.append(("Train/Samples/loss_scale", float(loss_scale), samples))
        if stats.breakdown_ms:
            ms = stats.breakdown_ms
            events += [
                ("Train/Samples/elapsed_time_ms_forward", ms["forward"], samples),
                ("Train/Samples/elapsed_time_ms_backward", ms["backward"] + ms["reduce"], samples),
                ("Train/Samples/elapsed_time_ms_backward_inner", ms["backward"], samples),
                ("Train/Samples/elapsed_time_ms_backward_allreduce", ms["reduce"], samples),
                ("Train/Samples/elapsed_time_ms_step", ms["step"], samples),
            ]
        self.monitor.write_events(events)

    def _print(self, stats: StepStats, lr: Sequence[float], grad_norm: torch.Tensor | None, loss_scale: float,
               skipped_steps: int) -> None:
        step_time = self._window_time / self._window_steps
        samples_per_s = self._samples_per_s(step_time)
        lines = [format_step_line(
            stats.step, loss=stats.global_loss, lr=list(lr), grad_norm=grad_norm,
            loss_scale=float(loss_scale) if self.show_loss_scale else None, skipped_steps=skipped_steps,
            samples_per_s=samples_per_s, tokens_per_s=self._tokens_per_s(samples_per_s), step_time_s=step_time,
        )]
        if self.timers is not None:
            lines.append(format_breakdown_line({n: v / self._window_steps for n, v in self._window_ms.items()}))
        self._window_time, self._window_steps = 0.0, 0
        self._window_ms = dict.fromkeys(PHASES, 0.0)
        if self.rank == 0:
            for line in lines:
                self.printer(line)

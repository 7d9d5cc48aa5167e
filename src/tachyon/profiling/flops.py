"""The flops profiler: FLOPs, MACs, parameters and forward latency of every module of a model,
with DeepSpeed's API (``deepspeed.profiling.flops_profiler``).

    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x)
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    prof.print_model_profile(module_depth=2, top_modules=3)
    prof.end_profile()

    flops, macs, params = get_model_profile(model, input_shape=(8, 128), print_profile=False)

How counting works. DeepSpeed patches ``torch.nn.functional`` and torch functions, so it misses
whatever a model computes another way (custom ops, Tensor methods it did not patch, CPU
attention kernels). tachyon counts below all of that, at the dispatcher: a
``TorchDispatchMode`` (`tachyon.profiling.counting`) sees every ATen op and tachyon custom op
that runs and counts it with torch.utils.flop_counter's GEMM formulas plus the rules it lacks
(attention on every backend with causal masks, norms, activations, elementwise ops, tachyon's
ops). Module attribution and latency come from forward hooks on the model's modules: an op
counts toward every module whose forward is running, so a module's numbers include its
children's; latency is wall time between a module's forward pre- and post-hook (CUDA is
synchronized at both, which slows the profiled forward).

Forward vs backward. ``get_total_flops`` / ``get_total_macs`` are the model's forward, summed
over every forward run while profiling (DeepSpeed's meaning). With ``count_backward=True`` the
ops autograd runs for the backward (gradient formulas and activation-checkpoint recomputation,
not gradient hooks such as ZeRO's reductions) are counted too, as totals
(``get_total_backward_flops``; not per module). Forward ops outside the model's forward (a loss
computed in the training loop) are reported apart and not in the totals.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .counting import CountingMode, in_backward
from .report import format_profile, macs_to_string, number_to_string, params_to_string, duration_to_string

__all__ = ["FlopsProfiler", "ModuleStats", "StepTimings", "get_model_profile"]


@dataclasses.dataclass
class ModuleStats:
    """One module's forward numbers while profiling (its children included)."""

    flops: int = 0
    macs: int = 0
    duration: float = 0.0
    """Seconds in forward, summed over calls."""
    calls: int = 0


@dataclasses.dataclass
class StepTimings:
    """Wall times of a profiled training step, set by the engine (`tachyon.engine.telemetry`)."""

    backward_s: float
    step_s: float
    iteration_s: float
    samples: int
    world_size: int = 1


_WARMED_UP = []


def _warm_up_dispatch() -> None:
    """Run one op under a dispatch mode once per process: the first one imports torch._dynamo
    (about 2 s), which must not land in the first profiled module's latency."""
    if not _WARMED_UP:
        with CountingMode(lambda *args: None):
            torch.ones(1).add(1)
        _WARMED_UP.append(True)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class FlopsProfiler:
    """Measures one model's FLOPs, MACs, parameters and forward latency per module.

    Args:
        model: the torch.nn.Module to profile.
        ds_engine: the training engine driving the model (DeepSpeed's argument), or None; the
            printed profile then adds the data-parallel size and the engine's batch sizes.
        recompute_fwd_factor: DeepSpeed's estimate of activation recomputation in backward, as
            a fraction of the forward: used for the backward FLOPs only when they were not
            counted (backward = (2 + factor) x forward).
        count_backward: also count the backward's FLOPs and MACs (see the module docstring).
        peak_flops: the FLOP/s that MFU is computed against; None: `tachyon.profiling.peaks`
            (datasheet for H100 / H200 / A100, else a measured matmul rate).
    """

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0, *,
                 count_backward: bool = False, peak_flops: float | None = None):
        if not isinstance(model, nn.Module):
            raise ValueError(f"FlopsProfiler: model must be a torch.nn.Module; got {type(model).__name__}")
        if isinstance(recompute_fwd_factor, bool) or not isinstance(recompute_fwd_factor, (int, float)) \
                or not recompute_fwd_factor >= 0:
            raise ValueError(f"FlopsProfiler: recompute_fwd_factor must be a number >= 0; got {recompute_fwd_factor!r}")
        if peak_flops is not None and (isinstance(peak_flops, bool) or not isinstance(peak_flops, (int, float))
                                       or not peak_flops > 0):
            raise ValueError(f"FlopsProfiler: peak_flops must be a positive number of FLOP/s or None; got {peak_flops!r}")
        self.model, self.ds_engine = model, ds_engine
        self.recompute_fwd_factor = float(recompute_fwd_factor)
        self.count_backward = bool(count_backward)
        self.peak_flops = peak_flops
        self.started = False
        self.step_timings: StepTimings | None = None
        self._mode: CountingMode | None = None
        self._handles: list[Any] = []
        self._stack: list[tuple[nn.Module, float]] = []
        self.flops = self.macs = self.params = 0
        """The totals when profiling last stopped (DeepSpeed's attributes; they outlive end_profile)."""
        self.reset_profile()

    # ------------------------------------------------------------------ DeepSpeed's API
    def start_profile(self, ignore_list: Sequence[type[nn.Module]] | None = None) -> None:
        """Start counting: hook every module (except instances of the types in ``ignore_list``,
        whose numbers then count toward their parent) and enter the counting mode. Counts start
        from zero."""
        if self.started:
            raise RuntimeError("FlopsProfiler: the profile is already started; call stop_profile() or end_profile() first")
        ignored = tuple(ignore_list or ())
        for kind in ignored:
            if not (isinstance(kind, type) and issubclass(kind, nn.Module)):
                raise ValueError(f"FlopsProfiler: ignore_list must hold nn.Module subclasses; got {kind!r}")
        _warm_up_dispatch()
        self.stats = {}
        self.reset_profile()
        seen: set[int] = set()
        for module in self.model.modules():
            if id(module) in seen or (ignored and isinstance(module, ignored)):
                continue
            seen.add(id(module))
            self.stats[module] = ModuleStats()
            self._handles.append(module.register_forward_pre_hook(self._pre_hook))
            self._handles.append(module.register_forward_hook(self._post_hook, always_call=True))
        self._mode = CountingMode(self._record, count_backward=self.count_backward)
        self._mode.__enter__()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting and remove the hooks; the numbers stay readable (and are kept in
        ``flops`` / ``macs`` / ``params``)."""
        if self.started:
            self.flops, self.macs, self.params = self.get_total_flops(), self.get_total_macs(), self.get_total_params()
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles, self._stack = [], []
        self.started = False

    def reset_profile(self) -> None:
        """Zero every count and latency (the hooks stay)."""
        self.stats: dict[nn.Module, ModuleStats] = {m: ModuleStats() for m in getattr(self, "stats", {})}
        self.backward_flops = self.backward_macs = 0
        self.outside_flops = self.outside_macs = 0
        self.op_flops: dict[tuple[str, str], int] = defaultdict(int)
        """(op name, "fwd" | "bwd" | "outside") -> FLOPs."""

    def end_profile(self) -> None:
        """Stop (if needed) and drop everything recorded."""
        self.stop_profile()
        self.stats = {}
        self.reset_profile()
        self.step_timings = None

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """The model's forward FLOPs (every forward since start_profile)."""
        flops = self._root().flops
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        macs = self._root().macs
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Seconds the model's forward took (summed over forwards)."""
        duration = self._root().duration
        return duration_to_string(duration) if as_string else duration

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Trainable parameters of the model (DeepSpeed counts ``requires_grad`` ones)."""
        params = count_params(self.model)
        return params_to_string(params) if as_string else params

    def get_total_backward_flops(self, as_string: bool = False) -> int | str:
        """Counted backward FLOPs (0 unless ``count_backward``)."""
        return number_to_string(self.backward_flops) if as_string else self.backward_flops

    def get_total_backward_macs(self, as_string: bool = False) -> int | str:
        return macs_to_string(self.backward_macs) if as_string else self.backward_macs

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> None:
        """Print the profile (summary, top modules per depth, the module tree) to standard output,
        or write it to ``output_file``."""
        _check_depth_and_top(module_depth, top_modules)
        text = format_profile(self, profile_step=profile_step, module_depth=module_depth, top_modules=top_modules,
                              detailed=detailed)
        if output_file is None:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
        else:
            with open(output_file, "w", encoding="utf-8") as handle:
                handle.write(text + "\n")

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """Print only the top modules per depth."""
        _check_depth_and_top(module_depth, top_modules)
        from .report import format_aggregated

        sys.stdout.write(format_aggregated(self, module_depth, top_modules) + "\n")

    # ------------------------------------------------------------------ what the report reads
    def module_stats(self, module: nn.Module) -> ModuleStats | None:
        return self.stats.get(module)

    # ------------------------------------------------------------------ internals
    def _root(self) -> ModuleStats:
        return self.stats.get(self.model) or ModuleStats()

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        if in_backward():  # an activation-checkpoint recompute: backward work, not a forward
            return
        _sync()
        self._stack.append((module, time.perf_counter()))

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if in_backward() or not self._stack or self._stack[-1][0] is not module:
            return
        _sync()
        _, start = self._stack.pop()
        stats = self.stats[module]
        stats.duration += time.perf_counter() - start
        stats.calls += 1

    def _record(self, op: str, flops: int, macs: int, backward: bool) -> None:
        if backward:
            self.backward_flops += flops
            self.backward_macs += macs
            self.op_flops[(op, "bwd")] += flops
            return
        if not self._stack:
            self.outside_flops += flops
            self.outside_macs += macs
            self.op_flops[(op, "outside")] += flops
            return
        self.op_flops[(op, "fwd")] += flops
        for module in {id(m): m for m, _ in self._stack}.values():
            stats = self.stats[module]
            stats.flops += flops
            stats.macs += macs


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _check_depth_and_top(module_depth: int, top_modules: int) -> None:
    if isinstance(module_depth, bool) or not isinstance(module_depth, int) or module_depth < -1:
        raise ValueError(f"module_depth must be an int >= -1 (-1: every depth); got {module_depth!r}")
    if isinstance(top_modules, bool) or not isinstance(top_modules, int) or top_modules < 1:
        raise ValueError(f"top_modules must be an int >= 1; got {top_modules!r}")


def _dummy_input(model: nn.Module, input_shape: Iterable[int]) -> torch.Tensor:
    """DeepSpeed's input for ``input_shape``: an uninitialized tensor in the model's parameter
    dtype and device (fp32 on CPU for a model without parameters)."""
    shape = tuple(input_shape)
    if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"get_model_profile: input_shape must be a tuple of positive ints; got {input_shape!r}")
    param = next(model.parameters(), None)
    if param is None:
        return torch.empty(shape)
    return torch.empty(shape, dtype=param.dtype, device=param.device)


def get_model_profile(model: nn.Module, input_shape: Iterable[int] | None = None, args: Sequence[Any] = [],  # noqa: B006
                      kwargs: dict[str, Any] = {}, print_profile: bool = True, detailed: bool = True,  # noqa: B006
                      module_depth: int = -1, top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: str | None = None, ignore_modules: Sequence[type[nn.Module]] | None = None):
    """Profile one forward of ``model`` (DeepSpeed's function, same arguments and return value).

    The forward runs on ``args`` / ``kwargs``, or with ``input_shape`` on one uninitialized
    tensor of that shape in the model's dtype and device (as DeepSpeed does; pass real inputs
    for models that index with them, e.g. token ids). ``warm_up`` forwards run first, unprofiled.
    Returns ``(flops, macs, params)`` of the profiled forward: strings such as ``"6.28 G"``,
    ``"3.14 GMACs"``, ``"110.1 M"`` when ``as_string``, else ints.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"get_model_profile: model must be a torch.nn.Module; got {type(model).__name__}")
    if isinstance(warm_up, bool) or not isinstance(warm_up, int) or warm_up < 0:
        raise ValueError(f"get_model_profile: warm_up must be an int >= 0; got {warm_up!r}")
    _check_depth_and_top(module_depth, top_modules)
    args, kwargs = list(args), dict(kwargs)
    if input_shape is not None:
        if args:
            raise ValueError("get_model_profile: give input_shape or args, not both")
        args = [_dummy_input(model, input_shape)]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, or args and/or kwargs for the forward")
    for _ in range(warm_up):
        model(*args, **kwargs)
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=ignore_modules)
    try:
        model(*args, **kwargs)
    finally:
        prof.stop_profile()
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                 detailed=detailed, output_file=output_file)
    prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params

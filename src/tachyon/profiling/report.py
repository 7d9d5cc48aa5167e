"""The printed flops profile: summary, top modules per depth, the module tree (DeepSpeed's layout).

Numbers are written as DeepSpeed writes them (``number_to_string`` and friends: 3 significant
digits with a K / M / G / T unit), so scripts that parse DeepSpeed's strings keep working.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

from torch import nn

from .peaks import peak_flops

if TYPE_CHECKING:
    from .flops import FlopsProfiler

PRECISION = 2
_UNITS = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def number_to_string(num: float, units: str | None = None, precision: int = PRECISION) -> str:
    """``6.28 G``, ``512 K``, ``3.1 m`` (DeepSpeed's format); ``units`` forces one unit."""
    if units is None:
        magnitude, units = 1.0, ""
        for value, unit in _UNITS:
            if abs(num) >= value:
                magnitude, units = value, unit
                break
        else:
            if 0 < abs(num) < 1e-3:
                magnitude, units = 1e-6, "u"
            elif 0 < abs(num) < 1:
                magnitude, units = 1e-3, "m"
    else:
        magnitude = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "": 1.0, "m": 1e-3, "u": 1e-6}[units]
    return f"{round(num / magnitude, precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = PRECISION) -> str:
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = PRECISION) -> str:
    """A rate: ``81.9 TFLOPS`` (DeepSpeed's spelling for FLOP/s)."""
    return f"{number_to_string(flops, units, precision)}FLOPS"


def params_to_string(params: float, units: str | None = None, precision: int = PRECISION) -> str:
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = PRECISION) -> str:
    return f"{number_to_string(seconds, units, precision)}s"


def _percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.2f}%" if whole else "0.00%"


def _data_parallel_size(engine: Any) -> int:
    """The engine's data-parallel size: ``dp_world_size``, else (DeepSpeed with Ulysses sequence
    parallelism reports None there) ``seq_dp_world_size``, else tachyon's ``data_parallel_world_size``."""
    for name in ("dp_world_size", "seq_dp_world_size", "data_parallel_world_size"):
        value = getattr(engine, name, None)
        if value is not None:
            return value
    return 1


def _rate(flops: float, seconds: float) -> str:
    return flops_to_string(flops / seconds) if seconds > 0 else "n/a"


def _model_dtype_device(model: nn.Module):
    param = next(model.parameters(), None)
    if param is None:
        return None, None
    return param.dtype, param.device


def _summary(prof: FlopsProfiler, profile_step: int) -> list[str]:
    from .flops import count_params

    root = prof.module_stats(prof.model)
    fwd_flops = root.flops if root else 0
    fwd_macs = root.macs if root else 0
    fwd_s = root.duration if root else 0.0
    lines = [f"Profile summary at step {profile_step}:", "Notations: params (parameters), MACs "
             "(multiply-accumulate operations), FLOPs (floating-point operations), FLOPS (FLOPs per second), "
             "MFU (achieved FLOPS / peak FLOPS)", ""]
    rows: list[tuple[str, str]] = []
    timings, engine = prof.step_timings, prof.ds_engine
    if engine is not None:
        rows += [("data parallel size", str(_data_parallel_size(engine))),
                 ("micro batch size per rank", str(engine.train_micro_batch_size_per_gpu()))]
        if hasattr(engine, "gradient_accumulation_steps"):
            rows.append(("gradient accumulation steps", str(engine.gradient_accumulation_steps())))
    rows += [("params per rank", params_to_string(count_params(prof.model))),
             ("fwd MACs per rank", macs_to_string(fwd_macs)),
             ("fwd FLOPs per rank", number_to_string(fwd_flops)),
             ("fwd latency", duration_to_string(fwd_s)),
             ("fwd FLOPS per rank", _rate(fwd_flops, fwd_s))]
    if prof.outside_flops:
        rows.append(("fwd FLOPs outside the model (e.g. the loss)", number_to_string(prof.outside_flops)))
    if prof.count_backward:
        bwd_flops, how = prof.backward_flops, "counted"
    else:
        bwd_flops, how = int((2.0 + prof.recompute_fwd_factor) * fwd_flops), (
            f"estimated: {2.0 + prof.recompute_fwd_factor:g} x fwd")
    rows.append((f"bwd FLOPs per rank ({how})", number_to_string(bwd_flops)))
    if prof.count_backward:
        rows.append(("bwd MACs per rank (counted)", macs_to_string(prof.backward_macs)))
    total_flops, total_s = fwd_flops, fwd_s
    if timings is not None:
        total_flops = fwd_flops + bwd_flops + prof.outside_flops
        total_s = timings.iteration_s
        rows += [("bwd latency", duration_to_string(timings.backward_s)),
                 ("bwd FLOPS per rank", _rate(bwd_flops, timings.backward_s)),
                 ("step latency", duration_to_string(timings.step_s)),
                 ("iter latency", duration_to_string(timings.iteration_s)),
                 ("FLOPS per rank (fwd + bwd over iter latency)", _rate(total_flops, total_s)),
                 ("samples/second", f"{timings.samples * timings.world_size / total_s:.2f}" if total_s > 0 else "n/a")]
    dtype, device = _model_dtype_device(prof.model)
    if dtype is not None and total_s > 0:
        if prof.peak_flops is not None:
            peak, source = float(prof.peak_flops), "given"
        else:
            peak, source = peak_flops(device, dtype)
        rows += [(f"peak FLOPS ({source})", flops_to_string(peak)),
                 ("MFU", _percent(total_flops / total_s, peak))]
    width = max(len(name) for name, _ in rows) + 2
    lines += [f"{name + ':':<{width}}{value.strip()}" for name, value in rows]
    return lines


def _effective(prof: FlopsProfiler, module: nn.Module):
    """A module's stats, or for a container that was never called itself (nn.ModuleList,
    nn.ModuleDict) the sum of its children's, as DeepSpeed reports it. None: ignored."""
    from .flops import ModuleStats

    stats = prof.module_stats(module)
    if stats is None or stats.calls or not any(True for _ in module.children()):
        return stats
    total = ModuleStats()
    for child in module.children():
        part = _effective(prof, child)
        if part is not None:
            total.flops, total.macs, total.duration = total.flops + part.flops, total.macs + part.macs, (
                total.duration + part.duration)
    return total


def _walk(model: nn.Module):
    """(depth, name, module) for every module, depth-first, each module object once."""
    seen: set[int] = set()

    def visit(name: str, module: nn.Module, depth: int):
        if id(module) in seen:
            return
        seen.add(id(module))
        yield depth, name, module
        for child_name, child in module.named_children():
            yield from visit(child_name, child, depth + 1)

    yield from visit("", model, 0)


def format_aggregated(prof: FlopsProfiler, module_depth: int, top_modules: int) -> str:
    """DeepSpeed's "aggregated profile": per depth, the module classes with the most params, MACs
    and forward latency (modules of one class at one depth summed)."""
    from .flops import count_params

    by_depth: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0.0]))
    for depth, _name, module in _walk(prof.model):
        stats = _effective(prof, module)
        if stats is None:
            continue
        row = by_depth[depth][type(module).__name__]
        row[0] += count_params(module)
        row[1] += stats.macs
        row[2] += stats.duration
    deepest = max(by_depth, default=0)
    last = deepest if module_depth == -1 else min(module_depth, deepest)
    lines = ["Top modules in terms of params, MACs or fwd latency at different model depths:"]
    for depth in range(last + 1):
        rows = by_depth[depth]

        def top(index: int, fmt):
            ranked = sorted(rows.items(), key=lambda item: item[1][index], reverse=True)[:top_modules]
            return "{" + ", ".join(f"'{name}': '{fmt(values[index])}'" for name, values in ranked) + "}"

        lines += [f"depth {depth}:",
                  f"    params      - {top(0, params_to_string)}",
                  f"    MACs        - {top(1, macs_to_string)}",
                  f"    fwd latency - {top(2, duration_to_string)}"]
    return "\n".join(lines)


def _tree(prof: FlopsProfiler, module_depth: int) -> list[str]:
    from .flops import count_params

    root = prof.module_stats(prof.model)
    total_params = count_params(prof.model)
    total_macs = root.macs if root else 0
    total_flops = root.flops if root else 0
    total_s = root.duration if root else 0.0
    lines = []
    for depth, name, module in _walk(prof.model):
        if module_depth != -1 and depth > module_depth:
            continue
        stats = _effective(prof, module)
        indent = "  " * depth
        head = f"({name}): {type(module).__name__}" if name else type(module).__name__
        if stats is None:
            lines.append(f"{indent}{head} (ignored: counted in its parent)")
            continue
        params = count_params(module)
        lines.append(
            f"{indent}{head}: {params_to_string(params)} = {_percent(params, total_params)} params, "
            f"{macs_to_string(stats.macs)} = {_percent(stats.macs, total_macs)} MACs, "
            f"{number_to_string(stats.flops)}FLOPs = {_percent(stats.flops, total_flops)} FLOPs, "
            f"{duration_to_string(stats.duration)} = {_percent(stats.duration, total_s)} latency, "
            f"{_rate(stats.flops, stats.duration)}"
        )
    return lines


def _top_ops(prof: FlopsProfiler, count: int = 10) -> list[str]:
    ranked = sorted(prof.op_flops.items(), key=lambda item: item[1], reverse=True)[:count]
    total = sum(prof.op_flops.values())
    return [f"    {phase:<7} {op:<55} {number_to_string(flops)}FLOPs  {_percent(flops, total)}"
            for (op, phase), flops in ranked]


def format_profile(prof: FlopsProfiler, *, profile_step: int, module_depth: int, top_modules: int,
                   detailed: bool) -> str:
    """The whole printed profile."""
    rule = "-" * 30
    parts = [f"{rule} tachyon flops profiler {rule}", *_summary(prof, profile_step), "",
             f"{rule} Aggregated profile per rank {rule}", format_aggregated(prof, module_depth, top_modules)]
    if prof.op_flops:
        parts += ["", "Ops with the most FLOPs (fwd: in the model's forward, bwd: backward, outside: forward "
                      "ops outside the model):", *_top_ops(prof)]
    if detailed:
        parts += ["", f"{rule} Detailed profile per rank {rule}",
                  "Each module: params, % of total params, MACs, % of total MACs, FLOPs, % of total FLOPs, fwd "
                  "latency, % of total fwd latency, fwd FLOPS. A module's numbers include its children's; ops "
                  "a module runs itself (not through a child) make up the difference.",
                  "", *_tree(prof, module_depth)]
    parts.append("-" * (2 * len(rule) + len(" tachyon flops profiler ")))
    return "\n".join(parts)


__all__ = ["duration_to_string", "flops_to_string", "format_aggregated", "format_profile", "macs_to_string",
           "number_to_string", "params_to_string"]

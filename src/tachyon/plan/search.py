"""The layouts worth trying when the user leaves choices open, ranked.

Every choice left open (tp, pp, ZeRO stage, micro-batch, checkpointing) is enumerated over the
values that can work for the model: tp over the divisors of the GPU count up to a node that divide
heads, KV heads, FFN and sequence; pp over the divisors of the remaining GPUs up to the layer
count; ZeRO 0-2 (2 only without a pipeline); micro-batches of 1, 2, 4, ... 64 that divide the
global batch; checkpointing none / selective / full (bert: none / full). Layouts that fit in
memory come first, fastest (tokens/s) first; ties go to the smaller memory footprint.

Without ``global_batch`` each layout takes one micro-batch per step without a pipeline and
4 * pp with one (so a 1F1B bubble of (pp - 1) / (5 pp - 1)); rows show the resulting batch.
"""

from __future__ import annotations

import dataclasses

from tachyon.hardware import GPUSpec
from tachyon.plan.activations import CHECKPOINTING
from tachyon.plan.estimate import Assumptions, Estimate, estimate
from tachyon.plan.layout import Layout, check_layout
from tachyon.plan.model import ModelSpec, PlanError

MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
PIPELINE_MICRO_BATCHES_PER_STAGE = 4


@dataclasses.dataclass(frozen=True)
class Choices:
    """The user's choices; None = open (searched)."""

    tp: int | None = None
    pp: int | None = None
    zero: int | None = None
    micro_batch: int | None = None
    global_batch: int | None = None
    checkpointing: str | None = None
    dtype: str = "bf16"
    schedule: str = "1f1b"
    offload: bool = False

    @property
    def open(self) -> list[str]:
        return [k for k in ("tp", "pp", "zero", "micro_batch", "checkpointing") if getattr(self, k) is None]


def _grad_accum(global_batch: int | None, micro_batch: int, dp: int, pp: int) -> int | None:
    if global_batch is None:
        return 1 if pp == 1 else PIPELINE_MICRO_BATCHES_PER_STAGE * pp
    if global_batch % (micro_batch * dp):
        return None
    return global_batch // (micro_batch * dp)


def fixed_layout(spec: ModelSpec | None, gpus: int, gpu: GPUSpec, choices: Choices) -> Layout:
    """The one layout all choices name (every field given); PlanError when it cannot run."""
    check_choices(spec, gpus, gpu, choices)
    tp, pp = choices.tp, choices.pp
    dp = gpus // (tp * pp)
    gas = _grad_accum(choices.global_batch, choices.micro_batch, dp, pp)
    if gas is None:
        raise PlanError(f"global batch {choices.global_batch} is not a multiple of micro_batch * dp = "
                        f"{choices.micro_batch} * {dp} = {choices.micro_batch * dp}")
    layout = Layout(tp=tp, pp=pp, dp=dp, zero=choices.zero, micro_batch=choices.micro_batch, grad_accum=gas,
                    checkpointing=choices.checkpointing, dtype=choices.dtype, schedule=choices.schedule,
                    offload=choices.offload)
    check_layout(spec, layout, gpus, gpu.gpus_per_node)
    return layout


def candidate_layouts(spec: ModelSpec | None, gpus: int, gpu: GPUSpec, choices: Choices) -> list[Layout]:
    """Every layout the open choices allow that passes `check_layout`."""
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    if choices.tp is not None:
        tps = [choices.tp]
    elif spec is None:
        tps = [1]
    else:
        tps = [d for d in divisors if d <= gpu.gpus_per_node]
    out = []
    for tp in tps:
        if choices.pp is not None:
            pps = [choices.pp]
        elif spec is None:
            pps = [1]
        else:
            pps = [d for d in divisors if (gpus // tp) % d == 0 and d <= spec.layers and tp * d <= gpus]
        for pp in pps:
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            # searched: stages 0-2 (1-2 with offload); stage 3 when asked for
            searched = (1, 2) if choices.offload else (0, 1, 2)
            zeros = [choices.zero] if choices.zero is not None else [z for z in searched if pp == 1 or z < 2]
            mbs = [choices.micro_batch] if choices.micro_batch is not None else list(MICRO_BATCHES)
            if choices.checkpointing is not None:
                ckpts = [choices.checkpointing]
            elif spec is None:
                ckpts = ["none"]
            else:
                ckpts = [c for c in CHECKPOINTING if not (spec.family == "bert" and c == "selective")]
            for zero in zeros:
                for mb in mbs:
                    gas = _grad_accum(choices.global_batch, mb, dp, pp)
                    if gas is None:
                        continue
                    for ckpt in ckpts:
                        layout = Layout(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=mb, grad_accum=gas,
                                        checkpointing=ckpt, dtype=choices.dtype, schedule=choices.schedule,
                                        offload=choices.offload)
                        try:
                            check_layout(spec, layout, gpus, gpu.gpus_per_node)
                        except PlanError:
                            continue
                        out.append(layout)
    return out


def _rank_key(plan: Estimate) -> tuple:
    speed = plan.time["tokens_per_s"] if plan.time is not None else 0.0
    return (not plan.fits, -speed, plan.memory_per_gpu)


def check_choices(spec: ModelSpec | None, gpus: int, gpu: GPUSpec, choices: Choices) -> None:
    """Refuse the choices the user fixed, each on its own, with `check_layout`'s precise message
    (the open ones take values that cannot fail: tp = pp = 1, micro-batch 1, no checkpointing)."""
    tp, pp = choices.tp or 1, choices.pp or 1
    if gpus % (tp * pp):
        divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
        raise PlanError(f"tp * pp = {tp} * {pp} = {tp * pp} must divide the {gpus} GPUs; divisors of {gpus}: {divisors}")
    zero = choices.zero if choices.zero is not None else (1 if choices.offload else 0)
    probe = Layout(tp=tp, pp=pp, dp=gpus // (tp * pp), zero=zero,
                   micro_batch=choices.micro_batch or 1, checkpointing=choices.checkpointing or "none",
                   dtype=choices.dtype, schedule=choices.schedule, offload=choices.offload)
    check_layout(spec, probe, gpus, gpu.gpus_per_node)


def rank_layouts(spec: ModelSpec | None, gpus: int, gpu: GPUSpec, choices: Choices,
                 assumptions: Assumptions = Assumptions(), params: int | None = None) -> list[Estimate]:
    """Plans of every candidate layout, best first (fitting, then fastest, then smallest).
    PlanError naming the problem when a fixed choice, or every combination, is impossible."""
    check_choices(spec, gpus, gpu, choices)
    layouts = candidate_layouts(spec, gpus, gpu, choices)
    if not layouts:
        fixed = {k: getattr(choices, k) for k in ("tp", "pp", "zero", "micro_batch", "global_batch")
                 if getattr(choices, k) is not None}
        raise PlanError(f"no layout of {gpus} GPUs is possible with {fixed or 'these choices'}: check that tp "
                        "divides heads, KV heads, FFN and sequence, that pp <= layers, and that the global "
                        "batch is a multiple of micro_batch * dp")
    plans = [estimate(spec, layout, gpu, assumptions, params) for layout in layouts]
    return sorted(plans, key=_rank_key)


__all__ = ["MICRO_BATCHES", "Choices", "candidate_layouts", "check_choices", "fixed_layout", "rank_layouts"]

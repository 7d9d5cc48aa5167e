"""Text tables and JSON for `tachyon plan`."""

from __future__ import annotations

from typing import Any

from tachyon.hardware import GIB
from tachyon.plan.estimate import Estimate, human_bytes

_MEMORY_LABELS = {
    "parameters": "parameters", "gradients": "gradients", "master_weights": "fp32 master weights",
    "optimizer_states": "optimizer states", "activations": "activations", "logits": "logits (around the loss)",
    "largest_gradient": "largest gradient (transient)", "bucket_buffers": "ZeRO bucket buffers",
    "step_master_gradients": "fp32 gradients (at the step)", "gathered_layers": "ZeRO-3 gathered layers",
    "offloaded": "in host memory (offload)",
}


def _model_line(plan: Estimate) -> str:
    spec = plan.spec
    if spec is None:
        return f"a model of {plan.params:,} parameters (no architecture given)"
    heads = f"{spec.heads} heads" + (f" / {spec.num_kv_heads} KV heads" if spec.num_kv_heads != spec.heads else "")
    extra = ""
    if spec.family == "bert":
        flags = [f for f in ("normalize_invertible", "gelu_checkpoint", "attn_dropout_checkpoint") if getattr(spec, f)]
        extra = f", {'pre' if spec.pre_layer_norm else 'post'}-LN" + (f", {' + '.join(flags)}" if flags else "")
    return (f"{spec.name} ({spec.family}: {spec.layers} layers, hidden {spec.hidden}, {heads}, ffn {spec.ffn_size}, "
            f"seq {spec.seq}, vocab {spec.vocab}{extra}), {plan.params:,} parameters")


def _layout_line(plan: Estimate) -> str:
    lay = plan.layout
    batch = (f"micro-batch {lay.micro_batch} x {lay.grad_accum} accumulation x dp {lay.dp} = global batch "
             f"{lay.global_batch}")
    sched = f", {lay.schedule}" if lay.pp > 1 else ""
    offload = " + offload" if lay.offload else ""
    return (f"tp {lay.tp}, pp {lay.pp}, dp {lay.dp}, ZeRO-{lay.zero}{offload}, {batch}, checkpointing {lay.checkpointing}, "
            f"{lay.dtype}{sched}")


def format_plan(plan: Estimate) -> str:
    """The full report of one layout."""
    gpu, lay = plan.gpu, plan.layout
    stage = plan.binding_stage
    lines = [
        f"model:  {_model_line(plan)}",
        f"GPUs:   {lay.gpus} x {gpu.name} ({gpu.memory_bytes / GIB:.0f} GiB, "
        f"{plan.assumptions.reserve_bytes / GIB:.1f} GiB reserved for context and fragmentation)",
        f"layout: {_layout_line(plan)}",
        "",
        f"memory per GPU" + (f" (stage {stage.index} of {lay.pp}, the largest; {stage.layers} layers)" if lay.pp > 1
                             else ""),
    ]
    for key, label in _MEMORY_LABELS.items():
        if key in stage.memory and (stage.memory[key] or key in ("parameters", "activations")):
            detail = ""
            if key == "activations" and plan.spec is not None:
                detail = f"  ({stage.layers} layers x {lay.in_flight(stage.index)} micro-batch(es) in flight)"
            lines.append(f"  {label:<30} {human_bytes(stage.memory[key]):>12}{detail}")
    verdict = "fits" if plan.fits else f"DOES NOT FIT (over by {human_bytes(plan.memory_per_gpu - plan.usable_memory)})"
    lines.append(f"  {'total':<30} {human_bytes(stage.total):>12}  ({stage.total / 1e9:.1f} GB) of "
                 f"{human_bytes(plan.usable_memory)} usable: {verdict}")
    if plan.activation_items:
        lines += ["", "saved for backward per layer per token (bytes, per tp rank)"]
        lines += [f"  {k:<44} {v:>10.1f}" for k, v in plan.activation_items.items()]
        lines.append(f"  {'total':<44} {sum(plan.activation_items.values()):>10.1f}")
        modes = ", ".join(f"{mode} {human_bytes(n)}" for mode, n in plan.per_layer_by_checkpointing.items())
        lines.append(f"  one layer, one micro-batch, by checkpointing: {modes}")
    lines += ["", "communication per step, bytes each GPU sends"]
    for axis, parts in plan.communication.items():
        if parts["total"] or axis == "dp":
            detail = ", ".join(f"{k.replace('_', ' ')} {human_bytes(v)}" for k, v in parts.items() if k != "total" and v)
            lines.append(f"  {axis:<3} {human_bytes(parts['total']):>12}" + (f"  ({detail})" if detail else ""))
    if plan.time is not None:
        t, a = plan.time, plan.assumptions
        lines += [
            "",
            f"time per step (estimate: compute at {a.compute_efficiency:.0%} of peak, links at "
            f"{a.comm_efficiency:.0%} of bandwidth)",
            f"  pipeline {t['pipeline_s']:.3f} s (bubble {t['pipeline_bubble_s']:.3f} s), exposed dp communication "
            f"{t['dp_comm_exposed_s']:.3f} s, optimizer {t['optimizer_s']:.3f} s",
            f"  step {t['step_s']:.3f} s, {t['tokens_per_s']:,.0f} tokens/s, MFU {t['mfu']:.1%}",
        ]
    for note in plan.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def summary_row(rank: int, plan: Estimate) -> dict[str, Any]:
    """One ranked layout, for the table and the JSON list."""
    lay = plan.layout
    row: dict[str, Any] = {"rank": rank, **lay.to_dict(), "memory_per_gpu": plan.memory_per_gpu, "fits": plan.fits}
    if plan.time is not None:
        row.update(step_s=plan.time["step_s"], tokens_per_s=plan.time["tokens_per_s"], mfu=plan.time["mfu"])
    return row


def format_ranking(plans: list[Estimate], top: int) -> str:
    """The ranked table, then the best layout in full."""
    fitting = sum(p.fits for p in plans)
    header = f"{'rank':>4} {'tp':>3} {'pp':>3} {'dp':>5} {'zero':>4} {'mb':>3} {'gas':>4} {'ckpt':<9} " \
             f"{'memory/GPU':>11} {'fits':>4} {'step s':>8} {'tokens/s':>11} {'MFU':>6}"
    lines = [header]
    for i, plan in enumerate(plans[:top], 1):
        lay = plan.layout
        timing = (f"{plan.time['step_s']:>8.3f} {plan.time['tokens_per_s']:>11,.0f} {plan.time['mfu']:>6.1%}"
                  if plan.time is not None else f"{'-':>8} {'-':>11} {'-':>6}")
        lines.append(f"{i:>4} {lay.tp:>3} {lay.pp:>3} {lay.dp:>5} {lay.zero:>4} {lay.micro_batch:>3} "
                     f"{lay.grad_accum:>4} {lay.checkpointing:<9} {human_bytes(plan.memory_per_gpu):>11} "
                     f"{'yes' if plan.fits else 'no':>4} {timing}")
    lines.append(f"({len(plans)} layouts considered, {fitting} fit; showing {min(top, len(plans))})")
    if not fitting:
        smallest = min(plans, key=lambda p: p.memory_per_gpu)
        lines.append(f"nothing fits: the smallest needs {human_bytes(smallest.memory_per_gpu)} per GPU, "
                     f"{human_bytes(smallest.usable_memory)} are usable; add GPUs, or raise tp / pp / the ZeRO stage")
    lines += ["", "best layout:" if fitting else "smallest layout:", ""]
    best = plans[0] if fitting else min(plans, key=lambda p: p.memory_per_gpu)
    lines.append(format_plan(best))
    return "\n".join(lines)


def ranking_dict(plans: list[Estimate], top: int) -> dict[str, Any]:
    fitting = [p for p in plans if p.fits]
    best = fitting[0] if fitting else min(plans, key=lambda p: p.memory_per_gpu)
    return {
        "considered": len(plans),
        "fit": len(fitting),
        "layouts": [summary_row(i, p) for i, p in enumerate(plans[:top], 1)],
        "best": best.to_dict(),
    }


__all__ = ["format_plan", "format_ranking", "ranking_dict", "summary_row"]

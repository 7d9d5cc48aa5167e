"""``tachyon plan``: what fits, how it is split, how fast it will be, before renting the GPUs.

    tachyon plan --model llama-7b --gpus 64 --gpu h100 --global-batch 512
    tachyon plan --params 70e9 --layers 80 --hidden 8192 --heads 64 --kv-heads 8 --ffn 28672 \\
        --seq 4096 --vocab 128256 --family llama --gpus 1024 --tp 8 --pp 8 --zero 1 \\
        --micro-batch 1 --global-batch 1024 --checkpointing full --json

Choices left out (--tp, --pp, --zero, --micro-batch, --checkpointing) are searched and the
layouts ranked; with all of them given the one layout is reported in full. Exit status: 0 when
the plan (or the best ranked layout) fits, 1 when nothing fits, 2 for impossible input.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from tachyon.hardware import GIB, GPUS, get_gpu
from tachyon.plan.activations import CHECKPOINTING
from tachyon.plan.estimate import Assumptions, estimate
from tachyon.plan.layout import DTYPES, OPTIMIZERS, SCHEDULES
from tachyon.plan.model import FAMILIES, PRESETS, PlanError, resolve_model
from tachyon.plan.report import format_plan, format_ranking, ranking_dict
from tachyon.plan.search import Choices, fixed_layout, rank_layouts

HELP = "estimate memory, communication and step time of a training layout, and rank the layouts that fit"
_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def count(text: str) -> int:
    """'70e9', '7.5B', '1024', '350M' -> an integer >= 1 (argparse type)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", str(text))
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 70e9, 7.5B, 350M, 1024)")
    value = float(match.group(1)) * _SUFFIX[match.group(2).lower()]
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (a name, an HF config.json, or the sizes)")
    model.add_argument("--model", help=f"one of {', '.join(PRESETS)}, or a path to a Hugging Face config.json "
                       "(gpt2, llama, mistral, bert, roberta); sizes given below override it")
    model.add_argument("--family", choices=FAMILIES, help="layer family when giving sizes (default gpt)")
    model.add_argument("--params", type=count, help="parameter count for the model states (default: from the sizes)")
    model.add_argument("--layers", type=count)
    model.add_argument("--hidden", type=count)
    model.add_argument("--heads", type=count)
    model.add_argument("--kv-heads", type=count, help="key/value heads (grouped-query attention; default heads)")
    model.add_argument("--head-dim", type=count, help="default hidden / heads")
    model.add_argument("--ffn", type=count, help="FFN width (default 4 * hidden)")
    model.add_argument("--seq", type=count, help="training sequence length")
    model.add_argument("--vocab", type=count)
    model.add_argument("--tied-embeddings", action=argparse.BooleanOptionalAction, default=None,
                       help="the LM head shares the embedding (default: gpt/bert yes, llama no)")
    bert = parser.add_argument_group("bert family (TransformerKernelLayer) memory flags")
    bert.add_argument("--pre-layer-norm", action=argparse.BooleanOptionalAction, default=None)
    bert.add_argument("--normalize-invertible", action="store_true", default=None)
    bert.add_argument("--gelu-checkpoint", action="store_true", default=None)
    bert.add_argument("--attn-dropout-checkpoint", action="store_true", default=None)
    layout = parser.add_argument_group("layout (left out: searched)")
    layout.add_argument("--gpus", type=count, required=True, help="number of GPUs")
    layout.add_argument("--gpu", default="h100", help=f"one of {', '.join(GPUS)} (default h100)")
    layout.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (searched: 0-2)")
    layout.add_argument("--offload", action="store_true",
                        help="ZeRO-Offload: optimizer states, fp32 masters and gradient accumulator in host memory "
                             "(stages 1-3)")
    layout.add_argument("--tp", type=count, help="tensor-parallel size")
    layout.add_argument("--pp", type=count, help="pipeline stages")
    layout.add_argument("--micro-batch", type=count, help="sequences per GPU per forward")
    layout.add_argument("--global-batch", type=count, help="sequences per optimizer step")
    layout.add_argument("--checkpointing", choices=CHECKPOINTING, help="activation checkpointing")
    layout.add_argument("--dtype", choices=DTYPES, default="bf16")
    layout.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule")
    assume = parser.add_argument_group("assumptions")
    assume.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    assume.add_argument("--grad-accum-dtype", choices=("fp32", "fp16", "bf16"),
                        help="gradient accumulation dtype (default: fp32 for bf16/fp8/fp32, fp16 for fp16)")
    assume.add_argument("--overlap-comm", action="store_true", help="ZeRO's overlap_comm")
    assume.add_argument("--reduce-bucket-size", type=count, default=500_000_000, help="elements (default 5e8)")
    assume.add_argument("--compute-efficiency", type=float, default=0.6, help="fraction of peak FLOP/s (default 0.6)")
    assume.add_argument("--comm-efficiency", type=float, default=0.8, help="fraction of link bandwidth (default 0.8)")
    assume.add_argument("--reserve-gib", type=float, default=3.0, help="GiB per GPU not available to tensors (default 3)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of tables")
    out.add_argument("--top", type=count, default=10, help="ranked layouts to show (default 10)")


_ARCH_KEYS = ("layers", "hidden", "heads", "seq", "vocab")


def _spec(args: argparse.Namespace):
    fields = dict(family=args.family, layers=args.layers, hidden=args.hidden, heads=args.heads,
                  kv_heads=args.kv_heads, head_dim=args.head_dim, ffn=args.ffn, seq=args.seq, vocab=args.vocab,
                  tied_embeddings=args.tied_embeddings, pre_layer_norm=args.pre_layer_norm,
                  normalize_invertible=args.normalize_invertible, gelu_checkpoint=args.gelu_checkpoint,
                  attn_dropout_checkpoint=args.attn_dropout_checkpoint)
    if args.model is None and args.params is not None and all(fields[k] is None for k in _ARCH_KEYS):
        return None  # model states from the parameter count alone
    if args.model is None and fields["family"] == "llama" and fields["tied_embeddings"] is None:
        fields["tied_embeddings"] = False
    return resolve_model(args.model, **{k: v for k, v in fields.items() if v is not None})


def build(args: argparse.Namespace):
    """(spec, plans, ranked): the plan(s) the arguments ask for; PlanError for impossible input."""
    gpu = get_gpu(args.gpu)
    if args.dtype not in gpu.peak_flops_by_dtype:
        raise PlanError(f"--dtype {args.dtype} needs {args.dtype} tensor cores, which the {gpu.name} lacks; "
                        f"its dtypes: {sorted(d for d in gpu.peak_flops_by_dtype if d in DTYPES)}")
    spec = _spec(args)
    assumptions = Assumptions(
        compute_efficiency=args.compute_efficiency, comm_efficiency=args.comm_efficiency,
        reserve_bytes=int(args.reserve_gib * GIB), optimizer=args.optimizer, grad_accum_dtype=args.grad_accum_dtype,
        overlap_comm=args.overlap_comm, reduce_bucket_size=args.reduce_bucket_size,
    )
    choices = Choices(tp=args.tp, pp=args.pp, zero=args.zero, micro_batch=args.micro_batch,
                      global_batch=args.global_batch, checkpointing=args.checkpointing, dtype=args.dtype,
                      schedule=args.schedule, offload=args.offload)
    if spec is None:  # parameters only: no activations, so nothing to search but the ZeRO stage
        choices = Choices(tp=args.tp or 1, pp=args.pp or 1, zero=args.zero, micro_batch=args.micro_batch or 1,
                          global_batch=args.global_batch, checkpointing=args.checkpointing or "none",
                          dtype=args.dtype, schedule=args.schedule, offload=args.offload)
    if not choices.open:
        layout = fixed_layout(spec, args.gpus, gpu, choices)
        return [estimate(spec, layout, gpu, assumptions, args.params)], False
    return rank_layouts(spec, args.gpus, gpu, choices, assumptions, args.params), True


def run(args: argparse.Namespace) -> int:
    try:
        plans, ranked = build(args)
    except (PlanError, ValueError) as exc:
        print(f"tachyon plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        payload = ranking_dict(plans, args.top) if ranked else plans[0].to_dict()
        print(json.dumps(payload, indent=2))
    else:
        print(format_ranking(plans, args.top) if ranked else format_plan(plans[0]))
    return 0 if any(p.fits for p in plans) else 1


__all__ = ["HELP", "add_arguments", "build", "count", "run"]

"""The ``tachyon`` command (also ``python -m tachyon``).

    tachyon --version
    tachyon info            versions and what this machine can run
    tachyon train [CONFIG]  the main job: a small BERT (or GPT) on the embedded corpus (--resume)
    tachyon demo            a small fused-kernel run that prints what it checked
    tachyon launch ...      run a script on several processes through torchrun (--dry-run prints it)
    tachyon plan ...        memory, communication and step time of a training layout; ranked layouts
    tachyon export CKPT OUT consolidated weights of any checkpoint (safetensors / HF folder), on the CPU

Subcommands register themselves in ``SUBCOMMANDS`` (name -> (help, add_arguments, run)), so later
pieces (train, launch, bench) add one entry each.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Callable

import tachyon

Subcommand = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


def _info(args: argparse.Namespace) -> int:
    del args
    from tachyon import versions
    from tachyon.backend import get_backend

    lines = [
        f"tachyon {tachyon.__version__}",
        f"python {platform.python_version()} ({platform.machine()}, {platform.system()})",
        "dependencies (installed, and the range the test suite passed with):",
        *(f"  {row.line()}" for row in versions.report()),
    ]
    try:
        import triton  # noqa: F401
    except Exception as exc:  # any import failure is reported, not raised
        lines.append(f"triton not importable: {exc}")
    lines.append(f"backend {get_backend()}")
    import torch

    from tachyon.kernels import dispatch

    arch = None
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}"
    lines.extend(dispatch.describe(arch))
    lines.append("capabilities:")
    for name, cap in tachyon.capabilities().items():
        lines.append(f"  {name:<7} {'yes' if cap.available else 'no ':<4} {cap.detail}")
    from tachyon.fp8 import gemm_paths

    lines.append("FP8 recipes (tachyon.autocast(recipe=...)):")
    for name, (runs, detail) in gemm_paths().items():
        lines.append(f"  {name:<7} {'yes' if runs else 'no ':<4} {detail}")
    warnings = versions.warnings()
    if warnings:
        lines.append("WARNING: " + "; ".join(warnings) + ". tachyon may work, but this combination is untested.")
    print("\n".join(lines))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from tachyon.demo import run_demo

    return run_demo(steps=args.steps)


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=50, help="training steps of the small demo model")


def _export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint root (its `latest` is used unless --tag) or a checkpoint directory")
    parser.add_argument("out", help="the folder to write (created)")
    parser.add_argument("--tag", default=None, help="the checkpoint tag under CHECKPOINT (default: its `latest`)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="dtype of the written weights (default fp32: the master weights as saved)")
    parser.add_argument("--filename", default="model.safetensors",
                        help="weights file name (.safetensors, else torch.save; default model.safetensors)")


def _export(args: argparse.Namespace) -> int:
    """DeepSpeed's zero_to_fp32: one consolidated weights file (and config.json for an HF model)."""
    from tachyon.engine.checkpoint import CheckpointError, export_checkpoint

    try:
        path = export_checkpoint(args.checkpoint, args.out, tag=args.tag, dtype=args.dtype, save_filename=args.filename)
    except (CheckpointError, OSError, ValueError) as error:
        print(f"tachyon export: {error}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


from tachyon.parallel import launch as _launch  # noqa: E402  (standard library only at import)
from tachyon.plan import cli as _plan  # noqa: E402
from tachyon.train import cli as _train  # noqa: E402

SUBCOMMANDS: dict[str, Subcommand] = {
    "info": ("print versions and what this machine can run", _no_arguments, _info),
    "launch": ("run a training script on several processes with torchrun", _launch.add_arguments, _launch.run),
    "train": (_train.HELP, _train.add_arguments, _train.run),
    "demo": ("train a small model built from tachyon's fused norms and check it", _demo_arguments, _demo),
    "plan": (_plan.HELP, _plan.add_arguments, _plan.run),
    "export": ("write the consolidated weights of a checkpoint (any ZeRO stage or layout) as safetensors, with "
               "config.json for an HF model (DeepSpeed's zero_to_fp32), on the CPU", _export_arguments, _export),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tachyon", description="Fast transformer training and inference in PyTorch.")
    parser.add_argument("--version", action="version", version=f"tachyon {tachyon.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_arguments, _) in SUBCOMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return SUBCOMMANDS[args.command][2](args)


if __name__ == "__main__":
    sys.exit(main())

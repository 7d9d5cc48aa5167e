"""``tachyon train [CONFIG]``: the main job (registered in ``tachyon.cli.SUBCOMMANDS`` as "train").

    tachyon train                               the default config (small BERT, CPU: 2 processes)
    tachyon train examples/train_gpt_cpu.json   another config
    tachyon train CONFIG --resume               continue from the latest checkpoint of the run
    tachyon train CONFIG --steps 600 --nproc 1 --output-dir runs/mine

Launching: outside a torchrun environment with more than one process, the command re-executes
itself as ``python -m torch.distributed.run --standalone --nproc-per-node N -m tachyon.train ...``
(after resolving the output directory, so every rank writes to the same one); inside torchrun
(RANK and WORLD_SIZE set) or with one process it runs the loop (:func:`tachyon.train.run.train`).
N: ``--nproc``, else the number of GPUs on a CUDA machine, else the config's ``nproc``.
Output directory: ``--output-dir``, else the config's ``output_dir``, else
``runs/<model>-<YYYYmmdd-HHMMSS>``; with ``--resume`` and neither given, the newest
``runs/<model>-*`` that holds checkpoints.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from tachyon.config import ConfigError

__all__ = ["add_arguments", "default_config_path", "launch_command", "resolve_output_dir", "run"]

HELP = "train a small BERT (or GPT) on the embedded Shakespeare corpus with the tachyon engine"


def default_config_path() -> Path | None:
    """examples/train_bert_cpu.json of a source checkout, when it is there (None: built-in defaults)."""
    path = Path(__file__).resolve().parents[3] / "examples" / "train_bert_cpu.json"
    return path if path.is_file() else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=None,
                        help="the job's JSON config (default: examples/train_bert_cpu.json, or built-in defaults)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the output dir")
    parser.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="processes (default: the number of GPUs, else the config's nproc)")
    parser.add_argument("--steps", type=int, default=None, metavar="N", help="override the config's total steps")
    parser.add_argument("--output-dir", default=None, metavar="DIR", help="override the config's output_dir")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def _in_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _process_count(args: argparse.Namespace, config_nproc: int) -> int:
    if args.nproc is not None:
        if args.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1; got {args.nproc}")
        return args.nproc
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return config_nproc


def resolve_output_dir(given: str | None, model: str, resume: bool, root: Path = Path("runs")) -> Path:
    """``given``, else (with ``resume``) the newest ``root/<model>-*`` with a checkpoints/ folder,
    else a new ``root/<model>-<timestamp>``."""
    if given:
        return Path(given)
    if resume:
        runs = sorted(p for p in root.glob(f"{model}-*") if (p / "checkpoints").is_dir())
        if runs:
            return runs[-1]
    return root / f"{model}-{time.strftime('%Y%m%d-%H%M%S')}"


def launch_command(args: argparse.Namespace, nproc: int, output_dir: Path) -> list[str]:
    """The torchrun command that runs this job on ``nproc`` local processes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "tachyon.train"]  # the same as `tachyon train`, whatever the CLI registry holds
    if args.config is not None:
        cmd.append(str(args.config))
    cmd += ["--output-dir", str(output_dir)]
    if args.steps is not None:
        cmd += ["--steps", str(args.steps)]
    if args.resume:
        cmd.append("--resume")
    if args.no_progress:
        cmd.append("--no-progress")
    return cmd


def run(args: argparse.Namespace) -> int:
    """Entry point of ``tachyon train``; returns the exit code (2 for a bad config or argument)."""
    from tachyon.train.config import load_train_config

    source = args.config if args.config is not None else default_config_path()
    try:
        config = load_train_config(source, steps=args.steps)
        nproc = None if _in_torchrun() else _process_count(args, config.nproc)
        if nproc is not None:  # check the engine section here, not in N processes after the launch
            import tachyon
            from tachyon.config import load_config

            precision = config.training_precision(tachyon.capabilities()["bf16"].available)
            load_config(config.engine_config(precision), world_size=nproc)
    except ConfigError as error:
        print(f"tachyon train: error: {error}", file=sys.stderr)
        return 2
    output_dir = resolve_output_dir(args.output_dir or config.output_dir, config.model, args.resume)
    if nproc is not None and nproc > 1:
        cmd = launch_command(args, nproc, output_dir)
        print(shlex.join(cmd), flush=True)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))  # silences torchrun's note
        try:
            code = subprocess.call(cmd, env=env)
        except KeyboardInterrupt:
            return 130
        return 128 - code if code < 0 else code
    from tachyon.parallel.distributed import shutdown_distributed
    from tachyon.train.run import train

    try:
        train(config, output_dir, resume=args.resume, progress=not args.no_progress)
    except ConfigError as error:
        print(f"tachyon train: error: {error}", file=sys.stderr)
        return 2
    shutdown_distributed()  # every rank is done: barrier, then the process groups are destroyed
    return 0

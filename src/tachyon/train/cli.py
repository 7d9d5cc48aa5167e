"""``tachyon train [CONFIG]``: the main job (registered in ``tachyon.cli.SUBCOMMANDS`` as "train").

    tachyon train                               the default job (small BERT, CPU: 2 processes)
    tachyon train --model gpt                   the GPT job
    tachyon train examples/train_ci.json        another config
    tachyon train CONFIG --resume               continue from the latest checkpoint of the run
    tachyon train CONFIG --resume --steps 900 --reschedule   go on to 900 steps, lr schedule stretched
    tachyon train CONFIG --steps 600 --nproc 1 --output-dir runs/mine --quiet
    tachyon train --pld                         progressive layer drop on (--no-pld: off, whatever CONFIG says)
    tachyon train --model gpt --tp 2 --pp 2     the GPT split 2 ways within layers and 2 ways by layers
    tachyon train --model gpt --fp8 current     the GPT's TransformerLayer GEMMs in FP8 (delayed, current, block)
    tachyon train --zero 3 --offload            ZeRO stage 3 (FSDP2), optimizer states and step on the CPU

Launching: outside a torchrun environment with more than one process, the command re-executes
itself as ``python -m torch.distributed.run --standalone --nproc-per-node N -m tachyon.train ...``
(after resolving the output directory, so every rank writes to the same one); inside torchrun
(RANK and WORLD_SIZE set) or with one process it runs the loop (:func:`tachyon.train.run.train`).
N: ``--nproc``, else the number of GPUs on a CUDA machine, else the config's ``nproc``; without
``--nproc``, a CPU job with tensor or pipeline parallelism runs at least tp x pp processes (the
config's ``nproc`` rounded up to a multiple of tp x pp), so ``--tp 2 --pp 2`` works as it is.
Output directory: ``--output-dir``, else the config's ``output_dir``, else
``runs/<model>-<YYYYmmdd-HHMMSS>``; with ``--resume`` and neither given, the newest
``runs/<model>-*`` that holds checkpoints.

Stopping: SIGINT / SIGTERM to the command reach torchrun and the workers (`tachyon.parallel.
launch.run_torchrun`), and nothing outlives the command. The job saves on SIGTERM or SIGUSR1 by
default (its engine section gets ``"preemption": {"enabled": true}``, saving into the run's
checkpoints/; `tachyon.train.resume`): every rank finishes its step, the checkpoint is written,
metrics.csv and validation.csv already hold every step, and the command exits with 75;
``--resume`` continues. A resumed run that already reached its ``steps`` changes nothing.

The job needs matplotlib (loss.png) and tokenizers (the BPE tokenizer): the ``train`` extra.
Without them the command stops before any work with the ``pip install`` line that adds them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
import time
from pathlib import Path

from tachyon.config import ConfigError

__all__ = ["HELP", "add_arguments", "default_config_path", "launch_command", "missing_dependencies",
           "resolve_output_dir", "run"]

HELP = "train a small BERT (or GPT) on the embedded Shakespeare corpus with the tachyon engine"
MODELS = ("bert", "gpt")
TRAIN_DEPENDENCIES = ("matplotlib", "tokenizers")


def default_config_path(model: str = "bert") -> Path | None:
    """examples/train_<model>_cpu.json of a source checkout, when it is there (None: the built-in
    job, the same settings)."""
    path = Path(__file__).resolve().parents[3] / "examples" / f"train_{model}_cpu.json"
    return path if path.is_file() else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tachyon train``; every help line ends with its default."""
    parser.add_argument("config", nargs="?", default=None,
                        help="the job's JSON config (default: examples/train_<model>_cpu.json, the built-in job)")
    parser.add_argument("--model", choices=MODELS, default=None,
                        help="the built-in job to run, or the model of CONFIG to override (default: bert, or "
                             "CONFIG's model)")
    from tachyon.train.config import BUILT_IN_JOBS, TrainConfig

    steps = {model: job.get("steps", TrainConfig.model_fields["steps"].default) for model, job in BUILT_IN_JOBS.items()}
    parser.add_argument("--steps", type=int, default=None, metavar="N",
                        help="total optimizer steps (default: the config's steps; built-in jobs: "
                             + ", ".join(f"{model} {n}" for model, n in steps.items()) + ")")
    parser.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="processes (default: the number of GPUs, else the config's nproc, 2)")
    parser.add_argument("--output-dir", default=None, metavar="DIR",
                        help="where the run writes (default: the config's output_dir, else runs/<model>-<time>)")
    parser.add_argument("--pld", action=argparse.BooleanOptionalAction, default=None,
                        help="progressive layer drop on (--no-pld: off): sets the engine section's "
                             "progressive_layer_drop.enabled, keeping its theta and gamma (DeepSpeed's 0.5 and "
                             "0.001 when absent) (default: as the config says; off in the built-in jobs)")
    parser.add_argument("--tp", type=int, default=None, metavar="N",
                        help="tensor-parallel size (model gpt): sets the engine section's tensor_parallel.tp_size "
                             "(default: as the config says; 1 in the built-in jobs)")
    parser.add_argument("--pp", type=int, default=None, metavar="M",
                        help="pipeline stages (model gpt): sets the engine section's pipeline.stages; above 1, "
                             "ZeRO stage 2 becomes 1 and the micro-batches per step are at least M (default: as "
                             "the config says; 1 in the built-in jobs)")
    parser.add_argument("--fp8", choices=("delayed", "current", "block"), default=None,
                        help="model gpt: the TransformerLayers' GEMMs in FP8 under this recipe (delayed, current or "
                             "block scaling; tachyon.autocast around each forward) (default: as the config says; "
                             "off in the built-in jobs)")
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None, metavar="STAGE",
                        help="ZeRO stage 0-3: sets the engine section's zero_optimization.stage; 3 shards the "
                             "parameters too (FSDP2) (default: as the config says; 2 in the built-in jobs)")
    parser.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                        help="ZeRO-Offload: sets zero_optimization.offload_optimizer to {device: cpu, pin_memory: "
                             "true} (stage 1-3); --no-offload removes the offload sections (default: as the config "
                             "says; off in the built-in jobs)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in the output dir (default: off, a new run)")
    parser.add_argument("--reschedule", action="store_true",
                        help="with --resume and another --steps: stretch the lr schedule over the new steps (default: "
                             "keep the checkpoint's schedule, and say what either gives)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar, the step lines only (default: a bar when stderr is a terminal)")
    parser.add_argument("--quiet", action="store_true",
                        help="print only errors and the one-line result (default: off)")


def missing_dependencies() -> list[str]:
    """The packages of the ``train`` extra that do not import (not installed, or broken)."""
    missing = []
    for name in TRAIN_DEPENDENCIES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def _in_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _process_count(args: argparse.Namespace, config_nproc: int, model_parallel: int = 1) -> int:
    """--nproc, else the GPUs, else the config's nproc rounded up to a multiple of
    ``model_parallel`` (tp x pp)."""
    if args.nproc is not None:
        if args.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1; got {args.nproc}")
        return args.nproc
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return -(-config_nproc // model_parallel) * model_parallel


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
    if args.model is not None:
        cmd += ["--model", args.model]
    cmd += ["--output-dir", str(output_dir)]
    if args.steps is not None:
        cmd += ["--steps", str(args.steps)]
    if getattr(args, "pld", None) is not None:
        cmd.append("--pld" if args.pld else "--no-pld")
    for flag in ("tp", "pp", "fp8", "zero"):
        if getattr(args, flag, None) is not None:
            cmd += [f"--{flag}", str(getattr(args, flag))]
    if getattr(args, "offload", None) is not None:
        cmd.append("--offload" if args.offload else "--no-offload")
    for flag in ("resume", "reschedule", "no_progress", "quiet"):
        if getattr(args, flag):
            cmd.append("--" + flag.replace("_", "-"))
    return cmd


def _output_mode(args: argparse.Namespace) -> str:
    return "quiet" if args.quiet else "lines" if args.no_progress else "bar"


def run(args: argparse.Namespace) -> int:
    """Entry point of ``tachyon train``; returns the exit code (2 for a bad config or argument, or
    a missing dependency)."""
    missing = missing_dependencies()
    if missing:
        print(f"tachyon train: error: {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed; "
              "the training job needs them (loss.png, the BPE tokenizer): pip install 'tachyon[train]'",
              file=sys.stderr)
        return 2
    from tachyon.train.config import load_train_config

    source = args.config if args.config is not None else default_config_path(args.model or "bert")
    try:
        config = load_train_config(source, model=args.model, pld=getattr(args, "pld", None),
                                   tp=getattr(args, "tp", None), pp=getattr(args, "pp", None),
                                   zero=getattr(args, "zero", None), offload=getattr(args, "offload", None),
                                   steps=args.steps, fp8=getattr(args, "fp8", None))
        model_parallel = config.tensor_parallel_size * config.pipeline_stages
        nproc = None if _in_torchrun() else _process_count(args, config.nproc, model_parallel)
        if nproc is not None:  # check the engine section here, not in N processes after the launch
            from tachyon.config import load_config
            from tachyon.train.helpers import native_bf16

            precision = config.training_precision(native_bf16())
            load_config(config.engine_config(precision), world_size=nproc)
    except ConfigError as error:
        print(f"tachyon train: error: {error}", file=sys.stderr)
        return 2
    output_dir = resolve_output_dir(args.output_dir or config.output_dir, config.model, args.resume)
    if nproc is not None and nproc > 1:
        cmd = launch_command(args, nproc, output_dir)
        if not args.quiet:
            print(shlex.join(cmd), flush=True)
        env = dict(os.environ)
        from tachyon.train.helpers import usable_cpus

        env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // nproc)))  # silences torchrun's note
        from tachyon.parallel.launch import run_torchrun

        return run_torchrun(cmd, env, who="tachyon train")  # signals forwarded; no process outlives this one
    from tachyon.engine.preemption import Preempted
    from tachyon.parallel.distributed import shutdown_distributed
    from tachyon.train.run import train

    try:
        train(config, output_dir, resume=args.resume, output=_output_mode(args),
              reschedule=getattr(args, "reschedule", False))
    except ConfigError as error:
        print(f"tachyon train: error: {error}", file=sys.stderr)
        return 2
    except Preempted as stop:  # saved; metrics.csv and validation.csv hold every step so far
        shutdown_distributed()
        return int(stop.code)
    shutdown_distributed()  # every rank is done: barrier, then the process groups are destroyed
    return 0

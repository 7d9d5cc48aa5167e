"""Rank side of tests/compat/test_port_scripts.py: runs each script in port_scripts/ as
``__main__`` (with its command line) in this rank, and returns what it printed."""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parent / "port_scripts"

CIFAR_CONFIG = {
    "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 5}},
}
PIPELINE_CONFIG = {
    "train_batch_size": 64, "train_micro_batch_size_per_gpu": 16, "steps_per_print": 1000,
    "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}},
    "pipeline": {"schedule": "1F1B"},
}


def _run(script: str, argv: list[str]) -> str:
    out = io.StringIO()
    saved = sys.argv
    sys.argv = [str(SCRIPTS / script), *argv]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(SCRIPTS / script), run_name="__main__")
    finally:
        sys.argv = saved
    return out.getvalue()


def rank_main(workdir: str, scripts: tuple[str, ...]) -> dict[str, str]:
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    paths = {}
    for name, config in (("cifar", CIFAR_CONFIG), ("pipeline", PIPELINE_CONFIG)):
        paths[name] = os.path.join(workdir, f"{name}_ds_config.json")
        if rank == 0:
            with open(paths[name], "w") as handle:
                json.dump(config, handle)
    torch.distributed.barrier()
    argv = {
        "cifar_ds.py": ["--deepspeed", "--deepspeed_config", paths["cifar"], "--epochs", "4"],
        "bert_ds.py": ["--checkpoint_dir", os.path.join(workdir, "bert_checkpoints")],
        "pipeline_ds.py": ["--deepspeed_config", paths["pipeline"], "--steps", "12"],
    }
    return {script: _run(script, argv[script]) for script in scripts}

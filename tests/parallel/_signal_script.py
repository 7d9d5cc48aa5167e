"""Run by tests/parallel/test_launch.py through `python -m tachyon.parallel.launch --nproc-per-node 2`.

    _signal_script.py OUT_DIR on|off

Each rank trains a tiny model with tachyon.initialize for up to 10,000 steps (0.05 s each),
writing its pid to OUT_DIR/pid_<rank> and its step count to OUT_DIR/step_<rank>, until a
signal stops it. "on": the preemption section saves into OUT_DIR/ckpt and exits with 75.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

import tachyon


def _write_atomically(path: Path, text: str) -> None:
    """The test polls these files: a reader sees the old text or the new, never an empty file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> None:
    out, preemption = Path(sys.argv[1]), sys.argv[2] == "on"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 1}}
    if preemption:
        config["preemption"] = {"enabled": True, "save_dir": str(out / "ckpt")}
    engine, _, _, _ = tachyon.initialize(model=model, config=config)
    rank = engine.world_comm.rank
    _write_atomically(out / f"pid_{rank}", str(os.getpid()))
    gen = torch.Generator().manual_seed(rank)
    for _ in range(10_000):
        x = torch.randn(2, 4, generator=gen)
        engine.backward(engine(x).square().mean())
        engine.step()
        _write_atomically(out / f"step_{rank}", str(engine.global_steps))
        time.sleep(0.05)


if __name__ == "__main__":
    main()

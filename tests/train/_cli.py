"""Running ``tachyon train`` as a user does, in a fresh process (outside any torchrun
environment the test runner may have), for the job tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def train_process(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m tachyon train *argv`` from the repository root; its exit code and output."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    return subprocess.run([sys.executable, "-m", "tachyon", "train", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def succeeded(proc: subprocess.CompletedProcess) -> str:
    """The process's stdout + stderr, after asserting that it exited with 0."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}; output:\n{output[-4000:]}"
    return output


def run_train(*argv: str, timeout: float = 600) -> str:
    """``tachyon train *argv``, which must succeed; its output."""
    return succeeded(train_process(*argv, timeout=timeout))

"""``tachyon train`` stopped by SIGTERM (``kill``, ``docker stop``): both ranks finish the step,
the checkpoint is saved, metrics.csv holds every step so far, the command exits with 75, and
``--resume`` continues with the rows kept."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tachyon.train.report import read_metrics
from tests.train._cli import _LAUNCH_ENV, ROOT, succeeded, train_process

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TINY = {"model": "bert", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "seq_len": 16, "steps": 5000,
        "checkpoint_interval": 0, "eval_interval": 2, "eval_batches": 1, "nproc": 2, "examples": 1,
        "engine": {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 1000,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}}


def test_sigterm_saves_keeps_the_metrics_and_resume_continues(tmp_path):
    config, out = tmp_path / "tiny.json", tmp_path / "run"
    config.write_text(json.dumps(TINY))
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "tachyon", "train", str(config), "--output-dir", str(out),
                             "--no-progress"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    while not ((out / "metrics.csv").is_file() and len(read_metrics(out / "metrics.csv")) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0] if proc.poll() else "slow"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=180)[0]
    assert proc.returncode == 75, output[-3000:]
    tag = (out / "checkpoints" / "latest").read_text()
    saved = int(tag.removeprefix("global_step"))
    assert f"stopped on SIGTERM after step {saved}" in output, output[-3000:]
    rows = read_metrics(out / "metrics.csv")
    assert [r["step"] for r in rows] == list(range(1, saved + 1))
    # the stopping step is saved at once, without its evaluation
    assert [v["step"] for v in read_metrics(out / "validation.csv")] == list(range(2, saved, 2))

    resumed = train_process(str(config), "--output-dir", str(out), "--resume", "--steps", str(saved + 2),
                            "--no-progress")
    assert f"resumed from step {saved}" in succeeded(resumed)
    after = read_metrics(out / "metrics.csv")
    assert [r["step"] for r in after] == list(range(1, saved + 3)) and after[:saved] == rows

"""Monitor (TensorBoard / CSV in DeepSpeed's layout, rank 0 only), the step line, wall-clock timers."""

from __future__ import annotations

import csv
import sys

import pytest
import torch

from tachyon.config import load_config
from tachyon.engine import monitor as monitor_mod
from tachyon.engine.monitor import Monitor, StepLogger, WallClockTimers, format_step_line


def make_config(tmp_path, tensorboard=False, csv_monitor=False):
    return load_config({
        "train_batch_size": 8,
        "tensorboard": {"enabled": tensorboard, "output_path": str(tmp_path / "tb"), "job_name": "run1"},
        "csv_monitor": {"enabled": csv_monitor, "output_path": str(tmp_path / "csv"), "job_name": "run1"},
    })


def read_csv(path):
    with path.open(newline="") as handle:
        return list(csv.reader(handle))


EVENTS = [("Train/Samples/train_loss", 2.5, 8), ("Train/Samples/lr", torch.tensor(3e-4), 8), ("my metric", 7, 8)]


def test_csv_monitor_writes_one_file_per_metric_like_deepspeed(tmp_path):
    with Monitor(make_config(tmp_path, csv_monitor=True), rank=0) as monitor:
        assert monitor.enabled
        monitor.write_events(EVENTS)
        monitor.write_events([("Train/Samples/train_loss", 2.25, 16)])
    run = tmp_path / "csv" / "run1"
    assert sorted(p.name for p in run.iterdir()) == ["Train_Samples_lr.csv", "Train_Samples_train_loss.csv", "my_metric.csv"]
    assert read_csv(run / "Train_Samples_train_loss.csv") == [["step", "train_loss"], ["8", "2.5"], ["16", "2.25"]]
    rows = read_csv(run / "Train_Samples_lr.csv")
    assert rows[0] == ["step", "lr"] and rows[1][0] == "8" and float(rows[1][1]) == pytest.approx(3e-4)
    assert read_csv(run / "my_metric.csv") == [["step", "my metric"], ["8", "7.0"]]


def test_csv_monitor_appends_without_a_second_header_when_resumed(tmp_path):
    config = make_config(tmp_path, csv_monitor=True)
    Monitor(config).write_events([("loss", 1.0, 1)])
    Monitor(config).write_events([("loss", 0.5, 2)])
    assert read_csv(tmp_path / "csv" / "run1" / "loss.csv") == [["step", "loss"], ["1", "1.0"], ["2", "0.5"]]


def test_only_rank_zero_writes(tmp_path):
    monitor = Monitor(make_config(tmp_path, csv_monitor=True), rank=1)
    assert not monitor.enabled
    monitor.write_events(EVENTS)
    assert not (tmp_path / "csv").exists()


def test_disabled_sections_write_nothing(tmp_path):
    monitor = Monitor(make_config(tmp_path))
    assert not monitor.enabled
    monitor.write_events(EVENTS)
    assert not (tmp_path / "csv").exists() and not (tmp_path / "tb").exists()


class FakeSummaryWriter:
    instances: list[FakeSummaryWriter] = []

    def __init__(self, log_dir):
        self.log_dir, self.scalars, self.flushes, self.closed = log_dir, [], 0, False
        FakeSummaryWriter.instances.append(self)

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))

    def flush(self):
        self.flushes += 1

    def close(self):
        self.closed = True


def test_tensorboard_writer_gets_every_scalar(tmp_path, monkeypatch):
    FakeSummaryWriter.instances.clear()
    monkeypatch.setattr(monitor_mod, "_summary_writer_class", lambda: FakeSummaryWriter)
    monitor = Monitor(make_config(tmp_path, tensorboard=True, csv_monitor=True))
    monitor.write_events(EVENTS)
    (writer,) = FakeSummaryWriter.instances
    assert writer.log_dir == str(tmp_path / "tb" / "run1")
    assert writer.scalars[0] == ("Train/Samples/train_loss", 2.5, 8)
    assert writer.scalars[1][0] == "Train/Samples/lr" and writer.scalars[1][1] == pytest.approx(3e-4)
    assert isinstance(writer.scalars[1][1], float) and writer.flushes == 1
    assert (tmp_path / "csv" / "run1" / "my_metric.csv").exists()  # both sinks
    monitor.close()
    assert writer.closed



def test_tensorboard_event_file_reads_back(tmp_path):
    """The real TensorBoard writer (the test extra installs it): the event file in
    output_path/job_name reads back with TensorBoard's own reader, every scalar at its step."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                      reason="tensorboard is not installed")
    monitor = Monitor(make_config(tmp_path, tensorboard=True))
    monitor.write_events(EVENTS)
    monitor.write_events([("Train/Samples/train_loss", 2.0, 16)])
    monitor.close()
    events = accumulator.EventAccumulator(str(tmp_path / "tb" / "run1"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["Train/Samples/lr", "Train/Samples/train_loss", "my metric"]
    assert [(s.step, s.value) for s in events.Scalars("Train/Samples/train_loss")] == [(8, 2.5), (16, 2.0)]
    assert events.Scalars("Train/Samples/lr")[0].value == pytest.approx(3e-4)

def test_tensorboard_not_installed_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r"install the `tensorboard` extra: pip install 'tachyon\[tensorboard\]'"):
        Monitor(make_config(tmp_path, tensorboard=True))
    Monitor(make_config(tmp_path, tensorboard=True), rank=1)  # other ranks never import it


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([("loss", 1.0)], r"each event must be a \(name, value, step\) tuple"),
        ([("", 1.0, 1)], "event name must be a non-empty string"),
        ([("loss", "high", 1)], "event 'loss': value must be a number or a one-element tensor; got str"),
        ([("loss", torch.ones(2), 1)], r"value must be a scalar; got a tensor of shape \(2,\)"),
        ([("loss", 1.0, -1)], "step must be an int >= 0"),
        ([("loss", 1.0, 1.5)], "step must be an int >= 0"),
    ],
)
def test_bad_events(tmp_path, events, message):
    with pytest.raises(ValueError, match=message):
        Monitor(make_config(tmp_path, csv_monitor=True)).write_events(events)


def test_bad_constructor_arguments(tmp_path):
    with pytest.raises(ValueError, match="config must be a TachyonConfig"):
        Monitor({"tensorboard": {}}, 0)
    with pytest.raises(ValueError, match="rank must be an int >= 0"):
        Monitor(make_config(tmp_path), -1)


# --------------------------------------------------------------------------- step line


def test_format_step_line_full_and_minimal():
    line = format_step_line(100, loss=torch.tensor(2.31), lr=3e-4, grad_norm=torch.tensor(1.0523), loss_scale=65536.0,
                            skipped_steps=2, samples_per_s=812.34, tokens_per_s=415897.4, step_time_s=0.07879)
    assert line == ("step 100 | loss 2.3100 | lr 3.000e-04 | grad norm 1.052 | loss scale 65536 | skipped 2 | "
                    "812.3 samples/s | 415897 tokens/s | step 78.79 ms")
    assert format_step_line(5, loss=1.0, lr=[1e-3, 2e-3]) == "step 5 | loss 1.0000 | lr 1.000e-03, 2.000e-03 | skipped 0"


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_step_logger_prints_every_steps_per_print_with_window_throughput():
    clock, printed = FakeClock(), []
    logger = StepLogger(4, samples_per_step=32, tokens_per_sample=128, rank=0, printer=printed.append, clock=clock)
    lines = []
    for step in range(1, 9):
        clock.now += 0.5  # every step takes 0.5 s
        lines.append(logger.step(step, loss=1.0 / step, lr=1e-3, grad_norm=2.0, skipped_steps=0))
    assert [i + 1 for i, line in enumerate(lines) if line] == [4, 8]
    assert printed == [lines[3], lines[7]]
    assert lines[7] == ("step 8 | loss 0.1250 | lr 1.000e-03 | grad norm 2 | skipped 0 | 64.0 samples/s | "
                        "8192 tokens/s | step 500.00 ms")


def test_step_logger_prints_only_on_rank_zero_and_restarts_windows():
    clock, printed = FakeClock(), []
    logger = StepLogger(1, samples_per_step=10, rank=1, printer=printed.append, clock=clock)
    clock.now = 100.0  # e.g. evaluation ran before training
    logger.restart_window()
    clock.now = 101.0
    line = logger.step(1, loss=1.0, lr=0.1)
    assert printed == [] and "10.0 samples/s" in line and "step 1000.00 ms" in line and "tokens/s" not in line


@pytest.mark.parametrize("kwargs", [
    {"steps_per_print": 0, "samples_per_step": 1},
    {"steps_per_print": 1, "samples_per_step": 0},
    {"steps_per_print": 1, "samples_per_step": 1, "tokens_per_sample": 0},
])
def test_step_logger_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="must be an int >= 1"):
        StepLogger(**kwargs)


# --------------------------------------------------------------------------- timers


def test_timers_mean_over_the_window_log_and_reset():
    clock = FakeClock()
    timers = WallClockTimers(synchronize=False, clock=clock)
    for fwd, bwd in ((0.010, 0.020), (0.030, 0.040)):
        timers("forward").start()
        clock.now += fwd
        assert timers("forward").stop() == pytest.approx(fwd)
        timers("backward").start()
        clock.now += bwd
        timers("backward").stop()
    assert timers.mean_ms("forward") == pytest.approx(20.0)
    assert timers.events(64) == [("Train/Samples/elapsed_time_ms_forward", pytest.approx(20.0), 64),
                                 ("Train/Samples/elapsed_time_ms_backward", pytest.approx(30.0), 64)]
    assert timers.log(["forward", "backward"]) == "time (ms) | forward: 20.00 | backward: 30.00"
    assert timers.log() == "time (ms) | forward: 0.00 | backward: 0.00"  # reset by the first log


def test_timer_misuse_is_reported():
    timers = WallClockTimers(synchronize=False)
    with pytest.raises(RuntimeError, match="'step' was stopped without start"):
        timers("step").stop()
    timers("step").start()
    with pytest.raises(RuntimeError, match="'step' is already running"):
        timers("step").start()
    with pytest.raises(ValueError, match=r"unknown timers \['reduce'\]; started so far: \['step'\]"):
        timers.log(["reduce"])


def test_timers_synchronize_cuda_when_asked(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(1))
    timers = WallClockTimers()  # default: synchronize when CUDA is available
    timers("forward").start()
    timers("forward").stop()
    assert timers.synchronize and len(calls) == 2
    quiet = WallClockTimers(synchronize=False)
    quiet("forward").start()
    quiet("forward").stop()
    assert len(calls) == 2

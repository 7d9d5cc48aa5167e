"""The Engine's own monitoring, from the config alone: the step line every steps_per_print
steps on rank 0, DeepSpeed's monitor events through csv_monitor, the wall-clock breakdown.

Time is faked (the engine's telemetry clock is replaced and advanced by the model, a backward
hook, the ZeRO reduction and the optimizer), so every printed number is checked exactly."""

from __future__ import annotations

import contextlib
import csv
import io
import re

import pytest
import torch

import tachyon
from tests.engine.zero_cases import IN, LR, MICRO, batch, loss_fn, make_model
from tests.utils.distributed import run_distributed

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS = 16
FWD_S, BWD_S, REDUCE_S, STEP_S = 0.010, 0.030, 0.002, 0.004
"""Fake seconds the clock advances in each phase of a micro-step (step: once per optimizer step)."""

LINE = re.compile(
    r"^step (?P<step>\d+) \| loss (?P<loss>\S+) \| lr (?P<lr>\S+) \| grad norm (?P<norm>\S+)"
    r"(?: \| loss scale (?P<scale>\S+))? \| skipped (?P<skipped>\d+) \| (?P<sps>\S+) samples/s"
    r"(?: \| (?P<tps>\S+) tokens/s)? \| step (?P<ms>\S+) ms$"
)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class TimedModel(torch.nn.Module):
    """zero_cases' model; its forward advances the clock by FWD_S and its backward by BWD_S."""

    def __init__(self, clock: FakeClock):
        super().__init__()
        self.net = make_model()
        self.clock = clock

    def forward(self, x):
        self.clock.advance(FWD_S)
        out = self.net(x)
        if out.requires_grad:
            out.register_hook(lambda grad: self.clock.advance(BWD_S))
        return out


def config(gas=1, steps_per_print=2, world=1, **extra):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "train_batch_size": MICRO * gas * world, "steps_per_print": steps_per_print,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}}, **extra}


def make_engine(cfg: dict, clock: FakeClock):
    """An engine whose telemetry, timers, reduction and optimizer step run on ``clock``."""
    engine, *_ = tachyon.initialize(model=TimedModel(clock), config=cfg)
    engine.telemetry.clock = clock
    if engine.telemetry.timers is not None:
        engine.telemetry.timers.clock = clock
    end_backward, optimizer_step = engine.zero.end_backward, engine.optimizer.step

    def timed_end_backward():
        clock.advance(REDUCE_S)
        end_backward()

    def timed_step(*args, **kwargs):
        clock.advance(STEP_S)
        return optimizer_step(*args, **kwargs)

    engine.zero.end_backward = timed_end_backward
    engine.optimizer.step = timed_step
    return engine


def train(engine, steps: int, rank: int = 0) -> list[dict]:
    """``steps`` optimizer steps; per step: its micro-losses, lr and grad norm after it."""
    record = []
    dtype = engine.precision.model_dtype
    for step in range(steps):
        losses = []
        for micro in range(engine.gradient_accumulation_steps()):
            x, y = (t.to(engine.device) for t in batch(step, micro, rank, dtype))
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        record.append({"losses": losses, "lr": engine.get_lr()[0], "norm": engine.get_global_grad_norm()})
    return record


def step_lines(out: str) -> list[re.Match]:
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    matches = [LINE.match(line) for line in lines]
    assert all(matches), f"a step line does not have the expected fields:\n{out}"
    return matches


# --------------------------------------------------------------------------- the step line


def test_step_line_at_every_steps_per_print_with_all_fields(capsys):
    clock = FakeClock()
    engine = make_engine(config(gas=2, steps_per_print=2), clock)
    engine.set_tokens_per_sample(TOKENS)
    record = train(engine, 5)
    lines = step_lines(capsys.readouterr().out)
    assert [int(m["step"]) for m in lines] == [2, 4]  # not 1, 3, 5
    step_s = 2 * (FWD_S + BWD_S + REDUCE_S) + STEP_S  # two micro-steps, one optimizer step
    for match in lines:
        step = int(match["step"])
        expected = record[step - 1]
        assert match["loss"] == f"{sum(expected['losses']) / 2:.4f}"  # the mean over the accumulation window
        assert float(match["lr"]) == pytest.approx(expected["lr"], rel=1e-3)
        assert float(match["norm"]) == pytest.approx(expected["norm"], rel=1e-3)
        assert match["scale"] is None and match["skipped"] == "0"  # fp32: no loss scale
        assert float(match["ms"]) == pytest.approx(step_s * 1e3)
        assert float(match["sps"]) == pytest.approx(MICRO * 2 / step_s, abs=0.05)
        assert float(match["tps"]) == pytest.approx(MICRO * 2 * TOKENS / step_s, abs=0.5)
    stats = engine.telemetry.last_step
    assert (stats.step, stats.samples, stats.printed, stats.global_loss) == (5, 5 * MICRO * 2, False, None)
    assert stats.step_time_s == pytest.approx(step_s)
    assert float(stats.loss) == pytest.approx(sum(record[4]["losses"]) / 2)


def test_fp16_line_shows_the_loss_scale_and_skipped_steps(capsys):
    clock = FakeClock()
    engine = make_engine(config(steps_per_print=1, fp16={"enabled": True, "initial_scale_power": 8}), clock)
    train(engine, 2)
    lines = step_lines(capsys.readouterr().out)
    assert [m["scale"] for m in lines] == ["256", "256"]
    assert [m["tps"] for m in lines] == [None, None]  # tokens/s only after set_tokens_per_sample
    assert all(m["skipped"] == str(engine.skipped_steps) for m in lines)


def test_no_line_when_steps_per_print_exceeds_the_steps(capsys):
    engine = make_engine(config(steps_per_print=100, wall_clock_breakdown=True), FakeClock())
    train(engine, 5)
    assert capsys.readouterr().out == ""
    assert engine.telemetry.last_step.step == 5


def test_step_time_excludes_gaps_after_restart_window_and_evaluation_forwards(capsys):
    clock = FakeClock()
    engine = make_engine(config(steps_per_print=1), clock)
    train(engine, 1)
    clock.advance(100.0)  # e.g. a checkpoint save
    engine.telemetry.restart_window()
    with torch.no_grad():
        engine(torch.zeros(MICRO, IN, device=engine.device))  # evaluation: not a training forward
    train(engine, 1)
    step_s = FWD_S + BWD_S + REDUCE_S + STEP_S
    assert engine.telemetry.last_step.step_time_s == pytest.approx(step_s)  # neither the gap nor the eval forward
    clock.advance(1.0)  # loading data between steps counts
    train(engine, 1)
    assert engine.telemetry.last_step.step_time_s == pytest.approx(step_s + 1.0)
    assert len(step_lines(capsys.readouterr().out)) == 3


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "128"])
def test_set_tokens_per_sample_rejects_bad_values(bad):
    engine, *_ = tachyon.initialize(model=make_model(), config=config())
    with pytest.raises(ValueError, match="tokens_per_sample must be an int >= 1 or None"):
        engine.set_tokens_per_sample(bad)


# --------------------------------------------------------------------------- wall-clock breakdown


def test_wall_clock_breakdown_line_per_step_means(capsys):
    engine = make_engine(config(gas=2, steps_per_print=2, wall_clock_breakdown=True), FakeClock())
    train(engine, 4)
    out = capsys.readouterr().out.splitlines()
    breakdown = [line for line in out if line.startswith("time (ms)")]
    expected = (f"time (ms) | forward: {2 * FWD_S * 1e3:.2f} | backward: {2 * BWD_S * 1e3:.2f} | "
                f"reduce: {2 * REDUCE_S * 1e3:.2f} | step: {STEP_S * 1e3:.2f}")
    assert breakdown == [expected, expected]
    assert [i for i, line in enumerate(out) if line.startswith("time (ms)")] == [1, 3]  # each after its step line
    assert engine.telemetry.last_step.breakdown_ms == pytest.approx(
        {"forward": 20.0, "backward": 60.0, "reduce": 4.0, "step": 4.0})


# --------------------------------------------------------------------------- monitor events


def read_csv(path):
    with path.open(newline="") as handle:
        return list(csv.reader(handle))


def test_csv_monitor_through_the_engine_in_deepspeeds_layout(tmp_path, capsys):
    csv_section = {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}
    cfg = config(steps_per_print=100, wall_clock_breakdown=True, csv_monitor=csv_section,
                 fp16={"enabled": True, "initial_scale_power": 8})
    engine = make_engine(cfg, FakeClock())
    record = train(engine, 3)
    run = tmp_path / "job"
    names = ["train_loss", "lr", "loss_scale", "elapsed_time_ms_forward", "elapsed_time_ms_backward",
             "elapsed_time_ms_backward_inner", "elapsed_time_ms_backward_allreduce", "elapsed_time_ms_step"]
    assert sorted(p.name for p in run.iterdir()) == sorted(f"Train_Samples_{n}.csv" for n in names)
    samples = [str(MICRO * s) for s in (1, 2, 3)]  # x-axis: global samples after the step
    tables = {n: read_csv(run / f"Train_Samples_{n}.csv") for n in names}
    for name, rows in tables.items():
        assert rows[0] == ["step", name] and [r[0] for r in rows[1:]] == samples, (name, rows)
    loss = [float(r[1]) for r in tables["train_loss"][1:]]
    assert loss == pytest.approx([r["losses"][0] for r in record])
    assert [float(r[1]) for r in tables["lr"][1:]] == pytest.approx([r["lr"] for r in record])
    assert [float(r[1]) for r in tables["loss_scale"][1:]] == [256.0] * 3
    per_step_ms = {"forward": FWD_S, "backward": BWD_S + REDUCE_S, "backward_inner": BWD_S,
                   "backward_allreduce": REDUCE_S, "step": STEP_S}
    for phase, seconds in per_step_ms.items():
        values = [float(r[1]) for r in tables[f"elapsed_time_ms_{phase}"][1:]]
        assert values == pytest.approx([seconds * 1e3] * 3), phase
    assert capsys.readouterr().out == ""


def test_monitor_off_writes_no_files(tmp_path):
    engine = make_engine(config(csv_monitor={"enabled": False, "output_path": str(tmp_path)}), FakeClock())
    train(engine, 2)
    assert list(tmp_path.iterdir()) == [] and not engine.telemetry.monitor.enabled


# --------------------------------------------------------------------------- two ranks


def _two_rank_run() -> dict:
    import torch.distributed as dist

    torch.manual_seed(0)
    rank = dist.get_rank()
    clock = FakeClock()
    engine = make_engine(config(gas=2, steps_per_print=2, world=2), clock)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        record = train(engine, 4, rank=rank)
    return {"out": out.getvalue(), "means": [sum(r["losses"]) / 2 for r in record],
            "global_loss": engine.telemetry.last_step.global_loss}


@pytest.mark.distributed
def test_two_ranks_only_rank_zero_prints_the_rank_averaged_loss():
    rank0, rank1 = run_distributed(_two_rank_run, 2, timeout=120)
    assert rank1["out"] == ""
    lines = step_lines(rank0["out"])
    assert [int(m["step"]) for m in lines] == [2, 4]
    assert rank0["means"] != pytest.approx(rank1["means"])  # the ranks saw different data
    for match in lines:
        step = int(match["step"])
        average = (rank0["means"][step - 1] + rank1["means"][step - 1]) / 2
        assert match["loss"] == f"{average:.4f}" != f"{rank0['means'][step - 1]:.4f}"
    assert rank0["global_loss"] == pytest.approx(rank1["global_loss"]) == pytest.approx(
        (rank0["means"][3] + rank1["means"][3]) / 2)
    assert float(lines[0]["sps"]) == pytest.approx(4 * MICRO / (2 * (FWD_S + BWD_S + REDUCE_S) + STEP_S), abs=0.05)

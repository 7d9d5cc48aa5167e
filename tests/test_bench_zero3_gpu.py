"""benchmarks/bench_zero3.py's GPU part, run on the CPU (``--gpu-smoke``): the step-time rows
against FSDP2 and the largest-model sweep, whose made-up memory limit makes it grow, bisect and
free as it would on a device."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench_zero3

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero3_gpu_smoke")
    env = {**os.environ, "TACHYON_BENCH_OUT": str(out)}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_zero3.py"), "--gpu-smoke"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {kind: list(csv.DictReader((out / name).open())) for kind, name in bench_zero3.GPU_CSV.items()}
    return rows, done.stdout


@pytest.mark.distributed
def test_step_time_rows_compare_every_variant_with_fsdp2(smoke):
    rows, stdout = smoke
    step = {r["variant"]: r for r in rows["step"]}
    assert list(step) == [name for name, *_ in bench_zero3.STEP_VARIANTS]
    reference = float(step["FSDP2"]["median_ms"])
    for name, row in step.items():
        assert row["error"] == "", (name, row["error"])
        assert int(row["steps"]) >= 2 and float(row["median_ms"]) > 0, row
        assert float(row["x_fsdp2"]) == pytest.approx(float(row["median_ms"]) / reference)
        assert int(row["params"]) == int(step["FSDP2"]["params"])
    # ZeRO-Offload keeps the fp32 masters and Adam's moments (12 bytes per parameter after a step) on the host
    params = int(step["FSDP2"]["params"])
    assert float(step["stage 3"]["host_GB"]) == 0
    for name in ("stage 3 + offload_optimizer", "stage 3 + offload_optimizer + offload_param"):
        assert float(step[name]["host_GB"]) * 1e9 >= 12 * params
    assert "## ms per step against FSDP2" in stdout


@pytest.mark.distributed
def test_the_sweep_finds_the_largest_size_under_the_fake_limit_and_frees_every_try(smoke):
    rows, _ = smoke
    tries, largest = rows["try"], {r["mode"]: r for r in rows["largest"]}
    assert list(largest) == [mode for mode, _ in bench_zero3.SWEEP_MODES]
    for mode, offload in bench_zero3.SWEEP_MODES:
        mine = [r for r in tries if r["mode"] == mode]
        limit = bench_zero3.SMOKE_FILL * bench_zero3.SMOKE_CAPACITY[offload]
        for r in mine:  # each try completed exactly when its model states fit under the limit
            fits = bench_zero3.BYTES_PER_PARAM[offload] * int(r["params"]) <= limit
            assert r["status"] == ("ok" if fits else "out of memory"), r
            assert float(r["leaked_MB"]) == 0, r  # the engine, model and states of a try are all freed
        ok = [int(r["layers"]) for r in mine if r["status"] == "ok"]
        failed = [int(r["layers"]) for r in mine if r["status"] != "ok"]
        summary = largest[mode]
        assert failed and int(summary["largest_layers"]) == max(ok) == min(failed) - 1, (mode, mine)
        assert int(summary["failed_layers"]) == min(failed)
        assert int(summary["tries"]) == len(mine)
        assert summary["stopped_by"] == f"out of memory at {min(failed)} layers"
        if offload:
            assert float(summary["host_GB"]) > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_part_refuses_without_cuda():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench_zero3.main(["--gpu", "--quick"])


def _sweep(monkeypatch, tmp_path, fits_layers: int, capacity_layers: int, *, seconds: float = 0.0,
           budget: float = 600.0, quick: bool = False) -> tuple[dict, list[int]]:
    """largest_section's search alone: tries answered by a rule (ok up to ``fits_layers``), a
    capacity of ``capacity_layers`` layers' model states at 16 bytes per parameter."""
    monkeypatch.setenv("TACHYON_BENCH_OUT", str(tmp_path))
    monkeypatch.setattr(bench_zero3, "_param_counts", lambda size: (0, 1000))
    monkeypatch.setattr(bench_zero3, "SMOKE_CAPACITY", {False: 16 * 1000 * capacity_layers})
    tried: list[int] = []

    def fake_try(run, mode, offload, size, params, before):
        tried.append(size.layers)
        row = {"mode": mode, "layers": size.layers, "params": params, "peak_device_GB": None, "host_GB": 0.0,
               "seconds": seconds, "status": "ok" if size.layers <= fits_layers else "out of memory"}
        run.emit("try", row)
        return row

    monkeypatch.setattr(bench_zero3, "_try_size", fake_try)
    run = bench_zero3.GpuRun(smoke=True, quick=quick, budget=budget)
    monkeypatch.setattr(run, "allocated", lambda collect=True: 0)
    return bench_zero3.largest_section(run, "stage 3", False, run.deadline), tried


def test_sweep_doubles_then_bisects_and_stops_where_memory_runs_out(monkeypatch, tmp_path):
    summary, tried = _sweep(monkeypatch, tmp_path, fits_layers=41, capacity_layers=100)
    assert tried == [33, 66, 49, 41, 45, 43, 42]  # start at a third of the capacity, double, bisect
    assert (summary["largest_layers"], summary["failed_layers"]) == (41, 42)
    assert summary["stopped_by"] == "out of memory at 42 layers"
    summary, tried = _sweep(monkeypatch, tmp_path, fits_layers=41, capacity_layers=100, quick=True)
    assert tried == [33, 66, 49, 41, 45]  # --quick: stops once the gap is at most 1/8 of the size
    assert (summary["largest_layers"], summary["failed_layers"]) == (41, 45)


def test_sweep_shrinks_from_a_start_that_fails_and_stops_at_the_capacity(monkeypatch, tmp_path):
    summary, tried = _sweep(monkeypatch, tmp_path, fits_layers=5, capacity_layers=100)
    assert tried[:3] == [33, 16, 8] and summary["largest_layers"] == 5 and summary["failed_layers"] == 6
    summary, tried = _sweep(monkeypatch, tmp_path, fits_layers=1000, capacity_layers=100)
    assert tried == [33, 66, 100] and summary["largest_layers"] == 100 and summary["failed_layers"] is None
    assert summary["stopped_by"].startswith("101 layers would need more than the made-up capacity")


def test_sweep_stops_before_a_try_that_would_not_finish_in_the_budget(monkeypatch, tmp_path):
    summary, tried = _sweep(monkeypatch, tmp_path, fits_layers=1000, capacity_layers=100, seconds=5.0, budget=8.0)
    assert tried == [33] and summary["largest_layers"] == 33
    assert summary["stopped_by"].startswith("time budget (the next try, 66 layers")

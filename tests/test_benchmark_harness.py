"""benchmarks/common.py: timing quantiles, tables and CSV rows that say where they came from."""

from __future__ import annotations

import csv

from benchmarks.common import GPU_PEAKS, bench, format_table, gpu_peaks, write_csv


def test_bench_reports_ordered_quantiles():
    t = bench(lambda: sum(range(2000)), warmup=2, rep=20, device="cpu")
    assert 0 < t.p20_ms <= t.median_ms <= t.p80_ms
    assert t.rate(1e6) > 0


def test_csv_rows_carry_device_versions_commit_and_date(tmp_path):
    path = tmp_path / "out.csv"
    write_csv(path, [{"variant": "a", "median_ms": 1.5}], "demo")
    write_csv(path, [{"variant": "b", "median_ms": 2.5}], "demo")
    rows = list(csv.DictReader(path.open()))
    assert [r["variant"] for r in rows] == ["a", "b"]
    for key in ("benchmark", "device", "torch", "triton", "commit", "date"):
        assert rows[0][key], key


def test_table_and_peaks():
    table = format_table([{"shape": "4x8", "ms": 1.23456}])
    assert table.splitlines()[0] == "| shape | ms    |"
    assert "1.235" in table
    assert gpu_peaks("NVIDIA H100 80GB HBM3") is GPU_PEAKS["H100"]
    assert gpu_peaks("Some Other GPU") is None


def test_warm_mode_runs_the_callable_and_measures_nothing(monkeypatch, tmp_path):
    import math

    from benchmarks import common

    calls = []
    monkeypatch.setenv("TACHYON_BENCH_WARM", "1")
    monkeypatch.setenv("TACHYON_BENCH_OUT", str(tmp_path))
    monkeypatch.setattr(common, "_do_bench", lambda fn: (_ for _ in ()).throw(AssertionError("measured in warm mode")))
    t = common.bench(lambda: calls.append(1), device="cuda")
    assert len(calls) == common.WARM_CALLS
    assert math.isnan(t.median_ms) and t.graph_ms is None and t.host_ms is None and "warm" in t.note
    assert math.isnan(common.measure_matmul_peak()) and math.isnan(common.measure_copy_bandwidth())
    assert common.peak_memory(lambda: calls.append(2)) == 0 and 2 not in calls
    common.write_csv(tmp_path / "x.csv", [{"a": 1}], "demo")
    assert not (tmp_path / "x.csv").exists()
    monkeypatch.setenv("TACHYON_BENCH_WARM", "0")
    assert not common.warm_mode()
    t = common.bench(lambda: calls.append(3), warmup=1, rep=3, device="cpu")
    assert calls.count(3) == 4 and t.median_ms >= 0


def test_bench_never_captures_an_already_graphed_callable(monkeypatch):
    from benchmarks import common

    captured, hosted = [], []
    monkeypatch.delenv("TACHYON_BENCH_WARM", raising=False)
    monkeypatch.setattr(common, "_do_bench", lambda fn: (1.0, 2.0, 3.0))
    monkeypatch.setattr(common, "_graph_time", lambda fn: captured.append(fn) or (0.5, ""))
    monkeypatch.setattr(common, "host_time", lambda fn: hosted.append(fn) or 0.25)
    fn = lambda: None  # noqa: E731
    t = common.bench(fn, device="cuda", graph=common.ALREADY_GRAPHED)
    assert captured == [] and t.graph_ms is None and common.ALREADY_GRAPHED in t.note
    assert (t.median_ms, t.host_ms) == (2.0, 0.25)
    t = common.bench(fn, device="cuda", graph="a reason", host="calls synchronize")
    assert captured == [] and t.host_ms is None and "a reason" in t.note and "calls synchronize" in t.note
    t = common.bench(fn, device="cuda")
    assert captured == [fn] and t.graph_ms == 0.5 and t.note == ""
    assert t.columns()["graph_ms"] == 0.5


def test_stream_prints_and_writes_each_row_as_it_comes(monkeypatch, tmp_path, capsys):
    from benchmarks import common

    monkeypatch.delenv("TACHYON_BENCH_WARM", raising=False)
    monkeypatch.setenv("TACHYON_BENCH_OUT", str(tmp_path))
    out = common.Stream("s.csv", "demo", columns=["variant", "median_ms", "note"])
    out.add({"variant": "a", "median_ms": 1.5})
    first = capsys.readouterr().out.splitlines()
    assert first[0] == "row | variant | median_ms | note |" and first[-1] == "row | a | 1.5 |  |"
    rows = list(csv.DictReader((tmp_path / "s.csv").open()))  # on disk before the next row
    assert [(r["variant"], r["median_ms"], r["note"]) for r in rows] == [("a", "1.5", "")]
    out.add({"variant": "b", "median_ms": 2.0, "note": "n"})
    assert capsys.readouterr().out.strip() == "row | b | 2 | n |"
    assert [r["note"] for r in csv.DictReader((tmp_path / "s.csv").open())] == ["", "n"]
    import pytest

    with pytest.raises(ValueError, match="extra"):
        out.add({"variant": "c", "extra": 1})


def test_commit_comes_from_the_environment_when_set(monkeypatch):
    from benchmarks import common

    monkeypatch.setenv("TACHYON_COMMIT", "abc1234")
    assert common.machine_info()["commit"] == "abc1234"
    monkeypatch.delenv("TACHYON_COMMIT")
    assert common.machine_info()["commit"] not in ("", "abc1234")


def test_gpu_sh_dry_run_warms_every_step_then_times_them_in_order(tmp_path):
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TACHYON_COMMIT": "feed123", "PYTHON": "python3"}
    run = subprocess.run(["bash", str(root / "benchmarks" / "gpu.sh"), str(tmp_path / "out"), "--dry-run"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("dry run: commit feed123, budget 500 s")
    warm = [line.split("]")[0].strip(" [") for line in lines if line.startswith("  [") and " limit " not in line]
    assert {"smoke-bf16-0", "smoke-fp16-2", "sweep-bert-s128", "sweep-gpt-s2048", "sweep-mlp-norm", "te_layer",
            "profile", "inference", "transformer_kernel", "attention", "layernorm", "mlp"} <= set(warm)
    timed = [line.split("]")[0].strip(" [") for line in lines if " limit " in line]
    skipped = [line.split()[1].rstrip(":") for line in lines if line.startswith("skipped ")]
    assert timed + skipped == ["smoke", "te_layer", "profile", "sweep", "inference", "transformer_kernel",
                               "attention", "layernorm", "mlp"]
    assert "warm phase (cap 120 s)" in run.stdout
    assert not (tmp_path / "out" / "summary.md").exists()  # a dry run runs and writes nothing


def test_sweep_times_the_triton_kernels_not_the_auto_choice():
    """Under backend "auto", CUDA runs torch's SDPA / F.layer_norm at some shapes (kernels/dispatch.py):
    every tachyon op call in the sweep must name its backend, or a forced config times torch's kernel."""
    import ast
    from pathlib import Path

    source = (Path(__file__).resolve().parents[1] / "benchmarks" / "bench_sweep.py").read_text()
    calls = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id in ("attention", "layer_norm", "mlp")]
    assert len(calls) >= 4
    for call in calls:
        backend = [kw.value.value for kw in call.keywords if kw.arg == "backend"]
        assert backend == ["triton"], f"line {call.lineno}: {call.func.id}(...) without backend='triton'"
    assert "F.scaled_dot_product_attention" in source and "F.layer_norm" in source  # the torch reference rows

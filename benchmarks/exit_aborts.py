"""Exit aborts: run real multi-process jobs many times and count non-zero exits and aborts.

    python benchmarks/exit_aborts.py                      # 100 launch-script runs and 20 `tachyon train`
                                                          # runs, each with 2 and with 4 processes
    python benchmarks/exit_aborts.py --launch-runs 10 --train-runs 2 --procs 2 --out /tmp/x.md

A process group left to the interpreter's finalization can abort a rank after its work is done
(torch 2.13, gloo: "terminate called without an active exception"). tachyon tears its groups down
(`tachyon.shutdown_distributed`, run at exit by `init_distributed`); this script shows it over many
runs. Jobs: tests/parallel/_launch_train_script.py under `python -m tachyon.parallel.launch` (a
script that simply returns), and `tachyon train examples/train_ci.json --steps 30` (the main job's CI
config, shortened; checkpoints). Writes a markdown tally (default benchmarks/results/<date>-cpu-exit-aborts.md) and
exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ABORT_MARKERS = ("terminate called", "SIGABRT", "exitcode: -6")


def _jobs(procs: int, scratch: Path) -> dict[str, list[str]]:
    python = sys.executable
    return {
        "launch script": [python, "-m", "tachyon.parallel.launch", "--nproc-per-node", str(procs),
                          str(REPO / "tests" / "parallel" / "_launch_train_script.py")],
        "tachyon train": [python, "-m", "tachyon", "train", str(REPO / "examples" / "train_ci.json"),
                          "--steps", "30", "--nproc", str(procs), "--no-progress", "--output-dir", str(scratch / "run")],
    }


def run_many(name: str, cmd: list[str], runs: int, scratch: Path, timeout: float) -> dict:
    failures, aborts, seconds, first_failure = 0, 0, [], None
    for index in range(runs):
        for leftover in (scratch / "run").glob("*") if (scratch / "run").exists() else []:
            subprocess.run(["rm", "-rf", str(leftover)], check=False)
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=scratch)
            code, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as expired:
            code, output = "timeout", f"{expired.stdout or ''}{expired.stderr or ''}"
        seconds.append(time.perf_counter() - start)
        aborted = any(marker in output for marker in ABORT_MARKERS)
        if code != 0 or aborted:
            failures += 1
            aborts += aborted
            if first_failure is None:
                first_failure = f"run {index + 1}: exit {code}\n" + output[-3000:]
        print(f"\r{name}: {index + 1}/{runs} runs, {failures} failed, {aborts} aborted", end="", flush=True)
    print()
    return {"runs": runs, "failures": failures, "aborts": aborts, "median_s": sorted(seconds)[len(seconds) // 2],
            "first_failure": first_failure}


def _report(rows: list[tuple[str, int, dict]], args: argparse.Namespace, elapsed: float) -> str:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    lines = [
        f"# Exit aborts over repeated multi-process runs ({datetime.date.today().isoformat()}, CPU, gloo)",
        "",
        f"Measured by `python benchmarks/exit_aborts.py` (commit {commit or 'unknown'}): torch {torch.__version__}, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPU cores, {elapsed / 60:.1f} min in all. "
        "A run fails if it exits non-zero or prints an abort marker "
        f"({', '.join(repr(m) for m in ABORT_MARKERS)}).",
        "",
        "| job | processes | runs | failed | aborted | median s/run |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, procs, tally in rows:
        lines.append(f"| {name} | {procs} | {tally['runs']} | {tally['failures']} | {tally['aborts']} | "
                     f"{tally['median_s']:.1f} |")
    for name, procs, tally in rows:
        if tally["first_failure"]:
            lines += ["", f"First failure of {name} with {procs} processes:", "", "```", tally["first_failure"], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launch-runs", type=int, default=100)
    parser.add_argument("--train-runs", type=int, default=20)
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=None, help="markdown file (default: benchmarks/results/...)")
    args = parser.parse_args(argv)
    out = args.out or REPO / "benchmarks" / "results" / f"{datetime.date.today().isoformat()}-cpu-exit-aborts.md"
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tachyon-exit-") as tmp:
        scratch = Path(tmp)
        for procs in args.procs:
            for name, cmd in _jobs(procs, scratch).items():
                runs = args.launch_runs if name == "launch script" else args.train_runs
                if runs > 0:
                    rows.append((name, procs, run_many(f"{name} x{procs}", cmd, runs, scratch, args.timeout)))
    report = _report(rows, args, time.perf_counter() - started)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(report)
    return 1 if any(tally["failures"] for _, _, tally in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

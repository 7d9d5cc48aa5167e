"""Time to the same validation loss: compare `tachyon train` runs by their own CSVs.

    python examples/compare_runs.py runs/dense runs/pld [runs/other ...] [--target LOSS ...]

The first run is the reference: its final validation loss is the target (or each ``--target``). For
every run the table gives the first evaluation at or below the target, and the training time
spent up to that step, from the run's metrics.csv: wall seconds (the engine's step times, so
evaluations and checkpoints are left out) and CPU seconds (every rank's, summed). A run that
never reaches the target gets its final loss, how far above the target it ended, and the
training time of the whole run.

A crossing is only seen at an evaluation, so its step is exact to ``eval_interval`` steps
(examples/train_bert_pld.json evaluates every 10).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tachyon.train.report import read_metrics, time_to_loss


def _load(run: Path) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    for name in ("metrics.csv", "validation.csv"):
        if not (run / name).is_file():
            raise SystemExit(f"compare_runs: {run / name} not found; give the output directories of `tachyon train`")
    return read_metrics(run / "metrics.csv"), read_metrics(run / "validation.csv")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="output directories; the first is the reference")
    parser.add_argument("--target", type=float, action="append", default=None,
                        help="validation loss to reach; repeat for several tables (default: the first run's final "
                             "validation loss)")
    args = parser.parse_args(argv)
    runs = [(run, *_load(run)) for run in args.runs]
    for target in args.target or [None]:
        _table(runs, target)
    print("wall x, CPU x: the reference's time to the target divided by the run's (above 1: the run got there sooner)")
    return 0


def _table(runs: list[tuple[Path, list, list]], given: float | None) -> None:
    reference = runs[0]
    target = given if given is not None else reference[2][-1]["loss"]
    base = time_to_loss(reference[1], reference[2], target)
    print(f"target validation loss: {target:.3f} nats/token"
          + ("" if given is not None else f" (the final loss of {reference[0]})"))
    header = f"{'run':<28} {'steps':>6} {'wall s':>8} {'CPU s':>8} {'wall x':>7} {'CPU x':>7}  final loss"
    print(header + "\n" + "-" * len(header))
    for run, metrics, validation in runs:
        hit = time_to_loss(metrics, validation, target)
        final = validation[-1]
        end = f"{final['loss']:.3f} at step {int(final['step'])}"
        if hit is None:
            wall, cpu = sum(m["step_time_s"] for m in metrics), sum(m.get("cpu_s", float("nan")) for m in metrics)
            print(f"{str(run):<28} {'never':>6} {'':>8} {'':>8} {'':>7} {'':>7}  {end}, "
                  f"{final['loss'] - target:+.3f} from the target (whole run: {wall:.1f} wall s, {cpu:.1f} CPU s)")
            continue
        speedup = ("", "") if base is None else (f"{base['step_time_s'] / hit['step_time_s']:.2f}",
                                                  f"{base['cpu_s'] / hit['cpu_s']:.2f}")
        print(f"{str(run):<28} {hit['step']:>6} {hit['step_time_s']:>8.1f} {hit['cpu_s']:>8.1f} {speedup[0]:>7} "
              f"{speedup[1]:>7}  {end}")
    print()


if __name__ == "__main__":
    sys.exit(main())

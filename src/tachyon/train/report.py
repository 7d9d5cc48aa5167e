"""What a ``tachyon train`` run writes and prints at its end: metrics.csv (one row per step),
validation.csv (one row per evaluation), the final table and summary.txt.

The table has one row per evaluation (every ``eval_interval`` steps and the last step): the
training loss averaged over the steps since the previous row, the validation loss and
perplexity, the learning rate and tokens/s. summary.txt says what was trained and how, then the
result: the validation loss against the unigram baseline (nats and perplexity), top-1 accuracy,
and the fill-mask predictions (BERT) or generated lines (GPT).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

__all__ = ["METRIC_COLUMNS", "VALIDATION_COLUMNS", "RunLog", "final_table", "read_metrics", "summary_text",
           "time_to_loss", "write_rows"]

METRIC_COLUMNS = ("step", "loss", "lr", "grad_norm", "loss_scale", "samples_per_s", "tokens_per_s", "step_time_s",
                  "cpu_s")
"""metrics.csv's columns (a run with progressive layer drop adds ``pld_theta``). ``step_time_s``:
the step's wall time; ``cpu_s``: the CPU seconds every rank spent in it, summed."""
VALIDATION_COLUMNS = ("step", "loss", "accuracy", "baseline_loss", "baseline_accuracy")


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """The rows of a metrics.csv or validation.csv as dicts of floats (``step`` as int)."""
    with Path(path).open(newline="") as handle:
        return [{k: (int(v) if k == "step" else float(v)) for k, v in row.items()} for row in csv.DictReader(handle)]


def write_rows(path: Path, rows: list[dict[str, float]], first_step: int,
               columns: tuple[str, ...]) -> list[dict[str, float]]:
    """Append ``rows`` to the CSV at ``path``, dropping earlier rows at or after ``first_step`` (a
    run that resumed from an older checkpoint replaces them); returns the whole table. A column
    an earlier row lacks (a file from an older run, PLD turned on at a resume) is written as nan."""
    previous = [r for r in read_metrics(path) if r["step"] < first_step] if path.is_file() else []
    table = previous + rows
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in table:
            writer.writerow(_formatted(row, columns))
    return table


class CsvLog:
    """One CSV file written row by row (flushed after each), so a run that is killed keeps every
    row written so far. Opening it keeps the existing rows of steps before ``first_step`` (a run
    resumed from an older checkpoint drops the later ones, which it is about to redo) and rewrites
    them under ``columns`` (a column an earlier row lacks: nan)."""

    def __init__(self, path: Path, first_step: int, columns: tuple[str, ...]) -> None:
        self.path, self.columns = path, columns
        write_rows(path, [], first_step, columns)

    def append(self, row: dict[str, float]) -> None:
        with self.path.open("a", newline="") as handle:
            csv.DictWriter(handle, fieldnames=self.columns).writerow(_formatted(row, self.columns))
            handle.flush()

    def table(self) -> list[dict[str, float]]:
        return read_metrics(self.path)


class RunLog:
    """metrics.csv and validation.csv of a run (`CsvLog` each; rank 0 only)."""

    def __init__(self, output_dir: Path, first_step: int, columns: tuple[str, ...] = METRIC_COLUMNS) -> None:
        self.metrics = CsvLog(output_dir / "metrics.csv", first_step, columns)
        self.validation = CsvLog(output_dir / "validation.csv", first_step, VALIDATION_COLUMNS)


def _formatted(row: dict[str, float], columns: tuple[str, ...]) -> dict[str, Any]:
    return {k: (row[k] if k == "step" else f"{row.get(k, math.nan):.6g}") for k in columns}


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def final_table(metrics: list[dict[str, float]], validation: list[dict[str, float]]) -> str:
    """One line per evaluation: step, mean training loss since the previous row, validation loss
    and perplexity, learning rate and mean tokens/s (see the module docstring)."""
    header = f"{'step':>6}  {'train loss':>10}  {'val loss':>8}  {'val ppl':>8}  {'lr':>9}  {'tokens/s':>9}"
    lines = [header, "-" * len(header)]
    previous = 0
    for row in validation:
        step = int(row["step"])
        window = [m for m in metrics if previous < m["step"] <= step]
        previous = step
        lr = window[-1]["lr"] if window else math.nan
        lines.append(f"{step:>6}  {_mean([m['loss'] for m in window]):>10.3f}  {row['loss']:>8.3f}  "
                     f"{math.exp(row['loss']):>8.1f}  {lr:>9.2e}  {_mean([m['tokens_per_s'] for m in window]):>9.0f}")
    return "\n".join(lines) + "\n"


def _mib(value: float) -> str:
    return f"{value / 2**20:.1f}"


def summary_text(job: dict[str, Any], validation: dict[str, Any] | None, samples: list[str],
                 memory: list[dict[str, float]], files: list[str]) -> str:
    """summary.txt: ``job`` (lines describing the run, already formatted), the validation result
    (model and baseline :class:`~tachyon.train.evaluate.Evaluation`, the split's name), the
    fill-mask / generation lines, memory per rank and the files written."""
    lines = list(job["lines"])
    if validation is not None:
        model, baseline = validation["model"], validation["baseline"]
        gap = baseline.loss - model.loss
        verdict = "below" if gap > 0 else "ABOVE"
        lines += [
            f"validation ({validation['what']}, {model.tokens} scored tokens):",
            f"  model            {model.loss:.3f} nats/token, perplexity {model.perplexity:7.1f}, "
            f"top-1 accuracy {100 * model.accuracy:4.1f} %",
            f"  unigram baseline {baseline.loss:.3f} nats/token, perplexity {baseline.perplexity:7.1f}, "
            f"top-1 accuracy {100 * baseline.accuracy:4.1f} %   (token frequencies alone, no context)",
            f"  the model is {abs(gap):.3f} nats/token {verdict} the baseline "
            f"(perplexity {baseline.perplexity / model.perplexity:.2f}x {'lower' if gap > 0 else 'higher'})",
        ]
    lines += samples
    lines.append("memory per rank (MiB):")
    for rank, entry in enumerate(memory):
        lines.append(f"  rank {rank}: " + ", ".join(f"{k} {_mib(v)}" for k, v in entry.items()))
    lines += files
    return "\n".join(lines) + "\n"


def time_to_loss(metrics: list[dict[str, float]], validation: list[dict[str, float]],
                 target: float) -> dict[str, float] | None:
    """The first evaluation whose validation loss is at or below ``target``, and what the run had
    spent on training up to that step: ``{"step", "loss", "step_time_s", "cpu_s"}`` (the sums of
    metrics.csv's columns over steps 1..step; evaluations and checkpoints are not in them).
    None when no evaluation reaches ``target``. A crossing is only seen at an evaluation, so
    ``step`` is an upper bound within ``eval_interval`` steps."""
    for row in validation:
        if row["loss"] <= target:
            step = int(row["step"])
            done = [m for m in metrics if m["step"] <= step]
            if [int(m["step"]) for m in done] != list(range(1, step + 1)):
                raise ValueError(f"metrics.csv does not hold every step 1..{step}; cannot sum the time to step {step}")
            return {"step": step, "loss": row["loss"], "step_time_s": sum(m["step_time_s"] for m in done),
                    "cpu_s": sum(m.get("cpu_s", math.nan) for m in done)}
    return None

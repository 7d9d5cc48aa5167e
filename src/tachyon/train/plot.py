"""loss.png of a ``tachyon train`` run, drawn with matplotlib.

    plot_training(path, rows, validation=[(50, 5.9), (100, 5.4)], baseline=6.03, title="bert, 2 x cpu")

``rows`` are metrics.csv rows (dicts with step, loss, lr, tokens_per_s). Three panels over the
step axis, one above the other:

1. loss (nats): each step's training loss (light), its moving average (dark), the validation
   loss at every evaluation (markers) and, when given, the unigram baseline (dashed): the loss
   of a model that ignores the context, so the gap below that line is what the model learned.
2. tokens/s of every step (light) and its moving average.
3. learning rate.

The figure is built with matplotlib's object API (``matplotlib.figure.Figure`` + the Agg canvas):
no pyplot state, no GUI backend, safe to call from any process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

__all__ = ["moving_average", "plot_training", "training_figure"]


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` finite values at each position (NaN before the first)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, recent = [], []
    for value in values:
        if math.isfinite(value):
            recent.append(value)
            if len(recent) > window:
                recent.pop(0)
        out.append(sum(recent) / len(recent) if recent else math.nan)
    return out


def plot_training(path: str | Path, rows: Sequence[dict[str, float]], *,
                  validation: Sequence[tuple[int, float]] = (), baseline: float | None = None,
                  title: str = "", baseline_label: str = "unigram baseline") -> Path:
    """Write the three-panel PNG (module docstring, 900 x 900 pixels) to ``path`` and return the path.

    ``rows``: one dict per step with "step", "loss", "tokens_per_s" and "lr" (non-empty);
    ``validation``: (step, loss) pairs; ``baseline``: a loss drawn as a horizontal line."""
    path = Path(path)
    training_figure(rows, validation=validation, baseline=baseline, title=title,
                    baseline_label=baseline_label).savefig(path)
    return path


def training_figure(rows: Sequence[dict[str, float]], *, validation: Sequence[tuple[int, float]] = (),
                    baseline: float | None = None, title: str = "", baseline_label: str = "unigram baseline"):
    """The ``matplotlib.figure.Figure`` that :func:`plot_training` saves (arguments alike)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not rows:
        raise ValueError("rows must hold at least one step to plot")
    steps = [int(r["step"]) for r in rows]
    loss = [float(r["loss"]) for r in rows]
    tokens = [float(r["tokens_per_s"]) for r in rows]
    lrs = [float(r["lr"]) for r in rows]
    window = max(1, min(25, len(rows) // 10))

    figure = Figure(figsize=(9, 9), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    loss_ax, tokens_ax, lr_ax = figure.subplots(3, 1, sharex=True, height_ratios=(3, 1.3, 1.3))
    if title:
        figure.suptitle(title)

    loss_ax.plot(steps, loss, color="tab:blue", alpha=0.3, linewidth=0.8, label="training loss (per step)")
    loss_ax.plot(steps, moving_average(loss, window), color="tab:blue", linewidth=2,
                 label=f"training loss ({window}-step mean)")
    if validation:
        loss_ax.plot([s for s, _ in validation], [v for _, v in validation], color="tab:orange", marker="o",
                     linewidth=2, label="validation loss")
    if baseline is not None:
        loss_ax.axhline(baseline, color="tab:red", linestyle="--", linewidth=1.5,
                        label=f"{baseline_label} ({baseline:.2f})")
    # the first steps' loss (ln(vocab) and up) would squash the part worth reading
    tail = [v for v in loss[len(loss) // 10:] if math.isfinite(v)] + [v for _, v in validation]
    if baseline is not None:
        tail.append(baseline)
    if tail:
        low, high = min(tail), max(tail)
        pad = 0.1 * (high - low) + 0.05
        loss_ax.set_ylim(low - pad, max(high + 3 * pad, min(max(v for v in loss if math.isfinite(v)), high + 1.0)))
    loss_ax.set_ylabel("loss (nats)")
    loss_ax.grid(True, alpha=0.3)
    loss_ax.legend(loc="upper right")

    tokens_ax.plot(steps, tokens, color="tab:green", alpha=0.3, linewidth=0.8)
    tokens_ax.plot(steps, moving_average(tokens, window), color="tab:green", linewidth=2)
    tokens_ax.set_ylabel("tokens/s")
    tokens_ax.grid(True, alpha=0.3)
    tokens_ax.ticklabel_format(axis="y", style="plain")

    lr_ax.plot(steps, lrs, color="tab:purple", linewidth=2)
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("step")
    lr_ax.grid(True, alpha=0.3)
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    return figure

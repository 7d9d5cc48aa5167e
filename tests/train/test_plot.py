"""loss.png: matplotlib draws the loss (per step and smoothed), the validation loss, the baseline,
tokens/s and the learning rate, with labelled axes and a legend, into a readable PNG."""

from __future__ import annotations

import math

import pytest
from matplotlib.image import imread

from tachyon.train.plot import moving_average, plot_training, training_figure


def _rows(n: int = 120) -> list[dict[str, float]]:
    return [{"step": s, "loss": 2.0 + 3.5 * math.exp(-s / 30) + 0.1 * math.sin(s),
             "tokens_per_s": 9000.0 + 300 * math.cos(s / 7), "lr": 1e-3 * min(1.0, s / 10) * (1 - s / (n + 1))}
            for s in range(1, n + 1)]


def test_the_figure_holds_every_series_with_labelled_axes():
    rows = _rows()
    rows[50]["loss"] = math.nan  # a gap, not a crash
    validation = [(40, 3.1), (80, 2.6), (120, 2.4)]
    figure = training_figure(rows, validation=validation, baseline=3.3, title="bert, 2 x cpu")
    loss_ax, tokens_ax, lr_ax = figure.axes
    assert figure.get_suptitle() == "bert, 2 x cpu"
    assert [ax.get_ylabel() for ax in figure.axes] == ["loss (nats)", "tokens/s", "learning rate"]
    assert lr_ax.get_xlabel() == "step"
    legend = [t.get_text() for t in loss_ax.get_legend().get_texts()]
    assert legend[:3] == ["training loss (per step)", "training loss (12-step mean)", "validation loss"]
    assert legend[3] == "unigram baseline (3.30)"
    per_step, smoothed, val_line, baseline = loss_ax.get_lines()
    assert list(per_step.get_xdata()) == list(range(1, 121))
    assert math.isnan(per_step.get_ydata()[50]) and not math.isnan(smoothed.get_ydata()[50])
    assert list(val_line.get_xdata()) == [40, 80, 120] and list(val_line.get_ydata()) == [3.1, 2.6, 2.4]
    assert list(baseline.get_ydata()) == [3.3, 3.3]
    low, high = loss_ax.get_ylim()
    assert low < 2.0 and 3.3 < high < 5.6, f"the y range {low:.2f}-{high:.2f} should show the tail, not step 1"
    assert list(tokens_ax.get_lines()[0].get_ydata()) == [r["tokens_per_s"] for r in rows]
    assert list(lr_ax.get_lines()[0].get_ydata()) == [r["lr"] for r in rows]


def test_plot_training_writes_a_png(tmp_path):
    path = plot_training(tmp_path / "loss.png", _rows(), validation=[(60, 2.7)], baseline=3.0)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = imread(path)
    assert pixels.shape[:2] == (900, 900)
    assert pixels[..., :3].std() > 0.05, "the image is blank"


def test_without_validation_or_baseline_and_with_one_step(tmp_path):
    figure = training_figure(_rows(1))
    assert len(figure.axes[0].get_lines()) == 2 and figure.axes[0].get_legend() is not None
    plot_training(tmp_path / "one.png", _rows(1))
    with pytest.raises(ValueError, match="at least one step"):
        plot_training(tmp_path / "none.png", [])


def test_moving_average():
    assert moving_average([1.0, 3.0, math.nan, 5.0], 2) == [1.0, 2.0, 2.0, 4.0]
    assert math.isnan(moving_average([math.nan, 1.0], 3)[0])
    with pytest.raises(ValueError, match="window must be >= 1"):
        moving_average([1.0], 0)

"""Evaluation plots: every series its own colour however many there are, the legend beside the axes, titles that say
what the plot covers; the reliability diagram's title keeps its ECE."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from matplotlib.colors import to_rgba

from specdistill.evaluation.report import (
    acceptance_by_position_figure,
    draft_length_hist_figure,
    plot_acceptance_by_position,
    series_styles,
)
from specdistill.losses.head_bce import expected_calibration_error, reliability_figure

FIGURES = [acceptance_by_position_figure, draft_length_hist_figure]


def report(num_drafts: int) -> dict:
    """The autoregressive baseline and `num_drafts` speculative entries, as report.json holds them."""
    entries = [{"name": "autoregressive", "counters": {"rounds": 0, "acceptance_by_position": [],
                                                      "draft_length_hist": [0]}}]  # fmt: skip
    for i in range(num_drafts):
        entries.append({
            "name": f"draft{i}/fixed_k4",
            "counters": {"rounds": 10, "acceptance_by_position": [0.9 - 0.01 * i, 0.8, None, 0.5],
                         "draft_length_hist": [0, 1, 2, 3, 4 + i]},
        })  # fmt: skip
    return {"settings": {"task": "arith", "split": "test", "num_prompts": 40}, "entries": entries}


@pytest.mark.parametrize("figure", FIGURES)
@pytest.mark.parametrize("num_drafts", [3, 12, 25])
def test_every_series_has_its_own_colour(figure, num_drafts):
    ax = figure(report(num_drafts)).axes[0]
    colours = [to_rgba(line.get_color()) for line in ax.lines]
    assert len(colours) == num_drafts and len(set(colours)) == num_drafts


@pytest.mark.parametrize("figure", FIGURES)
def test_the_legend_sits_beside_the_axes_and_the_title_names_task_split_and_prompts(figure):
    fig = figure(report(12))
    ax = fig.axes[0]
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= ax.get_window_extent().x1  # right of the data area, never over it
    assert len(ax.get_legend().get_texts()) == 12
    assert ax.get_title().endswith(": arith, test split, 40 prompts")


def test_a_saved_plot_holds_its_whole_legend(tmp_path: Path):
    fig = acceptance_by_position_figure(report(12))
    fig.canvas.draw()
    assert fig.axes[0].get_legend().get_window_extent().x1 <= fig.bbox.x1  # tight_layout made room for it
    assert plot_acceptance_by_position(report(12), tmp_path / "acceptance_by_position.png").stat().st_size > 0


def test_series_styles_keep_lines_apart_beyond_ten():
    assert {s["linestyle"] for s in series_styles(10)} == {"-"}
    assert [s["linestyle"] for s in series_styles(12)] == ["-"] * 10 + ["--"] * 2
    assert len({s["linestyle"] for s in series_styles(25)}) == 4


def test_the_reliability_diagram_title_keeps_its_ece():
    logits, labels = torch.randn(200), torch.rand(200)
    ece = float(expected_calibration_error(logits, labels, 10))
    title = (
        reliability_figure(logits, labels, 10, title="acceptance head, epoch 2, step 30").axes[0].get_title()
    )
    assert title == f"acceptance head, epoch 2, step 30 (ECE {ece:.3f})"
    assert (
        reliability_figure(logits, labels).axes[0].get_title()
        == f"acceptance head reliability (ECE {ece:.3f})"
    )

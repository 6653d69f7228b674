"""The diagnostics' plots: every draft's distribution overlaid on shared bins, one titled figure per quantity.

`plot_margins` draws the signed margins (agree side and disagree side in two panels), `plot_kl` the per-token KL on
log-spaced bins. Each histogram is normalised to the share of that draft's answer positions, so drafts evaluated on
the same positions compare bar by bar. Bare `Figure`s (Agg canvas): no pyplot global state.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from specdistill.diagnostics.positions import PositionDiagnostics

BINS = 40
KL_FLOOR = 1e-6  # per-token KL below this is drawn in the first bin (a log axis has no 0)


def _shares(values: torch.Tensor, total: int) -> list[float]:
    """Weights that make a histogram of `values` sum to their share of `total` positions."""
    return [1.0 / max(total, 1)] * values.numel()


def plot_margins(path: Path, drafts: Mapping[str, PositionDiagnostics], title: str) -> Path:
    """Overlaid histograms of each draft's signed margin: left where its argmax agrees with the target's
    (top-1 - top-2 logit), right where it disagrees (target token's logit - top logit)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    left, right = fig.subplots(1, 2)
    sides = (
        (left, True, "agrees with the target: top-1 - top-2 logit"),
        (right, False, "disagrees: target token's logit - top logit"),
    )
    for axis, agree, label in sides:
        chosen = {name: d.margin[d.agree == agree] for name, d in drafts.items()}
        values = torch.cat([v for v in chosen.values()]) if chosen else torch.zeros(0)
        if values.numel():
            low, high = float(values.min()), float(values.max())
            edges = torch.linspace(low, high if high > low else low + 1.0, BINS + 1).tolist()
            for name, side in chosen.items():
                if side.numel():
                    axis.hist(side.numpy(), bins=edges, weights=_shares(side, drafts[name].margin.numel()),
                              histtype="step", linewidth=1.6, label=f"{name} ({side.numel()})")  # fmt: skip
            axis.legend()
        else:
            axis.text(0.5, 0.5, "no positions", ha="center", va="center", transform=axis.transAxes)
        axis.set_xlabel(label)
        axis.set_ylabel("share of answer positions")
        axis.set_title("argmax " + ("agrees" if agree else "disagrees"))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_kl(path: Path, drafts: Mapping[str, PositionDiagnostics], title: str) -> Path:
    """Overlaid histograms of each draft's per-token KL(target || draft), log-spaced bins (values below
    `KL_FLOOR` in the first)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    axis = fig.subplots()
    clipped = {name: d.kl.clamp_min(KL_FLOOR) for name, d in drafts.items()}
    values = torch.cat(list(clipped.values()))
    low, high = float(values.min()), float(values.max())
    high = high if high > low else low * 10
    edges = torch.logspace(torch.log10(torch.tensor(low)), torch.log10(torch.tensor(high)), BINS + 1).tolist()
    for name, kl in clipped.items():
        median = float(kl.median())
        axis.hist(kl.numpy(), bins=edges, weights=_shares(kl, kl.numel()), histtype="step", linewidth=1.6,
                  label=f"{name} (median {median:.3g})")  # fmt: skip
    axis.set_xscale("log")
    axis.set_xlabel("per-token KL(target || draft), nats")
    axis.set_ylabel("share of answer positions")
    axis.set_title(title)
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_class_selection(path: Path, by_class: Mapping[str, Mapping[str, float]], title: str) -> Path:
    """Bars of the kept share of each token class (`class_counts`'s output), each labelled with its counts."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2))
    axis = fig.subplots()
    names = list(by_class)
    shares = [float(by_class[name]["kept_fraction"]) for name in names]
    bars = axis.bar(names, shares, color="tab:blue")
    for bar, name in zip(bars, names, strict=True):
        counts = by_class[name]
        axis.annotate(f"{counts['kept']} / {counts['kept'] + counts['dropped']}",
                      (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")  # fmt: skip
    axis.set_ylim(0, 1.1)
    axis.set_ylabel("kept share of the class's answer tokens")
    axis.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path

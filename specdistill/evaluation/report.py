"""Evaluation reports: one entry per run (autoregressive baseline, then draft x policy), JSON, table and plots.

`report.json` layout::

    {"settings": {...},
     "entries": [{"name": "autoregressive", "draft": null, "policy": null,
                  "metrics": {"acceptance_rate": ..., ..., "tokens_per_second": ..., "speedup": 1.0},
                  "task_metric": 0.41, "num_scored": 50,
                  "counters": {...DecodingStats.to_dict()...}}, ...]}

Metric names are exactly docs/METHODS.md section 0's; undefined metrics (e.g. the baseline's `acceptance_rate`)
are null.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from specdistill.decoding.stats import METRIC_NAMES, DecodingStats, speedup
from specdistill.utils.atomic import atomic_file, atomic_write_text

BASELINE_NAME = "autoregressive"
TABLE_COLUMNS: tuple[str, ...] = (*METRIC_NAMES, "speedup")


@dataclass
class ReportEntry:
    """One evaluated configuration.

    Attributes:
        name: "autoregressive" or "<draft>/<policy>".
        draft / policy: their names (None for the baseline).
        stats: summed decoding statistics over all prompts.
        task_metric: mean task score over the outputs that could be scored (None if none could).
        num_scored: outputs with a score.
        outputs: per prompt `{"example_id", "tokens", "text", "score"}` (kept out of report.json).
    """

    name: str
    draft: str | None
    policy: str | None
    stats: DecodingStats
    task_metric: float | None = None
    num_scored: int = 0
    outputs: list[dict[str, Any]] = field(default_factory=list)

    def metrics(self, baseline: DecodingStats | None) -> dict[str, float | None]:
        out = self.stats.metrics()
        out["speedup"] = speedup(self.stats, baseline) if baseline is not None else None
        return out


@dataclass
class Report:
    """All runs of one evaluation; `entries[0]` is the autoregressive baseline when one was run."""

    entries: list[ReportEntry]
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def baseline(self) -> ReportEntry | None:
        return next((e for e in self.entries if e.name == BASELINE_NAME), None)

    def entry(self, name: str) -> ReportEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(f"no entry named {name!r}; entries: {[e.name for e in self.entries]}")

    def to_dict(self) -> dict[str, Any]:
        base = self.baseline.stats if self.baseline is not None else None
        return {
            "settings": dict(self.settings),
            "entries": [
                {
                    "name": e.name,
                    "draft": e.draft,
                    "policy": e.policy,
                    "metrics": e.metrics(base),
                    "task_metric": e.task_metric,
                    "num_scored": e.num_scored,
                    "counters": e.stats.to_dict(),
                }
                for e in self.entries
            ],
        }

    def save(self, directory: str | Path, plots: bool = True) -> Path:
        """Write `outputs.jsonl`, (if `plots`) the two PNG plots and `report.json` into `directory`.

        Each file is written beside itself and renamed into place (`specdistill.utils.atomic`), `report.json` last:
        a report marks a finished evaluation, so it appears only once the files it describes are complete.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        data = self.to_dict()
        with atomic_file(directory / "outputs.jsonl") as tmp, tmp.open("w") as f:
            for e in self.entries:
                for row in e.outputs:
                    f.write(json.dumps({"name": e.name, **row}) + "\n")
        if plots:
            plot_acceptance_by_position(data, directory / "acceptance_by_position.png")
            plot_draft_length_hist(data, directory / "draft_length_hist.png")
        return atomic_write_text(directory / "report.json", json.dumps(data, indent=2) + "\n")


def _as_dict(report: Report | dict[str, Any]) -> dict[str, Any]:
    return report.to_dict() if isinstance(report, Report) else report


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"


def format_table(report: Report | dict[str, Any]) -> str:
    """A plain-text table of every entry's metrics (`report` as a `Report` or its `to_dict()` / report.json)."""
    data = _as_dict(report)
    metric_label = data.get("settings", {}).get("task_metric_name") or "task_metric"
    header = ["name", *TABLE_COLUMNS, metric_label]
    rows = [
        [e["name"], *(_cell(e["metrics"].get(c)) for c in TABLE_COLUMNS), _cell(e.get("task_metric"))]
        for e in data["entries"]
    ]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))])

    rule = "-" * len(line(header))
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def summary_metrics(
    report: Report | dict[str, Any], ratios: dict[str, float] | None = None
) -> dict[str, float | str]:
    """The report as flat scalars for a tracker's run summary (W&B), so a runs table can sort by any of them.

    `<entry>/<metric>` for each entry's defined metrics (`adaspec/fixed_k4/speedup`) and task metric, the `ratios`,
    and `best/<metric>` with `best/name`: the speculative entry with the highest `speedup`.
    """
    data = _as_dict(report)
    metric_label = data.get("settings", {}).get("task_metric_name") or "task_metric"
    out: dict[str, float | str] = {}
    for e in data["entries"]:
        values = {**e["metrics"], metric_label: e.get("task_metric")}
        out.update({f"{e['name']}/{name}": value for name, value in values.items() if value is not None})
    out.update(ratios or {})
    ranked = [
        e for e in data["entries"] if e["draft"] is not None and e["metrics"].get("speedup") is not None
    ]
    if ranked:
        best = max(ranked, key=lambda e: e["metrics"]["speedup"])
        out["best/name"] = best["name"]
        out.update({f"best/{k}": v for k, v in best["metrics"].items() if v is not None})
    return out


def _speculative_entries(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in data["entries"] if e["counters"]["rounds"] > 0]


def series_styles(n: int) -> list[dict[str, Any]]:
    """`n` line styles whose colours all differ: tab10 up to 10 series; up to 20, tab20's ten dark hues (solid)
    then its ten light ones (dashed); beyond, evenly spaced hues of a continuous map with four dash patterns in turn,
    so neighbouring hues stay apart."""
    if n <= 10:
        return [{"color": colormaps["tab10"](i), "linestyle": "-"} for i in range(n)]
    if n <= 20:
        return [{"color": colormaps["tab20"](2 * (i % 10) + i // 10), "linestyle": "--" if i >= 10 else "-"}
                for i in range(n)]  # fmt: skip
    dashes = ["-", "--", "-.", ":"]
    return [
        {"color": colormaps["turbo"](0.05 + 0.9 * i / (n - 1)), "linestyle": dashes[i % 4]} for i in range(n)
    ]


def plot_title(what: str, data: dict[str, Any]) -> str:
    """`what`, then the task, the split and the number of prompts the report covers (those it records)."""
    settings = data.get("settings", {})
    about = [
        settings.get("task"),
        f"{settings['split']} split" if settings.get("split") else None,
        f"{settings['num_prompts']} prompts" if settings.get("num_prompts") is not None else None,
    ]
    return ": ".join([what, ", ".join(a for a in about if a)]) if any(about) else what


def figure_per_entry(
    report: Report | dict[str, Any],
    what: str,
    draw: Callable[[Axes, dict[str, Any], dict[str, Any]], None],
    xlabel: str,
    ylabel: str,
    ylim: tuple[float, float] | None = None,
) -> Figure:
    """One figure (Agg canvas, no pyplot state) with `draw(ax, entry, style)` called per speculative entry, each
    entry with its own colour (`series_styles`); the legend sits right of the axes, never over the data."""
    data = _as_dict(report)
    entries = _speculative_entries(data)
    fig = Figure(figsize=(9, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for e, style in zip(entries, series_styles(len(entries)), strict=True):
        draw(ax, e, style)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(plot_title(what, data), fontsize=10)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    # the temporary name hides the extension, so the format is given; tight: the legend outside the axes stays in
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format=path.suffix.lstrip(".") or None)
    return path


def acceptance_by_position_figure(report: Report | dict[str, Any]) -> Figure:
    """Conditional acceptance at each candidate position, one line per speculative entry."""

    def draw(ax: Axes, e: dict[str, Any], style: dict[str, Any]) -> None:
        values = e["counters"]["acceptance_by_position"]
        xs = [i + 1 for i, v in enumerate(values) if v is not None]
        ax.plot(xs, [v for v in values if v is not None], marker="o", label=e["name"], **style)

    return figure_per_entry(
        report,
        "acceptance by position",
        draw,
        "candidate position in round",
        "acceptance (given all earlier accepted)",
        ylim=(0, 1.02),
    )


def draft_length_hist_figure(report: Report | dict[str, Any]) -> Figure:
    """Fraction of rounds with each number of drafted candidates, one step line per speculative entry."""

    def draw(ax: Axes, e: dict[str, Any], style: dict[str, Any]) -> None:
        hist = e["counters"]["draft_length_hist"]
        total = sum(hist)
        ax.step(range(len(hist)), [h / total for h in hist], where="mid", label=e["name"], **style)

    return figure_per_entry(
        report, "draft lengths", draw, "candidates drafted in a round", "fraction of rounds"
    )


def plot_acceptance_by_position(report: Report | dict[str, Any], path: str | Path) -> Path:
    """`acceptance_by_position_figure` as a PNG."""
    return _save(acceptance_by_position_figure(report), path)


def plot_draft_length_hist(report: Report | dict[str, Any], path: str | Path) -> Path:
    """`draft_length_hist_figure` as a PNG."""
    return _save(draft_length_hist_figure(report), path)

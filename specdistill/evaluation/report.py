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

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from specdistill.decoding.stats import METRIC_NAMES, DecodingStats, speedup

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
        """Write `report.json`, `outputs.jsonl` and (if `plots`) the two PNG plots into `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        data = self.to_dict()
        (directory / "report.json").write_text(json.dumps(data, indent=2) + "\n")
        with (directory / "outputs.jsonl").open("w") as f:
            for e in self.entries:
                for row in e.outputs:
                    f.write(json.dumps({"name": e.name, **row}) + "\n")
        if plots:
            plot_acceptance_by_position(data, directory / "acceptance_by_position.png")
            plot_draft_length_hist(data, directory / "draft_length_hist.png")
        return directory / "report.json"


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


def _plot_per_entry(
    report: Report | dict[str, Any],
    path: str | Path,
    draw: Callable[[Axes, dict[str, Any]], None],
    xlabel: str,
    ylabel: str,
    ylim: tuple[float, float] | None = None,
) -> Path:
    """One PNG (Agg backend) with `draw(ax, entry)` called for each speculative entry; integer x ticks, legend."""
    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for e in _speculative_entries(_as_dict(report)):
        draw(ax, e)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)


def plot_acceptance_by_position(report: Report | dict[str, Any], path: str | Path) -> Path:
    """Conditional acceptance at each candidate position, one line per speculative entry (PNG, Agg backend)."""

    def draw(ax: Axes, e: dict[str, Any]) -> None:
        values = e["counters"]["acceptance_by_position"]
        xs = [i + 1 for i, v in enumerate(values) if v is not None]
        ax.plot(xs, [v for v in values if v is not None], marker="o", label=e["name"])

    return _plot_per_entry(
        report,
        path,
        draw,
        "candidate position in round",
        "acceptance (given all earlier accepted)",
        ylim=(0, 1.02),
    )


def plot_draft_length_hist(report: Report | dict[str, Any], path: str | Path) -> Path:
    """Fraction of rounds with each number of drafted candidates, one step line per speculative entry (PNG)."""

    def draw(ax: Axes, e: dict[str, Any]) -> None:
        hist = e["counters"]["draft_length_hist"]
        total = sum(hist)
        ax.step(range(len(hist)), [h / total for h in hist], where="mid", label=e["name"])

    return _plot_per_entry(report, path, draw, "candidates drafted in a round", "fraction of rounds")

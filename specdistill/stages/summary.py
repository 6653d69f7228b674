"""The short table printed at the end of the embedded default pipeline."""

from __future__ import annotations

from typing import Any


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def summary_table(results: dict[str, dict[str, Any]]) -> str:
    """One row per (stage, metric) with a numeric value; paths and nested reports are left out."""
    rows = []
    for stage, result in results.items():
        for name, value in result.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rows.append((stage, name, _fmt(value)))
    if not rows:
        return "(no metrics)"
    widths = [max(len(r[i]) for r in rows + [("stage", "metric", "value")]) for i in range(3)]
    line = "  ".join("-" * w for w in widths)
    out = ["  ".join(h.ljust(w) for h, w in zip(("stage", "metric", "value"), widths, strict=True)), line]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)

"""Aggregate a sweep's jobs over seeds: mean, standard deviation and a 95% interval per metric, and paired differences.

Pure functions on the rows of `specdistill.collect` (one dict per job: its overrides, its metrics). A *group* is a
set of jobs equal in every setting but the seed; its summary of a metric is the sample mean, the sample standard
deviation (n - 1) and the two-sided 95% Student-t interval of the mean, over the seeds the group has. A *paired*
comparison subtracts, seed by seed, one configuration from another that shares its seeds (or one stage's column from
another's in the same job, e.g. `adaspec/val/kl - distill/val/kl` of a pipeline), then summarises the differences:
seed-to-seed variation common to both sides cancels.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# t_{0.975, df} for df = 1..30 (two-sided 95%); larger df use the Cornish-Fisher expansion around the normal.
_T975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)  # fmt: skip
_Z975 = 1.959964


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (4 decimals)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


@dataclass(frozen=True)
class Summary:
    """A metric over seeds. `std` and the interval are None for a single seed (no spread to estimate)."""

    n: int
    mean: float
    std: float | None
    ci95_low: float | None
    ci95_high: float | None
    min: float
    max: float


def summarize(values: Sequence[float]) -> Summary:
    """Mean, sample standard deviation and 95% t-interval of the mean of `values` (at least one)."""
    if not values:
        raise ValueError("no values to summarise")
    n = len(values)
    mean = math.fsum(values) / n
    if n == 1:
        return Summary(1, mean, None, None, None, values[0], values[0])
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile_975(n - 1) * std / math.sqrt(n)
    return Summary(n, mean, std, mean - half, mean + half, min(values), max(values))


def is_metric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def metric_columns(rows: Sequence[Mapping[str, Any]], settings: Iterable[str]) -> list[str]:
    """Columns holding a finite number in at least one row, settings excluded, in first-seen order."""
    skip = set(settings)
    return list(dict.fromkeys(k for row in rows for k, v in row.items() if k not in skip and is_metric(v)))


def _groups(
    rows: Sequence[Mapping[str, Any]], keys: Sequence[str]
) -> dict[tuple[str | None, ...], list[Mapping[str, Any]]]:
    groups: dict[tuple[str | None, ...], list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row.get(k) for k in keys), []).append(row)
    return groups


def aggregate(
    rows: Sequence[Mapping[str, Any]],
    settings: Sequence[str],
    over: str = "seed",
    metrics: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """One row per (group, metric): the group's settings, `metric`, `seeds` (distinct values of `over`), and the
    summary fields (`n` counts the jobs that report the metric).

    Args:
        rows: jobs (e.g. `specdistill.collect.collect`), each with its settings and metrics.
        settings: the columns that define a configuration (the sweep's override keys); `over` among them is what
            varies inside a group.
        over: the setting aggregated over.
        metrics: the metric columns to summarise (default every numeric column that is not a setting).
    """
    keys = [k for k in settings if k != over]
    metrics = list(metrics) if metrics is not None else metric_columns(rows, settings)
    out = []
    for values, members in _groups(rows, keys).items():
        seeds = sorted({str(m.get(over)) for m in members})
        for metric in metrics:
            found = [float(m[metric]) for m in members if is_metric(m.get(metric))]
            if found:
                out.append({**dict(zip(keys, values, strict=True)), "metric": metric, "seeds": len(seeds),
                            **vars(summarize(found))})  # fmt: skip
    return out


def column_differences(
    rows: Sequence[Mapping[str, Any]], first: str, second: str, metrics: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """Each row with its paired differences `<first>-<second>:<name>` = `<first><name> - <second><name>`, for every
    `name` reported under both column prefixes (e.g. `adaspec/` and `distill/` of a pipeline job).

    Only those new columns are added; `metrics`, when given, restricts `name`.
    """
    out = []
    for row in rows:
        extra = {}
        for key, value in row.items():
            if not key.startswith(first) or not is_metric(value):
                continue
            name = key[len(first) :]
            other = row.get(second + name)
            if is_metric(other) and (metrics is None or name in metrics):
                extra[f"{first}-{second}:{name}"] = float(value) - float(other)
        out.append({**row, **extra})
    return out


def paired_rows(
    rows: Sequence[Mapping[str, Any]],
    settings: Sequence[str],
    key: str,
    first: str,
    second: str,
    over: str = "seed",
) -> list[dict[str, Any]]:
    """Per seed, `first` minus `second` of setting `key` for jobs equal in every other setting.

    Returns one row per matched (configuration, seed): the other settings, `over`, `pair` (`"key: first - second"`)
    and the difference of every metric both jobs report. A seed run under only one side is left out.
    """
    keys = [k for k in settings if k not in (key, over)]
    metrics = metric_columns(rows, settings)
    out = []
    for values, members in _groups(rows, keys).items():
        by_seed = {(str(m.get(key)), str(m.get(over))): m for m in members}
        for (side, seed), a in sorted(by_seed.items()):
            b = by_seed.get((second, seed))
            if side != first or b is None:
                continue
            diff = {
                m: float(a[m]) - float(b[m]) for m in metrics if is_metric(a.get(m)) and is_metric(b.get(m))
            }
            out.append(
                {
                    **dict(zip(keys, values, strict=True)),
                    over: seed,
                    "pair": f"{key}: {first} - {second}",
                    **diff,
                }
            )
    return out

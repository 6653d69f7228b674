"""Collect a sweep into one table: each job's overrides and the numbers of its `result.json` / `report.json`.

    python -m specdistill.collect outputs/adaspec/multirun_2025-01-01_12-00-00
    python -m specdistill.collect <sweep_dir> --out table.csv --columns adaspec.k,val/expected_acceptance

A job is a directory holding `.hydra/overrides.yaml` (basic and submitit launchers alike). Its `result.json` and
`report.json` files, at the top or in stage sub-directories (a pipeline writes `<job>/<stage>/result.json`), become
columns named `[<stage>/]<key>`; nested dictionaries are flattened with dots. The CSV (default
`<sweep_dir>/sweep_results.csv`) holds every column; the printed table leaves out columns equal in every job.

Over seeds (`python train.py -m seed=0,1,2 ...`): jobs equal in every other setting form a group, and
`<sweep_dir>/sweep_summary.csv` holds, per group and metric, the number of seeds, mean, standard deviation, 95%
t-interval, min and max (`specdistill.aggregate`). Paired differences per seed:

    python -m specdistill.collect <sweep_dir> --pair-columns adaspec/,distill/   # AdaSPEC - DistillSpec, same job
    python -m specdistill.collect <sweep_dir> --pair selector=adaspec,none        # two configurations, same seeds
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from specdistill.aggregate import aggregate, column_differences, metric_columns, paired_rows
from specdistill.utils.extras import require

RESULT_FILES = ("result.json", "report.json")
SKIP_DIRS = {".hydra", ".submitit", "checkpoints", "wandb", "csv", "export"}


def _flatten(obj: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{name}."))
        elif isinstance(value, list | tuple):
            out[name] = json.dumps(value)
        else:
            out[name] = value
    return out


def parse_overrides(lines: Iterable[str]) -> dict[str, str]:
    """`["stage=adaspec", "+x=1", "~y"]` -> `{"stage": "adaspec", "x": "1", "y": "<deleted>"}`."""
    overrides: dict[str, str] = {}
    for line in lines:
        key, sep, value = str(line).partition("=")
        key = key.lstrip("+~")
        overrides[key] = value if sep else "<deleted>"
    return overrides


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Job directories of a sweep (those with `.hydra/overrides.yaml`), in job-number order when numbered."""
    jobs = [p.parent.parent for p in sweep_dir.rglob(".hydra/overrides.yaml") if ".submitit" not in p.parts]

    def order(path: Path) -> tuple:
        rel = path.relative_to(sweep_dir).parts
        return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in rel)

    return sorted(jobs, key=order)


def _result_files(job: Path) -> list[Path]:
    found = []
    for name in RESULT_FILES:
        found += [p for p in job.rglob(name) if not SKIP_DIRS.intersection(p.relative_to(job).parts[:-1])]
    return sorted(found)


def collect(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One row per job: `job`, `status` (`done` when a result file exists, else `missing`), overrides, results."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(
            f"{sweep_dir} is not a directory; pass a multirun directory (hydra.sweep.dir)"
        )
    jobs = job_dirs(sweep_dir)
    if not jobs:
        raise FileNotFoundError(
            f"no job under {sweep_dir} (looked for */.hydra/overrides.yaml); pass the directory of a `-m` run"
        )
    rows = []
    for job in jobs:
        row: dict[str, Any] = {"job": str(job.relative_to(sweep_dir)) or "."}
        row.update(parse_overrides(OmegaConf.to_container(OmegaConf.load(job / ".hydra" / "overrides.yaml"))))
        files = _result_files(job)
        row["status"] = "done" if files else "missing"
        for path in files:
            stage = path.parent.relative_to(job)
            prefix = "" if stage == Path(".") else f"{stage.as_posix()}/"
            if path.name == "report.json":
                prefix += "report."
            row.update(_flatten(json.loads(path.read_text()), prefix))
        rows.append(row)
    return rows


def columns_of(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    return list(dict.fromkeys(key for row in rows for key in row))


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Every column of `rows`, in first-seen order."""
    path = Path(path)
    columns = columns_of(rows)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def varying_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Columns worth printing: `job`, `status` and those whose value is not the same in every row."""
    columns = columns_of(rows)
    if len(rows) < 2:
        return columns
    keep = {"job", "status"}
    return [c for c in columns if c in keep or len({json.dumps(r.get(c), default=str) for r in rows}) > 1]


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A plain-text table with aligned columns."""
    columns = list(columns or columns_of(rows))
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def setting_columns(sweep_dir: str | Path) -> list[str]:
    """The override keys of a sweep's jobs: the settings that define each configuration."""
    keys: dict[str, None] = {}
    for job in job_dirs(Path(sweep_dir)):
        keys.update(
            dict.fromkeys(
                parse_overrides(OmegaConf.to_container(OmegaConf.load(job / ".hydra" / "overrides.yaml")))
            )
        )
    return list(keys)


def summarize_sweep(
    rows: Sequence[Mapping[str, Any]],
    settings: Sequence[str],
    over: str = "seed",
    pairs: Sequence[tuple[str, str, str]] = (),
    column_pairs: Sequence[tuple[str, str]] = (),
) -> list[dict[str, Any]]:
    """Aggregates over `over` (one row per group and metric, `pair` empty), then the paired differences:
    `column_pairs` (prefix, prefix) within each job and `pairs` (setting, first, second) across jobs sharing seeds."""
    done = [r for r in rows if r.get("status") == "done"]
    summary = [{"pair": "", **r} for r in aggregate(done, settings, over)]
    for first, second in column_pairs:
        with_diffs = column_differences(done, first, second)
        names = [c for c in metric_columns(with_diffs, settings) if c.startswith(f"{first}-{second}:")]
        for r in aggregate(with_diffs, settings, over, names):
            metric = r.pop("metric")
            summary.append({"pair": f"{first} - {second}", "metric": metric.split(":", 1)[1], **r})
    for key, first, second in pairs:
        paired = paired_rows(done, settings, key, first, second, over)
        if not paired:
            raise SystemExit(f"--pair {key}={first},{second}: no seed was run with both values of {key}")
        names = metric_columns(paired, [*settings, "pair"])
        rest = [k for k in settings if k != key]
        summary += [{**r, "pair": f"{key}: {first} - {second}"} for r in aggregate(paired, rest, over, names)]
    return summary


SUMMARY_FIELDS = ("seeds", "n", "mean", "std", "ci95_low", "ci95_high", "min", "max")


def format_summary(summary: Sequence[Mapping[str, Any]], metrics: Sequence[str] | None = None) -> str:
    """The summary as a console table: the settings that differ between groups, pair, metric, n, mean, std, 95% CI."""
    shown = [r for r in summary if not metrics or any(fnmatch.fnmatch(r["metric"], p) for p in metrics)]
    if not shown:
        return "(no metric matches --metrics)"
    keys = [
        k for k in varying_columns(shown) if k not in (*SUMMARY_FIELDS, "job", "status", "metric", "pair")
    ]
    table = []
    for r in shown:
        ci = "" if r["std"] is None else f"[{r['ci95_low']:.4g}, {r['ci95_high']:.4g}]"
        std = "" if r["std"] is None else f"{r['std']:.3g}"
        table.append({**{k: r.get(k) for k in keys}, "pair": r["pair"], "metric": r["metric"], "n": r["n"],
                      "mean": f"{r['mean']:.4g}", "std": std, "95% CI": ci,
                      "range": f"{r['min']:.4g}..{r['max']:.4g}"})  # fmt: skip
    columns = [
        *keys,
        *(["pair"] if any(r["pair"] for r in shown) else []),
        "metric",
        "n",
        "mean",
        "std",
        "95% CI",
        "range",
    ]
    return format_table(table, columns)


def log_to_wandb(
    project: str, sweep_dir: Path, rows: Sequence[Mapping[str, Any]], summary: Sequence[Mapping[str, Any]]
) -> str:
    """Log the job table and the summary as W&B tables in one run named after the sweep; return the run's path."""
    require("wandb", "collect --wandb", "wandb")
    import wandb

    def table(records: Sequence[Mapping[str, Any]]) -> wandb.Table:
        columns = columns_of(records)
        return wandb.Table(columns=columns, data=[[_cell_value(r.get(c)) for c in columns] for r in records])

    # the run's files go beside the sweep's (collect skips `wandb/`), or under WANDB_DIR where that is set; passed
    # explicitly because wandb reads WANDB_DIR once per process, at its first run
    run = wandb.init(
        project=project,
        name=f"collect:{sweep_dir.name}",
        job_type="collect",
        dir=os.environ.get("WANDB_DIR") or str(sweep_dir),
        reinit="finish_previous",
    )
    payload = {"sweep/jobs": table(rows)}
    if summary:
        payload["sweep/summary"] = table(summary)
    run.log(payload)
    path = run.dir
    run.finish()
    return path


def _cell_value(value: Any) -> Any:
    return value if value is None or isinstance(value, int | float | str) else json.dumps(value, default=str)


def _pair_option(text: str) -> tuple[str, str, str]:
    key, _, values = text.partition("=")
    first, _, second = values.partition(",")
    if not (key and first and second):
        raise argparse.ArgumentTypeError(
            f"--pair {text!r}: expected KEY=FIRST,SECOND, e.g. selector=adaspec,none"
        )
    return key, first, second


def _column_pair_option(text: str) -> tuple[str, str]:
    first, _, second = text.partition(",")
    if not (first and second):
        raise argparse.ArgumentTypeError(
            f"--pair-columns {text!r}: expected FIRST,SECOND, e.g. adaspec/,distill/"
        )
    return first, second


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specdistill.collect", description=__doc__.splitlines()[0]
    )
    parser.add_argument("sweep_dir", type=Path, help="a multirun directory (hydra.sweep.dir)")
    parser.add_argument(
        "--out", type=Path, default=None, help="CSV path (default <sweep_dir>/sweep_results.csv)"
    )
    parser.add_argument(
        "--columns",
        default=None,
        help="comma-separated columns to print (default those that vary); the CSV has all",
    )
    parser.add_argument("--over", default="seed", help="the setting to aggregate over (default seed)")
    parser.add_argument(
        "--metrics", default=None, help="comma-separated patterns of metrics to print (e.g. 'distill/val/*')"
    )
    parser.add_argument("--pair", type=_pair_option, action="append", default=[], metavar="KEY=FIRST,SECOND",
                        help="paired differences per seed between two values of a setting")  # fmt: skip
    parser.add_argument("--pair-columns", type=_column_pair_option, action="append", default=[], metavar="FIRST,SECOND",
                        help="paired differences per job between two column prefixes (e.g. adaspec/,distill/)")  # fmt: skip
    parser.add_argument(
        "--wandb", default=None, metavar="PROJECT", help="also log the tables to this W&B project"
    )
    args = parser.parse_args(argv)
    try:
        rows = collect(args.sweep_dir)
    except FileNotFoundError as err:
        print(f"specdistill.collect: {err}", file=sys.stderr)
        return 2
    columns = None
    if args.columns:
        columns = ["job", *[c for c in args.columns.split(",") if c and c != "job"]]
        unknown = [c for c in columns if c not in columns_of(rows)]
        if unknown:
            raise SystemExit(f"unknown columns {unknown}; available: {columns_of(rows)}")
    out = write_csv(rows, args.out or args.sweep_dir / "sweep_results.csv")
    print(format_table(rows, columns or varying_columns(rows)))
    print(f"\n{len(rows)} jobs -> {out}", file=sys.stderr)
    settings = setting_columns(args.sweep_dir)
    summary = []
    if args.over in settings or args.pair or args.pair_columns:
        summary = summarize_sweep(rows, settings, args.over, args.pair, args.pair_columns)
        path = write_csv(summary, Path(out).with_name("sweep_summary.csv"))
        metrics = args.metrics.split(",") if args.metrics else None
        print(f"\nover {args.over}:\n" + format_summary(summary, metrics))
        print(f"\n{len(summary)} summary rows -> {path}", file=sys.stderr)
    if args.wandb:
        print(f"W&B: {log_to_wandb(args.wandb, args.sweep_dir, rows, summary)}", file=sys.stderr)
    return 0


def cli() -> None:
    """The `specdistill-collect` console script."""
    raise SystemExit(main())


if __name__ == "__main__":
    cli()

"""Collect a sweep into one table: each job's overrides and the numbers of its `result.json` / `report.json`.

    python -m specdistill.collect outputs/adaspec/multirun_2025-01-01_12-00-00
    python -m specdistill.collect <sweep_dir> --out table.csv --columns adaspec.k,val/expected_acceptance

A job is a directory holding `.hydra/overrides.yaml` (basic and submitit launchers alike). Its `result.json` and
`report.json` files, at the top or in stage sub-directories (a pipeline writes `<job>/<stage>/result.json`), become
columns named `[<stage>/]<key>`; nested dictionaries are flattened with dots. The CSV (default
`<sweep_dir>/sweep_results.csv`) holds every column; the printed table leaves out columns equal in every job.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

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


def write_csv(
    rows: Sequence[Mapping[str, Any]], path: str | Path, columns: Sequence[str] | None = None
) -> Path:
    path = Path(path)
    columns = list(columns or columns_of(rows))
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specdistill.collect", description=__doc__.splitlines()[0]
    )
    parser.add_argument("sweep_dir", type=Path, help="a multirun directory (hydra.sweep.dir)")
    parser.add_argument(
        "--out", type=Path, default=None, help="CSV path (default <sweep_dir>/sweep_results.csv)"
    )
    parser.add_argument(
        "--columns", default=None, help="comma-separated columns to show and write (default all)"
    )
    args = parser.parse_args(argv)
    rows = collect(args.sweep_dir)
    columns = None
    if args.columns:
        columns = ["job", *[c for c in args.columns.split(",") if c and c != "job"]]
        unknown = [c for c in columns if c not in columns_of(rows)]
        if unknown:
            raise SystemExit(f"unknown columns {unknown}; available: {columns_of(rows)}")
    out = write_csv(rows, args.out or args.sweep_dir / "sweep_results.csv", columns)
    print(format_table(rows, columns or varying_columns(rows)))
    print(f"\n{len(rows)} jobs -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`collect` over a seed sweep: mean, std and 95% t-interval per group and metric, and paired differences per seed."""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from specdistill.aggregate import summarize, t_quantile_975
from specdistill.collect import collect, main, setting_columns, summarize_sweep
from tests.wandb_files import read_offline_run

# kl and acceptance per (selector, seed): AdaSPEC lower kl on every seed, by different margins.
KL = {("adaspec", 0): 0.33, ("adaspec", 1): 0.37, ("adaspec", 2): 0.31, ("none", 0): 0.38, ("none", 1): 0.45,
      ("none", 2): 0.36}  # fmt: skip


def write_job(job: Path, overrides: list[str], results: dict[str, dict]) -> None:
    (job / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(overrides), job / ".hydra" / "overrides.yaml")
    for rel, content in results.items():
        (job / rel).parent.mkdir(parents=True, exist_ok=True)
        (job / rel).write_text(json.dumps(content))


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """`-m selector=adaspec,none seed=0,1,2` of a pipeline-like job: distill/ and adaspec/ results in each job."""
    root = tmp_path / "multirun"
    for i, (selector, seed) in enumerate(sorted(KL)):
        write_job(root / str(i), [f"selector={selector}", f"seed={seed}"], {
            "adaspec/result.json": {"val/kl": KL[selector, seed], "export": f"/runs/{i}/export"},
            "distill/result.json": {"val/kl": KL[selector, seed] + 0.01 * (seed + 1)},
        })  # fmt: skip
    write_job(root / "6", ["selector=none", "seed=3"], {})  # a crashed job counts for nothing
    return root


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def test_t_quantiles_match_the_tables():
    assert t_quantile_975(1) == pytest.approx(12.706, abs=1e-3)
    assert t_quantile_975(2) == pytest.approx(4.303, abs=1e-3)
    assert t_quantile_975(40) == pytest.approx(2.021, abs=1e-3)
    assert t_quantile_975(120) == pytest.approx(1.980, abs=1e-3)
    assert t_quantile_975(30) > t_quantile_975(31) > t_quantile_975(1000) > 1.96
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile_975(0)


def test_summary_of_three_values():
    s = summarize([1.0, 2.0, 4.0])
    assert s.mean == pytest.approx(7 / 3) and s.std == pytest.approx(statistics.stdev([1, 2, 4]))
    half = 4.3027 * s.std / math.sqrt(3)
    assert (s.ci95_low, s.ci95_high) == pytest.approx((s.mean - half, s.mean + half))
    assert (s.n, s.min, s.max) == (3, 1.0, 4.0)
    one = summarize([0.5])
    assert one.std is None and one.ci95_low is None and one.mean == 0.5


def test_groups_are_every_setting_but_the_seed(sweep: Path):
    rows = collect(sweep)
    summary = summarize_sweep(rows, setting_columns(sweep))
    kl = {r["selector"]: r for r in summary if r["metric"] == "adaspec/val/kl"}
    assert set(kl) == {"adaspec", "none"}
    for selector, r in kl.items():
        values = [KL[selector, s] for s in range(3)]
        assert r["seeds"] == r["n"] == 3  # the crashed seed 3 is not counted
        assert r["mean"] == pytest.approx(statistics.mean(values))
        assert r["std"] == pytest.approx(statistics.stdev(values))
    assert not any(r["metric"] == "adaspec/export" for r in summary)  # strings are not metrics


def test_paired_differences_per_seed_across_configurations_and_columns(sweep: Path, tmp_path: Path):
    out = tmp_path / "jobs.csv"
    code = main(
        [
            str(sweep),
            "--out",
            str(out),
            "--pair",
            "selector=adaspec,none",
            "--pair-columns",
            "adaspec/,distill/",
        ]
    )
    assert code == 0
    summary = read_csv(tmp_path / "sweep_summary.csv")
    across = [
        r for r in summary if r["pair"] == "selector: adaspec - none" and r["metric"] == "adaspec/val/kl"
    ]
    diffs = [KL["adaspec", s] - KL["none", s] for s in range(3)]
    assert len(across) == 1 and int(across[0]["n"]) == 3
    assert float(across[0]["mean"]) == pytest.approx(statistics.mean(diffs))
    assert float(across[0]["std"]) == pytest.approx(statistics.stdev(diffs))
    assert float(across[0]["ci95_high"]) < 0  # lower on every seed, and the interval says so
    within = {
        r["selector"]: r for r in summary if r["pair"] == "adaspec/ - distill/" and r["metric"] == "val/kl"
    }
    # adaspec/val/kl - distill/val/kl = -0.01 * (seed + 1) in every configuration
    assert float(within["none"]["mean"]) == pytest.approx(-0.02)
    assert float(within["none"]["std"]) == pytest.approx(0.01)
    assert len(read_csv(out)) == 7  # the job table keeps every job and every column


def test_a_pair_without_shared_seeds_is_refused(sweep: Path):
    with pytest.raises(SystemExit, match="no seed was run with both values"):
        main([str(sweep), "--pair", "selector=adaspec,random"])


def test_columns_option_prints_fewer_but_writes_every_column(sweep: Path, capsys):
    assert main([str(sweep), "--columns", "selector,adaspec/val/kl"]) == 0
    header = capsys.readouterr().out.splitlines()[0].split()
    assert header == ["job", "selector", "adaspec/val/kl"]
    written = read_csv(sweep / "sweep_results.csv")[0]
    assert {"distill/val/kl", "adaspec/export", "seed", "status"} <= set(written)


def test_a_missing_sweep_directory_is_one_line_and_exit_code_2(tmp_path: Path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a directory" in err


def test_summary_is_logged_to_wandb_as_a_table(sweep: Path, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert main([str(sweep), "--wandb", "specdistill-test"]) == 0
    run_dir = next((tmp_path / "wandb").glob("offline-run-*"))
    logged = read_offline_run(run_dir)
    assert logged["run"]["name"] == "collect:multirun"
    keys = {k for row in logged["history"] for k in row}
    assert {"sweep/summary/path", "sweep/jobs/path"} <= keys
    table = json.loads(
        next((run_dir / "files" / "media" / "table" / "sweep").glob("summary_*.table.json")).read_text()
    )
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    kl = next(r for r in rows if r["metric"] == "adaspec/val/kl" and r["selector"] == "none")
    assert kl["mean"] == pytest.approx(statistics.mean(KL["none", s] for s in range(3)))


def test_without_wandb_dir_the_summary_run_lands_beside_the_sweep(sweep: Path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    assert main([str(sweep), "--wandb", "specdistill-test"]) == 0
    printed = capsys.readouterr().err
    run_dir = next((sweep / "wandb").glob("offline-run-*"))
    assert f"W&B: {run_dir / 'files'}" in printed

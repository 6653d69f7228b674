"""Launcher presets compose; a local submitit sweep of two tiny jobs runs; `specdistill.collect` tabulates sweeps."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specdistill.collect import collect, main, parse_overrides
from tests.wandb_files import read_offline_run

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
TINY_SFT = [
    "stage=sft",
    "task.max_examples.train=16",
    "task.max_examples.validation=4",
    "task.max_examples.test=4",
    "sft.trainer.max_steps=2",
    "sft.batch_size=4",
    "sft.eval_examples=0",
    "sft.max_length=64",
    "models.target.config.hidden_size=32",
    "models.target.config.intermediate_size=64",
    "models.target.config.num_hidden_layers=2",
    "models.target.config.num_attention_heads=2",
    "+trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
]


def launcher_cfg(name: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=[f"hydra/launcher={name}"], return_hydra_config=True)
    return cfg.hydra.launcher


def test_slurm_launcher_requeues_and_runs_one_task_per_gpu() -> None:
    launcher = launcher_cfg("slurm")
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.tasks_per_node == launcher.gpus_per_node == 8
    assert launcher.max_num_timeout > 0 and launcher.signal_delay_s >= 60
    for key in ("nodes", "timeout_min", "partition", "account", "constraint"):
        assert key in launcher


def test_local_launcher_composes() -> None:
    launcher = launcher_cfg("local")
    assert launcher._target_.endswith("LocalLauncher")
    assert launcher.gpus_per_node == 0 and launcher.tasks_per_node == 1


def write_job(job: Path, overrides: list[str], results: dict[str, dict]) -> None:
    (job / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(overrides), job / ".hydra" / "overrides.yaml")
    for rel, content in results.items():
        path = job / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))


def test_collect_tabulates_overrides_results_reports_and_pipeline_stages(tmp_path: Path) -> None:
    sweep = tmp_path / "multirun"
    write_job(
        sweep / "0",
        ["stage=adaspec", "adaspec.k=0.2"],
        {
            "result.json": {"val/expected_acceptance": 0.61},
            "report.json": {"speedup": 1.9, "per_k": {"a": 1}},
        },
    )
    write_job(
        sweep / "1", ["stage=adaspec", "adaspec.k=0.4"], {"result.json": {"val/expected_acceptance": 0.66}}
    )
    write_job(sweep / "2", ["stage=adaspec", "+adaspec.k=0.8"], {})  # crashed job: no result
    write_job(
        sweep / "10", ["stage=pipeline"], {"sft/result.json": {"val/loss": 1.5}, "distill/result.json": {}}
    )
    (sweep / "0" / "checkpoints").mkdir()
    (sweep / "0" / "checkpoints" / "result.json").write_text('{"ignored": 1}')

    rows = collect(sweep)
    assert [row["job"] for row in rows] == ["0", "1", "2", "10"]
    assert [row["adaspec.k"] for row in rows[:3]] == ["0.2", "0.4", "0.8"]
    assert rows[0]["val/expected_acceptance"] == 0.61
    assert rows[0]["report.speedup"] == 1.9 and rows[0]["report.per_k.a"] == 1
    assert "ignored" not in rows[0]
    assert rows[2]["status"] == "missing" and rows[3]["status"] == "done"
    assert rows[3]["sft/val/loss"] == 1.5

    out = tmp_path / "table.csv"
    assert main([str(sweep), "--out", str(out), "--columns", "adaspec.k,val/expected_acceptance"]) == 0
    with out.open() as handle:
        table = list(csv.DictReader(handle))
    assert {k: table[1][k] for k in ("job", "adaspec.k", "val/expected_acceptance")} == {
        "job": "1",
        "adaspec.k": "0.4",
        "val/expected_acceptance": "0.66",
    }
    assert (
        table[0]["report.speedup"] == "1.9"
    )  # --columns chooses what is printed; the CSV keeps every column
    with pytest.raises(SystemExit, match="unknown columns"):
        main([str(sweep), "--columns", "nope"])
    with pytest.raises(FileNotFoundError, match="no job"):
        collect(tmp_path / "multirun" / "0" / ".hydra")


def test_parse_overrides_handles_append_and_delete() -> None:
    assert parse_overrides(["a=1", "+b.c=x=y", "~d"]) == {"a": "1", "b.c": "x=y", "d": "<deleted>"}


@pytest.mark.slow
def test_local_submitit_sweep_of_two_tiny_jobs_is_one_wandb_group(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    command = [
        sys.executable,
        "train.py",
        "-m",
        "hydra/launcher=local",
        *TINY_SFT,
        "logger=wandb",
        "sft.optimizer.lr=1e-4,1e-3",
        f"hydra.sweep.dir={sweep}",
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]

    rows = collect(sweep)
    assert [(row["sft.optimizer.lr"], row["status"]) for row in rows] == [
        ("0.0001", "done"),
        ("0.001", "done"),
    ]
    assert all(isinstance(row["val/loss"], float) for row in rows)
    assert (sweep / "sweep_results.csv").exists() is False  # only the CLI writes it
    runs = [read_offline_run(next((sweep / row["job"] / "wandb").glob("offline-run-*"))) for row in rows]
    assert {run["run"]["group"] for run in runs} == {"sweep"}
    # each job is named after its stage and the key the sweep varies (the other overrides are the same for all)
    assert [run["run"]["name"] for run in runs] == ["sft lr=0.0001", "sft lr=0.001"]
    assert all(any("train/loss" in h for h in run["history"]) for run in runs)
    assert runs[0]["config"]["sft"]["optimizer"]["lr"] == pytest.approx(1e-4)

"""What the study scripts share (`scaling_study.py`, `choose_on_validation.py`): each point of a study is a `train.py`
run in its own folder, so a relaunch resumes it (specdistill/stages/pipeline.py), and an offline evaluate run's
tokens per target call are read back from its report."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_train(python: str, experiment: str, overrides: list[str], run_dir: Path) -> None:
    """One `train.py experiment=<experiment> <overrides>` run into `run_dir` (a relaunch resumes it); its console
    goes to `<run_dir>.log`. A failed run stops the study, naming its log."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    command = [
        python,
        str(ROOT / "train.py"),
        f"experiment={experiment}",
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    print(f"[study] {run_dir.name}: {' '.join(command[2:])}", flush=True)
    with open(f"{run_dir}.log", "a") as log:
        done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"[study] {run_dir.name} failed (exit {done.returncode}): see {run_dir}.log")


def offline_tokens_per_call(run_dir: Path) -> dict[str, dict[int, float | None]]:
    """`{draft: {K: offline tokens per target call}}` of the evaluate run in `run_dir`."""
    report = json.loads((run_dir / "evaluate" / "report.json").read_text())
    table = report["settings"]["offline_tokens_per_target_call"]
    return {name: {int(k): v for k, v in by_k.items()} for name, by_k in table.items()}

"""Shared helpers for tests that run train.py: tiny settings that make every stage take seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A target and draft even smaller than the embedded `tiny` pair, and a few dozen arith problems.
TINY = [
    "task.sizes.train=48",
    "task.sizes.validation=8",
    "task.sizes.test=8",
    "models.target.config.hidden_size=32",
    "models.target.config.num_hidden_layers=1",
    "models.target.config.num_attention_heads=2",
    "models.target.config.intermediate_size=64",
    "models.draft.config.hidden_size=16",
    "models.draft.config.num_hidden_layers=1",
    "models.draft.config.num_attention_heads=2",
    "models.draft.config.intermediate_size=32",
]


def stage_overrides(stage: str, steps: int = 2) -> list[str]:
    """A few optimizer steps of `stage`: `trainer.max_steps` from the command line wins over the stage's own block."""
    return [f"trainer.max_steps={steps}", f"{stage}.batch_size=8", f"++{stage}.trainer.limit_val_batches=1"]


def run_train(args: list[str], cwd: Path = ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run train.py in a subprocess (as a user would) and return the completed process."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"train.py failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"

"""The package stands on its own: a non-editable install trains from any directory, ships its configs and tasks as
`specdistill.*` (no top-level `tasks` module), and optional extras fail with the command that installs them."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from specdistill.utils.extras import require
from tests.helpers import ROOT, TINY, stage_overrides


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtual environment (seeing this interpreter's packages for torch & co.) with `pip install .`."""
    env_dir = tmp_path_factory.mktemp("venv")
    # no pip of its own: the interpreter's pip and setuptools (>= 77) build the wheel, offline
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return env_dir / "bin"


def run_in(bin_dir: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_installed_console_script_trains_from_another_directory(installed: Path, tmp_path: Path):
    where = run_in(
        installed,
        [str(installed / "python"), "-c", "import specdistill; print(specdistill.__file__)"],
        tmp_path,
    )
    assert where.returncode == 0 and "site-packages" in where.stdout and str(ROOT) not in where.stdout
    no_tasks = run_in(installed, [str(installed / "python"), "-c", "import " + "tasks"], tmp_path)
    assert no_tasks.returncode != 0 and "No module named 'tasks'" in no_tasks.stderr

    composed = run_in(
        installed, [str(installed / "specdistill-train"), "stage=sft", "--cfg", "job"], tmp_path
    )
    assert composed.returncode == 0, composed.stderr[-2000:]
    assert "_target_: specdistill.tasks.arith.Arith" in composed.stdout

    run_dir = tmp_path / "run"
    trained = run_in(installed, [str(installed / "specdistill-train"), "stage=sft", *TINY, *stage_overrides("sft"),
                                 "sft.eval_examples=0", f"hydra.run.dir={run_dir}"], tmp_path)  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (run_dir / "export" / "model.safetensors").is_file() and (run_dir / "train.log").is_file()

    collected = run_in(
        installed, [str(installed / "specdistill-collect"), str(tmp_path / "missing")], tmp_path
    )
    assert collected.returncode == 2 and "is not a directory" in collected.stderr


def test_a_missing_extra_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` sees when wandb is not installed
    with pytest.raises(ImportError, match=r"logger=wandb needs `wandb`.*pip install 'specdistill\[wandb\]'"):
        require("wandb", "logger=wandb", "wandb")
    from specdistill.utils.wandb_logger import wandb_logger

    with pytest.raises(ImportError, match=r"specdistill\[wandb\]"):
        wandb_logger(save_dir="unused")


def test_deepspeed_missing_names_its_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    from specdistill.utils.strategy import require_deepspeed

    with pytest.raises(ImportError, match=r"pip install 'specdistill\[deepspeed\]'"):
        require_deepspeed()


def test_no_module_imports_the_top_level_tasks_package():
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("specdistill", "tasks", "tests", "benchmarks")
        for path in (ROOT / folder).rglob("*.py")
        if "specdistill/tasks" not in path.as_posix() and any(
            line.startswith(("from tasks", "import specdistill.tasks")) for line in path.read_text().splitlines()
        )
    ]  # fmt: skip
    assert not offenders, f"import specdistill.tasks instead of tasks in {offenders}"

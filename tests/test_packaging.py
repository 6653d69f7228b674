"""The package stands on its own: a non-editable install trains from any directory, ships its configs and tasks as
`specdistill.*` (no top-level `tasks` module), and optional extras fail with the command that installs them."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from specdistill.utils.extras import require
from tests.helpers import ROOT, TINY, stage_overrides


def visible_site_dirs() -> list[str]:
    """The site directories this interpreter takes its packages from: a virtual environment's own site-packages (and
    its base's, when it was made with --system-site-packages), or the base interpreter's, plus the user's."""
    found = site.getsitepackages()
    if site.ENABLE_USER_SITE:
        found.append(site.getusersitepackages())
    return [path for path in found if os.path.isdir(path)]


def setuptools_builds_offline() -> bool:
    """Whether the setuptools this interpreter sees can build the project itself (pyproject.toml: >= 77)."""
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return major >= 77


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtual environment with `pip install .`, seeing the packages of the environment the tests run in.

    A virtual environment made from inside another one is made from the *base* interpreter (`sys._base_executable`),
    so `--system-site-packages` would show the base interpreter's packages (a bare Python's setuptools 65, no torch),
    not those of the environment the tests run in. Its site directories are added instead, by a .pth file in the new
    environment's own site-packages, after it: the project installed there comes first, the rest (torch & co.) from
    the running environment, whether that is a virtual environment or the machine's own interpreter.
    """
    env_dir = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    lines = [f"import site; site.addsitedir({path!r})" for path in visible_site_dirs()]
    (Path(purelib) / "_running_environment.pth").write_text("\n".join(lines) + "\n")
    # the running environment's pip and setuptools (>= 77) build the wheel, offline; an older setuptools (a bare
    # environment's) leaves the build to pip's isolated environment, which fetches setuptools >= 77 from the index
    isolation = ["--no-build-isolation"] if setuptools_builds_offline() else []
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", *isolation, str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return env_dir / "bin"


def run_in(bin_dir: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_test_environment_sees_the_running_environments_packages(installed: Path, tmp_path: Path):
    """What the fixture builds from inside a virtual environment as from the machine's own interpreter: the same
    torch as the running environment, and this project from its own site-packages, not from the checkout."""
    shown = run_in(
        installed,
        [str(installed / "python"), "-c", "import torch, specdistill; print(torch.__file__); print(specdistill.__file__)"],
        tmp_path,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr[-2000:]
    torch_file, package_file = shown.stdout.split()
    assert os.path.realpath(torch_file) == os.path.realpath(importlib.util.find_spec("torch").origin)
    assert package_file.startswith(str(installed.parent)) and str(ROOT) not in package_file


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


def quickstart_commands() -> list[list[str]]:
    """README's Quickstart commands (its bash blocks), each as its `&&`-joined steps."""
    section = (ROOT / "README.md").read_text().split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    return [
        [step.strip() for step in block.split("&&")]
        for block in re.findall(r"```bash\n(.*?)\n```", section, re.S)
    ]


def ci_steps() -> list[str]:
    """The commands `.ci/run` runs, without its shell settings, comments, guards and pip's `-q`."""
    steps = []
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        line = line.split(" # ")[0].strip()
        if not line or line.startswith(("#", "set ", "cd ", "export ")) or "||" in line:
            continue
        steps.append(line.replace("pip install -q ", "pip install ", 1))
    return steps


def test_ci_runs_readmes_test_command_in_a_virtual_environment():
    """Both Quickstart commands are what a user types to work in a virtual environment, and CI runs the test command's
    steps, in that environment, and nothing else."""
    commands = quickstart_commands()
    assert len(commands) == 2 and all(
        steps[:2] == ["python -m venv .venv", ". .venv/bin/activate"] for steps in commands
    )
    test_command = next(steps for steps in commands if any("pytest" in step for step in steps))
    assert ci_steps() == test_command
    assert ".venv/" in (ROOT / ".gitignore").read_text().splitlines()

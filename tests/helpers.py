"""Shared helpers for tests that run train.py (tiny settings that make every stage take seconds) or several ranks."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
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


def evaluate_outputs(run_dir: Path) -> tuple[dict[int, list[int]], dict[str, dict[int, list[int]]]]:
    """An evaluate run's generated tokens per example: the autoregressive target's (report entry 0), and every other
    entry's by name."""
    names = [e["name"] for e in json.loads((run_dir / "report.json").read_text())["entries"]]
    by_name: dict[str, dict[int, list[int]]] = {}
    for line in (run_dir / "outputs.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_name.setdefault(row["name"], {})[row["example_id"]] = row["tokens"]
    return by_name.pop(names[0]), by_name


def run_gloo_ranks(worker: str, *args: str, out_dir: Path, world_size: int = 2, timeout: int = 300) -> list:
    """Run the Python source `worker` in `world_size` fresh processes, one gloo rank each, and return what each rank
    wrote (JSON) in rank order. The worker starts with `rank, args, out = join_gloo()` (its process group is then
    up; `args` are `args`) and ends by writing its JSON result to `out`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    outs = [out_dir / f"rank{rank}.json" for rank in range(world_size)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", worker, str(rank), str(world_size), str(port), str(outs[rank]), *args],
            env=env,
        )
        for rank in range(world_size)
    ]
    assert [p.wait(timeout=timeout) for p in procs] == [0] * world_size
    return [json.loads(out.read_text()) for out in outs]


def join_gloo() -> tuple[int, list[str], Path]:
    """In a `run_gloo_ranks` worker: join the gloo process group; return `(rank, args, out)`."""
    import torch.distributed as dist

    rank, world_size, port, out, *args = sys.argv[1:]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(rank), world_size=int(world_size)
    )
    return int(rank), args, Path(out)


@contextmanager
def hydra_conf() -> Iterator[None]:
    """Hydra initialised on the repository's `conf/` (for `compose`), cleared before and after."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        yield
    GlobalHydra.instance().clear()


def load_benchmark(name: str):
    """`benchmarks/<name>.py` as a module (the folder is not a package), to test its functions."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

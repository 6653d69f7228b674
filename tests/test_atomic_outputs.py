"""Nothing half-written (issue 26): a job killed with `kill -9` while it writes an export or a rollout shard, or whose
disk fills up while it writes an export or a checkpoint, leaves the previous version or the new one, complete; a full
disk ends in one line saying so, and the relaunch resumes."""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from itertools import count
from pathlib import Path

import datasets
import lightning as L
import pytest
import torch
import tqdm
import transformers
from hydra import compose
from safetensors.torch import load_file
from test_exports import tiny_lm
from torch.utils.data import TensorDataset

from specdistill.data.arith_tokenizer import arith_tokenizer
from specdistill.export.hf import export_pretrained
from specdistill.export.publish import publish_export
from specdistill.rollout.storage import load_shards, prepare_out_dir, shard_path, write_shard

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "PYTHONDONTWRITEBYTECODE": "1"}
EMBEDDING = "gpt_neox.embed_in.weight"  # its [0, 0] entry holds the version an export was written with
KILLS = 10


# -- what is written ------------------------------------------------------------------------------------------------


def cpu_trainer() -> L.Trainer:
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)


def export_version(trainer: L.Trainer, model: torch.nn.Module, tokenizer, out: Path, version: int) -> None:
    """The export of a stage (`publish_export` of `export_pretrained`); weights and metadata both carry `version`."""
    with torch.no_grad():
        model.get_input_embeddings().weight[0, 0] = float(version)
    write = lambda folder: export_pretrained(model, tokenizer, folder, {"version": version})  # noqa: E731
    publish_export(trainer, model, out, write, {"version": version})


def export_problems(out: Path, reference: dict[str, bytes]) -> list[str]:
    """What is wrong with the export at `out`: nothing when it is one version, complete (`reference`: a complete
    export's files; all but the weights and `specdistill.json` are the same in every version)."""
    if not out.is_dir():
        return [f"{out} is missing"]
    names = sorted(p.name for p in out.iterdir())
    if names != sorted(reference):
        return [f"files {names}, expected {sorted(reference)}"]
    problems = [
        f"{name} differs from a complete export"
        for name, data in reference.items()
        if name not in ("model.safetensors", "specdistill.json") and (out / name).read_bytes() != data
    ]
    try:
        version = json.loads((out / "specdistill.json").read_text())["version"]
        marker = load_file(out / "model.safetensors")[EMBEDDING][0, 0].item()
    except Exception as error:  # a truncated file
        return [*problems, f"unreadable: {error!r}"]
    if marker != version:
        problems.append(f"weights of version {marker:g} beside specdistill.json of version {version}")
    return problems


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


SHARD_FEATURES = datasets.Features(
    {"prompt_index": datasets.Value("int64"), "tokens": datasets.Sequence(datasets.Value("int64"))}
)
SHARD_SETTINGS = {"num_prompts": 10**6, "shard_size": 4}  # more shards than a writer gets through


def shard_columns(index: int) -> dict[str, list]:
    rows = range(4 * index, 4 * index + 4)
    return {"prompt_index": list(rows), "tokens": [[row] * 200 for row in rows]}


def write_rollouts_forever(out: Path) -> None:
    """A rollout run (resumed: the shards a killed run finished are skipped), writing shards until it is killed."""
    finished = set(prepare_out_dir(out, SHARD_SETTINGS))
    for index in count():
        if index not in finished:
            write_shard(out, index, shard_columns(index), SHARD_FEATURES)


def rollout_problems(out: Path) -> list[str]:
    """Every shard there is complete, the shards are 0..n-1, and the storage loads."""
    shards = sorted(p.name for p in (out / "shards").iterdir() if p.name.startswith("shard_"))
    problems = [] if shards == [shard_path(out, i).name for i in range(len(shards))] else [f"shards {shards}"]
    for index in range(len(shards)):
        try:
            rows = datasets.load_from_disk(str(shard_path(out, index))).to_dict()
        except Exception as error:
            problems.append(f"shard {index} unreadable: {error!r}")
            continue
        if rows != shard_columns(index):
            problems.append(f"shard {index} holds other rows")
    if shards and not problems:
        load_shards(out, allow_incomplete=True)
    return problems


# -- kill -9 at random points ---------------------------------------------------------------------------------------


def kill_rounds(write_forever: Callable[[int], None], check: Callable[[], list[str]], seed: int) -> list[str]:
    """`KILLS` times: fork a writer, `kill -9` it after a random delay, then `check` what a reader finds."""
    rng = random.Random(seed)
    problems = []
    started = time.monotonic()
    for round_ in range(KILLS):
        pid = os.fork()
        if pid == 0:
            try:
                write_forever(round_)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.05, 0.5))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if not os.WIFSIGNALED(status):
            problems.append(f"round {round_}: the writer stopped before it was killed")
        problems += [f"round {round_}: {problem}" for problem in check()]
        print(f"round {round_}: killed after {time.monotonic() - started:.1f}s", file=sys.stderr, flush=True)
    return problems


def main() -> None:
    """`python -c 'import test_atomic_outputs as t; t.main()' export|rollouts <folder>`: the kill rounds in a fresh
    process (forked writers start at once, with everything imported), printing the problems found as JSON."""
    torch.set_num_threads(1)  # a forked child must not inherit a busy thread pool
    # tqdm's default lock is a semaphore shared with forked children: one killed while it held the lock (a progress
    # bar of save_pretrained or datasets) would leave it held and hang this process's next export. A lock of this
    # process alone, no monitor thread, and no transformers bars at all.
    tqdm.tqdm.set_lock(threading.RLock())
    tqdm.tqdm.monitor_interval = 0
    transformers.utils.logging.disable_progress_bar()
    kind, folder = sys.argv[1], Path(sys.argv[2])
    if kind == "export":
        trainer, model, tokenizer = (
            cpu_trainer(),
            tiny_lm(300, seed=0),
            arith_tokenizer(vocab_size=300, train_size=200),
        )
        out = folder / "export"
        export_version(trainer, model, tokenizer, out, 0)
        reference = snapshot(out)

        def write_forever(round_: int) -> None:
            for i in count(1):
                export_version(trainer, model, tokenizer, out, 1000 * round_ + i)

        problems = kill_rounds(write_forever, lambda: export_problems(out, reference), seed=0)
        export_version(trainer, model, tokenizer, out, -1)  # a relaunch writes its export over what is left
        problems += export_problems(out, reference)
    else:
        out = folder / "rollouts"
        problems = kill_rounds(lambda _: write_rollouts_forever(out), lambda: rollout_problems(out), seed=1)
        prepare_out_dir(out, SHARD_SETTINGS)  # a relaunch: leftovers of the killed writes are removed
        problems += [
            f"left over: {p.name}" for p in (out / "shards").iterdir() if not p.name.startswith("shard_")
        ]
    print(json.dumps(problems))


def run_kill_rounds(kind: str, folder: Path) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", "import test_atomic_outputs as t; t.main()", kind, str(folder)],
        env=ENV, capture_output=True, text=True, timeout=600,  # seconds alone; a loaded machine is much slower
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def tokenizer():
    # built here first: the subprocesses find it in the session's cache (they write nothing but their outputs)
    return arith_tokenizer(vocab_size=300, train_size=200)


def test_kill_9_during_an_export_leaves_the_old_or_the_new_export_complete(tokenizer, tmp_path: Path) -> None:
    assert run_kill_rounds("export", tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary folder left beside it


def test_kill_9_during_a_rollout_shard_write_leaves_only_complete_shards(tmp_path: Path) -> None:
    assert run_kill_rounds("rollouts", tmp_path) == []


# -- a full disk ----------------------------------------------------------------------------------------------------


def run_with_file_size_limit(code: str, *args: str, limit: int) -> subprocess.CompletedProcess:
    """Run Python `code` where no file can grow past `limit` bytes: a write beyond fails with EFBIG ("File too
    large", as a full disk fails with ENOSPC) since SIGXFSZ, which would kill the process, is ignored."""

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    return subprocess.run(
        [sys.executable, "-c", code, *args], env=ENV, preexec_fn=limit_file_size, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def assert_disk_full_error(proc: subprocess.CompletedProcess, path: Path) -> None:
    """The launch ended as `train.py` ends on a user error: one line naming the path and the fix, exit code 74."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 74, proc.stderr[-4000:]
    assert lines[-1].startswith(f"error: {path}") and "disk is full" in lines[-1] and "relaunch" in lines[-1]


EXPORT_UNDER_LIMIT = """
import sys
from pathlib import Path
from specdistill.cli import report_user_error
from specdistill.errors import UserError
from test_atomic_outputs import arith_tokenizer, cpu_trainer, export_version, tiny_lm
try:
    export_version(cpu_trainer(), tiny_lm(300, seed=0), arith_tokenizer(vocab_size=300, train_size=200), Path(sys.argv[1]), 1)
except UserError as error:
    report_user_error(error)
"""


def test_a_full_disk_during_an_export_keeps_the_previous_export_and_says_so(
    tokenizer, tmp_path: Path
) -> None:
    out = tmp_path / "export"
    model = tiny_lm(300, seed=0)
    export_version(cpu_trainer(), model, tokenizer, out, 0)
    before = snapshot(out)
    assert (
        len(before["model.safetensors"])
        > 50_000
        > max(len(data) for data in before.values() if len(data) < 50_000)
    )

    proc = run_with_file_size_limit(EXPORT_UNDER_LIMIT, str(out), limit=50_000)
    assert_disk_full_error(proc, out)
    assert snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["export"]

    export_version(cpu_trainer(), model, tokenizer, out, 1)  # the relaunch, with space again
    assert export_problems(out, before) == []
    assert json.loads((out / "specdistill.json").read_text())["version"] == 1


class Regression(L.LightningModule):
    """A stage's module, tiny: a linear layer big enough that its checkpoint exceeds the file-size limit."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(128, 128)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def fit_tiny_stage(out_dir: Path, max_steps: int) -> L.Trainer:
    """A stage's training as `stage=sft` runs it (its Trainer, its `fit` resuming from `checkpoints/last.ckpt`)."""
    from helpers import hydra_conf

    from specdistill.stages.trainer import build_trainer, fit, trainer_config

    with hydra_conf():
        cfg = compose("train", overrides=["stage=sft", "++trainer.enable_progress_bar=false"])
    cfg.logger = None
    trainer_cfg = trainer_config(cfg, "sft")
    trainer_cfg.max_epochs, trainer_cfg.max_steps = None, max_steps
    trainer = build_trainer(cfg, "sft", out_dir, trainer_cfg)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(8, 128, generator=generator), torch.randn(8, 128, generator=generator))
    fit(trainer, Regression(), L.LightningDataModule.from_datasets(data, batch_size=2))
    return trainer


CHECKPOINT_UNDER_LIMIT = """
import sys
from pathlib import Path
from specdistill.cli import report_user_error
from specdistill.errors import UserError
from test_atomic_outputs import fit_tiny_stage
try:
    fit_tiny_stage(Path(sys.argv[1]), max_steps=8)
except UserError as error:
    report_user_error(error)
"""


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one_says_so_and_the_relaunch_resumes(
    tmp_path: Path,
) -> None:
    last = tmp_path / "checkpoints" / "last.ckpt"
    fit_tiny_stage(tmp_path, max_steps=4)
    before = last.read_bytes()
    assert torch.load(last, weights_only=True)["global_step"] == 4 and len(before) > 100_000

    proc = run_with_file_size_limit(CHECKPOINT_UNDER_LIMIT, str(tmp_path), limit=100_000)
    assert_disk_full_error(proc, last)
    assert last.read_bytes() == before and sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]

    trainer = fit_tiny_stage(tmp_path, max_steps=8)  # the relaunch, with space again: resumes at step 4
    assert trainer.ckpt_path == str(last) and trainer.global_step == 8
    assert torch.load(last, weights_only=True)["global_step"] == 8

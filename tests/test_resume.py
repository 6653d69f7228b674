"""Preemption-safe resume: checkpoint on the requeue signal, same weights after a restart, fingerprints refuse mixes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from specdistill.callbacks.fingerprint import RunFingerprint
from specdistill.callbacks.preemption import PreemptionCheckpoint, SignalAtStep
from specdistill.utils.cluster import (
    DEBUG_SIGNAL_ENV,
    FINGERPRINT_FILE,
    PREEMPTED_EXIT_CODE,
    check_run_dir,
    run_fingerprint,
)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


# -- fingerprints ---------------------------------------------------------------------------------------------------


def test_run_directory_of_another_run_is_refused_with_the_fix(tmp_path: Path) -> None:
    first = run_fingerprint(composed("stage=distill"))
    check_run_dir(tmp_path, first)
    assert (tmp_path / FINGERPRINT_FILE).is_file()
    check_run_dir(tmp_path, first)  # the same run resumes
    # where it runs, on what hardware and for how long may change on resume
    # ... and so may the trainer settings typed on the command line
    same = run_fingerprint(
        composed(
            "stage=distill",
            "trainer=ddp",
            "distill.trainer.max_steps=99",
            "logger=wandb",
            "trainer.max_epochs=7",
        )
    )
    check_run_dir(tmp_path, same)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"")  # the first run trained: the folder is taken
    other = run_fingerprint(composed("stage=distill", "distill.optimizer.lr=1e-3"))
    with pytest.raises(ValueError, match=r"distill\.optimizer\.lr.*hydra\.run\.dir"):
        check_run_dir(tmp_path, other)


def test_models_fingerprint_changes_only_with_the_models() -> None:
    base = run_fingerprint(composed("stage=distill"))
    assert run_fingerprint(composed("stage=distill", "distill.optimizer.lr=1e-3"))["models"] == base["models"]
    changed = run_fingerprint(composed("stage=distill", "models.draft.config.hidden_size=48"))
    assert changed["models"] != base["models"] and changed["fingerprint"] != base["fingerprint"]


class Regression(L.LightningModule):
    """One linear layer; SGD, so the weights depend on every batch and its order."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator))
    return DataLoader(data, batch_size=4)  # 4 micro-batches: 2 optimizer steps per epoch with accumulation 2


def trainer(root: Path, callbacks: list[L.Callback], max_steps: int = 4) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        accumulate_grad_batches=2,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
    )


def test_checkpoint_of_other_models_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "a.ckpt"
    mine = run_fingerprint(composed("stage=distill"))
    first = trainer(tmp_path, [RunFingerprint(mine)], max_steps=1)
    first.fit(Regression(), loader())
    first.save_checkpoint(ckpt)
    assert torch.load(ckpt, weights_only=False)["specdistill"]["models"] == mine["models"]

    other = run_fingerprint(composed("stage=distill", "models.draft.config.hidden_size=48"))
    with pytest.raises(ValueError, match=r"other models.*draft\.config\.hidden_size"):
        trainer(tmp_path, [RunFingerprint(other)], max_steps=2).fit(Regression(), loader(), ckpt_path=ckpt)
    trainer(tmp_path, [RunFingerprint(mine)], max_steps=2).fit(Regression(), loader(), ckpt_path=ckpt)


# -- checkpoint on the requeue signal -------------------------------------------------------------------------------


def test_signal_saves_at_a_step_boundary_chains_the_previous_handler_and_resumes(tmp_path: Path) -> None:
    reference = Regression()
    trainer(tmp_path / "ref", []).fit(reference, loader())

    calls: list[int] = []
    previous = signal.signal(
        signal.SIGUSR1, lambda signum, frame: calls.append(signum)
    )  # stands in for submitit
    try:
        ckpt = tmp_path / "last.ckpt"
        interrupted = Regression()
        with pytest.raises(SystemExit) as stop:
            trainer(tmp_path, [SignalAtStep(2), PreemptionCheckpoint(ckpt)]).fit(interrupted, loader())
        assert stop.value.code == PREEMPTED_EXIT_CODE
        assert calls == [signal.SIGUSR1]  # the previous handler ran after the checkpoint was written
        assert torch.load(ckpt, weights_only=False)["global_step"] == 2
        assert signal.getsignal(signal.SIGUSR1) is not None  # teardown gave the handler back
    finally:
        signal.signal(signal.SIGUSR1, previous)

    resumed = Regression()
    trainer(tmp_path, [PreemptionCheckpoint(ckpt)]).fit(resumed, loader(), ckpt_path=ckpt)
    torch.testing.assert_close(resumed.layer.weight, reference.layer.weight, rtol=0, atol=0)


def test_signal_mid_accumulation_window_waits_for_the_optimizer_step(tmp_path: Path) -> None:
    class SignalAtBatch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 2:  # first micro-batch of the second window
                os.kill(os.getpid(), signal.SIGUSR1)

    ckpt = tmp_path / "last.ckpt"
    with pytest.raises(SystemExit):
        trainer(tmp_path, [SignalAtBatch(), PreemptionCheckpoint(ckpt)]).fit(Regression(), loader())
    saved = torch.load(ckpt, weights_only=False)
    assert saved["global_step"] == 2
    assert saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"] == 4


# -- train.py killed and relaunched -------------------------------------------------------------------------------------

TINY_DISTILL = [
    "stage=distill",
    "task.max_examples.train=32",
    "task.max_examples.validation=4",
    "task.max_examples.test=4",
    "distill.trainer.max_steps=4",
    "distill.trainer.max_epochs=10",
    "distill.batch_size=4",
    "trainer.accumulate_grad_batches=2",
    "distill.max_length=64",
    "models.target.config.hidden_size=32",
    "models.target.config.intermediate_size=64",
    "models.target.config.num_hidden_layers=2",
    "models.target.config.num_attention_heads=2",
    "models.draft.config.hidden_size=16",
    "models.draft.config.intermediate_size=32",
    "models.draft.config.num_attention_heads=2",
    "+trainer.enable_progress_bar=false",
]  # 32 examples / (4 x 2) = 4 optimizer steps per epoch


def train(run_dir: Path, *overrides: str, signal_at: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
    env.pop(DEBUG_SIGNAL_ENV, None)
    if signal_at is not None:
        env[DEBUG_SIGNAL_ENV] = str(signal_at)
    command = [sys.executable, "train.py", *TINY_DISTILL, *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def draft_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "export" / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    done = train(run_dir, "distill.trainer.max_steps=6")
    assert done.returncode == 0, done.stderr[-3000:]
    return draft_weights(run_dir)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_draft_weights(tmp_path: Path, uninterrupted) -> None:
    killed = train(tmp_path, "distill.trainer.max_steps=6", signal_at=4)  # at the epoch boundary
    assert killed.returncode == PREEMPTED_EXIT_CODE, killed.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file() and not (tmp_path / "export").exists()

    resumed = train(tmp_path, "distill.trainer.max_steps=6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr + resumed.stdout
    assert_same_weights(draft_weights(tmp_path), uninterrupted)

    other = train(tmp_path, "distill.trainer.max_steps=6", "distill.optimizer.lr=1e-2")
    assert other.returncode != 0
    assert "hydra.run.dir" in other.stderr + other.stdout


@pytest.mark.slow
def test_run_killed_mid_epoch_resumes_to_the_same_draft_weights(tmp_path: Path, uninterrupted) -> None:
    killed = train(tmp_path, "distill.trainer.max_steps=6", signal_at=2)
    assert killed.returncode == PREEMPTED_EXIT_CODE, killed.stderr[-3000:]
    resumed = train(tmp_path, "distill.trainer.max_steps=6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(draft_weights(tmp_path), uninterrupted)

"""The training progress bar ends where the run stops: real Lightning Trainers with max_steps, gradient accumulation,
limit_train_batches and several epochs, for both bar kinds."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from specdistill.callbacks.progress import (
    RunRichProgressBar,
    RunTQDMProgressBar,
    batches_this_epoch,
    last_epoch,
)


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class BarAtEpochEnd(L.Callback):
    """Records each epoch's training bar as `(description, completed, total)`."""

    def __init__(self) -> None:
        self.epochs: list[tuple[str, float, float]] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        bar = trainer.progress_bar_callback
        if isinstance(bar, RunRichProgressBar):
            task = bar.progress.tasks[bar.train_progress_bar_id]
            self.epochs.append((task.description.strip(), task.completed, task.total))
        else:
            tqdm = bar.train_progress_bar
            self.epochs.append((tqdm.desc.rstrip(": "), tqdm.n, tqdm.total))


def fit(
    bar, num_batches: int, ckpt_path: str | None = None, **trainer_kwargs
) -> tuple[L.Trainer, BarAtEpochEnd]:
    recorder = BarAtEpochEnd()
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[bar, recorder],
        **trainer_kwargs,
    )
    data = TensorDataset(torch.randn(2 * num_batches, 2), torch.randn(2 * num_batches, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small-data and resumable-loader notices
        trainer.fit(Regression(), DataLoader(data, batch_size=2), ckpt_path=ckpt_path)
    return trainer, recorder


BARS = [RunRichProgressBar, RunTQDMProgressBar]


@pytest.mark.parametrize("bar", BARS)
@pytest.mark.parametrize(
    ("num_batches", "trainer_kwargs", "per_epoch", "steps"),
    [
        # the reported case: 2 optimizer steps of 4 micro-batches in an epoch of 14 (Lightning's bar: 8/14)
        (14, {"max_steps": 2, "accumulate_grad_batches": 4, "max_epochs": 3}, [8], 2),
        # limit_train_batches=4 of 6, accumulation 2, 5 steps over 10 allowed epochs: 2 + 2 + 1 steps
        (
            6,
            {"max_steps": 5, "accumulate_grad_batches": 2, "limit_train_batches": 4, "max_epochs": 10},
            [4, 4, 2],
            5,
        ),
        # an epoch of 5 with accumulation 2 steps 3 times (the last window is partial); the 4th step is 2 batches on
        (5, {"max_steps": 4, "accumulate_grad_batches": 2, "max_epochs": 5}, [5, 2], 4),
        # epochs alone bound the run
        (3, {"max_epochs": 2}, [3, 3], 6),
    ],
)
def test_each_epoch_bar_ends_full_where_the_run_stops(bar, num_batches, trainer_kwargs, per_epoch, steps):
    trainer, recorder = fit(bar(), num_batches, **trainer_kwargs)
    assert trainer.global_step == steps
    assert [(completed, total) for _, completed, total in recorder.epochs] == [(n, n) for n in per_epoch]
    last = len(per_epoch) - 1
    descriptions = [description for description, _, _ in recorder.epochs]
    if bar is RunRichProgressBar:  # names the last epoch the run reaches, not max_epochs - 1
        assert descriptions == [f"Epoch {i}/{last}" for i in range(len(per_epoch))]
    else:
        assert descriptions == [f"Epoch {i}" for i in range(len(per_epoch))]


@pytest.mark.parametrize("bar", BARS)
def test_a_run_resumed_mid_epoch_counts_the_batches_it_already_did(bar, tmp_path):
    """2 steps of accumulation 2 stop at micro-batch 4 of 8; resumed to 5 steps, epoch 0 runs batches 5-8 (its bar
    8/8: counted from the 3 steps left alone it would be 6) and epoch 1 the 2 batches of the last step."""
    trainer, _ = fit(bar(), 8, max_steps=2, accumulate_grad_batches=2, max_epochs=5)
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    trainer, recorder = fit(
        bar(), 8, str(tmp_path / "mid.ckpt"), max_steps=5, accumulate_grad_batches=2, max_epochs=5
    )
    assert trainer.global_step == 5
    assert [(completed, total) for _, completed, total in recorder.epochs] == [(8, 8), (2, 2)]


def test_bar_sizes_are_pure_functions_of_the_run():
    assert batches_this_epoch(250, 1, 30, 0) == 30
    assert batches_this_epoch(250, 1, -1, 0) == 250
    assert batches_this_epoch(14, 4, 2, 0) == 8
    assert batches_this_epoch(6, 2, 5, 2, batches_done=4) == 6
    assert batches_this_epoch(float("inf"), 2, 3, 0) == 6
    assert last_epoch(14, 4, 2, 3) == 0
    assert last_epoch(5, 2, 4, 5) == 1
    assert last_epoch(3, 1, -1, 2) == 1
    assert last_epoch(float("inf"), 1, 10, -1) is None

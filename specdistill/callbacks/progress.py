"""Training progress bars sized to what the run will do.

Lightning sizes the training bar to the epoch's micro-batches and caps it by `max_steps` only when
`max_epochs=-1`, so a 2-step run of a stage that also sets `max_epochs` showed `2/6` (`8/14` with accumulation 4)
and `Epoch 0/2`. These bars end where the run stops: each epoch's total is the micro-batches it will run before
`max_steps` (`batches_this_epoch`), and the Rich bar's `Epoch i/last` names the last epoch the run reaches
(`last_epoch`). `training_progress_bar()` picks Rich when it is installed, as Lightning does.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE


def batches_this_epoch(
    num_batches: int | float, accumulate: int, max_steps: int | None, global_step: int, batches_done: int = 0
) -> int | float:
    """The micro-batches an epoch of `num_batches` runs (its bar's total) when `global_step` optimizer steps are done.

    Lightning steps the optimizer after every `accumulate` micro-batches of an epoch (and after its last one), so
    `max_steps` stops the epoch at the end of the window holding its last step. `batches_done` is the micro-batch the
    epoch starts from (a run resumed mid-epoch, a whole number of windows).
    """
    if max_steps is None or max_steps < 0:
        return num_batches
    remaining = max(0, max_steps - global_step)
    return min(num_batches, accumulate * (batches_done // accumulate + remaining))


def last_epoch(
    num_batches: int | float, accumulate: int, max_steps: int | None, max_epochs: int | None
) -> int | None:
    """The index of the last epoch a run starting at epoch 0 reaches; None when nothing bounds it."""
    bounds = []
    if max_epochs is not None and max_epochs >= 0:
        bounds.append(max_epochs - 1)
    if max_steps is not None and max_steps > 0 and num_batches not in (0, math.inf):
        steps_per_epoch = math.ceil(num_batches / accumulate)
        bounds.append(math.ceil(max_steps / steps_per_epoch) - 1)
    return min(bounds) if bounds else None


class _SizedToTheRun(ProgressBar):
    """The training-bar total of `batches_this_epoch`, corrected at an epoch's first batch (a resumed epoch starts
    after its first batches)."""

    _batches_done = 0
    _epoch_started = False

    @property
    def total_train_batches(self) -> int | float:
        trainer = self.trainer
        return batches_this_epoch(
            trainer.num_training_batches,
            trainer.accumulate_grad_batches,
            trainer.max_steps,
            trainer.global_step,
            self._batches_done,
        )

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._batches_done = 0
        self._epoch_started = False
        super().on_train_epoch_start(trainer, pl_module)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if not self._epoch_started:
            self._epoch_started = True
            if batch_idx:
                self._batches_done = batch_idx
                self._set_train_total(self.total_train_batches)

    def _set_train_total(self, total: int | float) -> None:
        raise NotImplementedError

    def _run_last_epoch(self) -> int | None:
        trainer = self.trainer
        return last_epoch(trainer.num_training_batches, trainer.accumulate_grad_batches, trainer.max_steps,
                          trainer.max_epochs)  # fmt: skip


class RunTQDMProgressBar(_SizedToTheRun, TQDMProgressBar):
    """Lightning's tqdm bar, sized to the run."""

    def _set_train_total(self, total: int | float) -> None:
        if self._train_progress_bar is not None:
            self._train_progress_bar.total = total
            self._train_progress_bar.refresh()


class RunRichProgressBar(_SizedToTheRun, RichProgressBar):
    """Lightning's Rich bar, sized to the run, with `Epoch i/last` naming the last epoch the run reaches."""

    def _set_train_total(self, total: int | float) -> None:
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, total=total)

    def _get_train_description(self, current_epoch: int) -> str:
        last = self._run_last_epoch()
        description = f"Epoch {current_epoch}" + (f"/{last}" if last is not None else "")
        # as Lightning does: padded to the validation bar's description, so the two do not flicker
        return f"{description:{len(self.validation_description)}}"


def training_progress_bar() -> ProgressBar:
    """The bar Lightning would pick (Rich when installed, else tqdm), sized to the run."""
    return RunRichProgressBar() if _RICH_AVAILABLE else RunTQDMProgressBar()

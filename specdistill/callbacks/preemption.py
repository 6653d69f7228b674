"""Checkpoint-on-signal: a cluster's end-of-job signal becomes `last.ckpt` at a step boundary, then a requeue
(the sequence: specdistill/utils/cluster.py)."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning as L

from specdistill.utils.cluster import PREEMPTED_EXIT_CODE, as_signal, requeue_slurm_job

log = logging.getLogger(__name__)


class PreemptionCheckpoint(L.Callback):
    """Save `last.ckpt` at the next optimizer-step boundary after a requeue signal, then requeue and exit.

    Args:
        ckpt_path: where to save (the same `last.ckpt` that `common.fit` resumes from).
        signals: signals announcing the end of the job (USR2: submitit; USR1: Lightning/hand-written sbatch).
        requeue: without a previous handler (no submitit), call `scontrol requeue $SLURM_JOB_ID` on SLURM.
    """

    def __init__(
        self, ckpt_path: str | Path, signals: Iterable[str | int] = ("USR1", "USR2"), requeue: bool = True
    ) -> None:
        self.ckpt_path = Path(ckpt_path)
        self.signals = [as_signal(s) for s in signals]
        self.requeue = requeue
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._last_step = -1

    # Installed in `setup`, before Lightning registers its own handlers (it keeps an existing USR1 handler).
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or self._previous:
            return
        for signum in self.signals:
            try:
                self._previous[signum] = signal.signal(signum, self._on_signal)
            except ValueError:  # not the main thread: leave signals to whoever owns them
                log.warning(
                    "PreemptionCheckpoint: cannot install a %s handler outside the main thread", signum.name
                )

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_step = trainer.global_step  # a resumed run may restart mid accumulation window

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only record: saving here could interleave with an optimizer step or a collective.
        self.received = signal.Signals(signum)
        log.warning("received %s: checkpointing at the next optimizer step", self.received.name)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        # Act only right after an optimizer step: mid-window the accumulated gradients are not in a checkpoint.
        if trainer.global_step == self._last_step:
            return
        self._last_step = trainer.global_step
        if not trainer.strategy.reduce_boolean_decision(self.received is not None, all=False):
            return
        trainer.save_checkpoint(self.ckpt_path)
        log.warning("saved %s at step %d before the job ends", self.ckpt_path, trainer.global_step)
        received = self.received or self.signals[0]
        previous = self._previous.get(received)
        if callable(previous):
            # submitit's handler: requeue with the same arguments, then exit (rank 0); other ranks return.
            previous(int(received), None)
        elif self.requeue and trainer.is_global_zero and os.environ.get("SLURM_JOB_ID"):
            requeue_slurm_job()
        raise SystemExit(PREEMPTED_EXIT_CODE)


class SignalAtStep(L.Callback):
    """Test/debug aid: send a signal to this process after optimizer step `step`, as SLURM would near a time limit.

    Enabled by `SPECDISTILL_SIGNAL_AT_STEP=<step>` (see `scaleout_callbacks`).
    """

    def __init__(self, step: int, signum: str | int = "USR1") -> None:
        self.step = step
        self.signum = as_signal(signum)
        self._sent = False

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if not self._sent and trainer.global_step >= self.step:
            self._sent = True
            os.kill(os.getpid(), self.signum)

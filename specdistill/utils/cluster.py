"""Running on clusters: SLURM environment, checkpoint-on-signal and requeue, run fingerprints for safe resumes.

How a time limit or preemption notice becomes a resumed run:

1. SLURM sends a signal some seconds before the time limit (`#SBATCH --signal=USR2@<signal_delay_s>` written by the
   submitit launcher; `USR1` for hand-written sbatch scripts, Lightning's convention).
2. `PreemptionCheckpoint` only records it in the handler (a handler may fire in the middle of an optimizer step, or
   of a collective); at the next optimizer-step boundary all ranks agree, save `<run_dir>/checkpoints/last.ckpt`
   together, and then the previous handler runs: submitit's requeues the job with the same arguments (same Hydra
   config and run directory) and exits; without submitit, rank 0 calls `scontrol requeue` on SLURM, and every rank
   exits with `PREEMPTED_EXIT_CODE`.
3. The requeued job (or any re-launch with the same `hydra.run.dir`) resumes from `last.ckpt`
   (`specdistill.stages.common.fit`), with the data order restored by the datamodule's stateful sampler.

`RunFingerprint` and `check_run_dir` make the resume refuse a checkpoint or a run directory that belongs to another
model or configuration.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from specdistill.utils.fingerprint import (  # noqa: F401  (re-exported: the fingerprints' historical home)
    BASE_FINGERPRINT_KEYS,
    CHECKPOINT_SIGNATURE,
    FINGERPRINT_FILE,
    FINGERPRINT_KEYS,
    RESUMABLE_LEAF_KEYS,
    config_differences,
    run_fingerprint,
)

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"
DEBUG_SIGNAL_ENV = "SPECDISTILL_SIGNAL_AT_STEP"


def slurm_environment(auto_requeue: bool = False) -> SLURMEnvironment | None:
    """Lightning's SLURM cluster environment when running as SLURM tasks, else None (Lightning picks its default).

    World size, global/local/node ranks and the master address come from SLURM (`SLURM_NTASKS`, `SLURM_PROCID`,
    `SLURM_LOCALID`, `SLURM_NODEID`, `SLURM_NODELIST`). Lightning's own auto-requeue is off by default because it
    saves from inside the signal handler, possibly mid-step; `PreemptionCheckpoint` does it at a step boundary.
    """
    if not SLURMEnvironment.detect():
        return None
    return SLURMEnvironment(auto_requeue=auto_requeue)


def _signal(value: str | int | signal.Signals) -> signal.Signals:
    if isinstance(value, signal.Signals):
        return value
    if isinstance(value, int):
        return signal.Signals(value)
    name = value.upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    if not hasattr(signal, name):
        raise ValueError(f"unknown signal {value!r}; use a name such as USR1 or USR2")
    return signal.Signals(getattr(signal, name))


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
        self.signals = [_signal(s) for s in signals]
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


def requeue_slurm_job() -> None:
    """`scontrol requeue` the current SLURM job (array task aware); logs and does not raise on failure."""
    job_id = os.environ["SLURM_JOB_ID"]
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        job_id = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    result = subprocess.run(["scontrol", "requeue", job_id], check=False, capture_output=True, text=True)
    if result.returncode == 0:
        log.warning("requeued SLURM job %s", job_id)
    else:
        log.error("scontrol requeue %s failed (%s): %s", job_id, result.returncode, result.stderr.strip())


class SignalAtStep(L.Callback):
    """Test/debug aid: send a signal to this process after optimizer step `step`, as SLURM would near a time limit.

    Enabled by `SPECDISTILL_SIGNAL_AT_STEP=<step>` (see `scaleout_callbacks`).
    """

    def __init__(self, step: int, signum: str | int = "USR1") -> None:
        self.step = step
        self.signum = _signal(signum)
        self._sent = False

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        if not self._sent and trainer.global_step >= self.step:
            self._sent = True
            os.kill(os.getpid(), self.signum)


# -- fingerprints --------------------------------------------------------------------------------------------------


def check_run_dir(out_dir: str | Path, fingerprint: Mapping[str, Any]) -> None:
    """Refuse to run in a directory that holds another run; record this run's fingerprint there otherwise.

    See `specdistill.utils.run_dir.check_stage_dir` (a folder without results does not lock it).

    Raises:
        RunDirConflictError (a ValueError): the directory holds results of a run with another fingerprint.
    """
    from specdistill.utils.run_dir import check_stage_dir, write_record

    if check_stage_dir(out_dir, fingerprint) == "fresh" and rank_zero_only.rank == 0:
        write_record(out_dir, fingerprint)


class RunFingerprint(L.Callback):
    """Write the run's model fingerprint into every checkpoint and refuse to load a checkpoint of other models.

    Stored under `checkpoint["specdistill"] = {"models": <hash>, "fingerprint": <hash>, "models_config": {...}}`;
    a checkpoint directory (DeepSpeed) also gets `CHECKPOINT_SIGNATURE` beside its files once saved, which
    `specdistill.utils.run_dir.check_checkpoint` reads before DeepSpeed unpickles anything.
    """

    def __init__(self, fingerprint: Mapping[str, Any]) -> None:
        self.models = fingerprint["models"]
        self.fingerprint = fingerprint["fingerprint"]
        self.models_config = fingerprint["config"].get("models")

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if getattr(strategy.save_checkpoint, "_specdistill_signs", False):
            return
        save = strategy.save_checkpoint

        def save_and_sign(checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
            save(checkpoint, filepath, storage_options=storage_options)
            if Path(filepath).is_dir() and trainer.is_global_zero:
                sign_checkpoint_dir(filepath, {"fingerprint": self.fingerprint, "models": self.models})

        save_and_sign._specdistill_signs = True  # type: ignore[attr-defined]
        strategy.save_checkpoint = save_and_sign  # type: ignore[method-assign]

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint["specdistill"] = {
            "models": self.models,
            "fingerprint": self.fingerprint,
            "models_config": self.models_config,
        }

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        saved = checkpoint.get("specdistill")
        if saved is None:
            log.warning(
                "checkpoint has no specdistill fingerprint (written by another tool?); loading it unchecked"
            )
            return
        if saved.get("models") != self.models:
            changed = config_differences(saved.get("models_config") or {}, self.models_config or {})
            raise ValueError(
                f"the checkpoint was written for other models (models config differs in: "
                f"{', '.join(changed[:10]) or '?'}); resume with the same models=... settings, or start a new run "
                "directory (hydra.run.dir=<new dir>)"
            )


def sign_checkpoint_dir(path: str | Path, signature: Mapping[str, Any]) -> None:
    """Write `CHECKPOINT_SIGNATURE` (the run's fingerprint) into a checkpoint directory."""
    target = Path(path) / CHECKPOINT_SIGNATURE
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(signature), sort_keys=True))
    tmp.replace(target)


def scaleout_callbacks(cfg: DictConfig, out_dir: str | Path, stage: str) -> list[L.Callback]:
    """Callbacks every training stage gets: fingerprints (checked now) and checkpoint-on-signal.

    Uses the record train.py wrote into `out_dir`; without one, checks `out_dir` against this run's fingerprint
    (`stage` names the settings group that counts) first and raises RunDirConflictError for another run's folder.
    """
    from specdistill.utils.run_dir import read_record

    # train.py (or the pipeline, for a step) checked the folder and wrote its record before anything else; a stage
    # called directly (tests, notebooks) is checked here
    fingerprint = read_record(out_dir)
    if fingerprint is None:
        fingerprint = run_fingerprint(cfg, stage)
        check_run_dir(out_dir, fingerprint)
    callbacks: list[L.Callback] = []
    debug_step = os.environ.get(DEBUG_SIGNAL_ENV)
    if debug_step:
        callbacks.append(SignalAtStep(int(debug_step)))
    callbacks += [
        RunFingerprint(fingerprint),
        PreemptionCheckpoint(Path(out_dir) / "checkpoints" / "last.ckpt"),
    ]
    return callbacks

"""The callbacks every training stage gets: the run fingerprint and checkpoint-on-signal."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
from omegaconf import DictConfig

from specdistill.callbacks.fingerprint import RunFingerprint
from specdistill.callbacks.preemption import PreemptionCheckpoint, SignalAtStep
from specdistill.utils.cluster import DEBUG_SIGNAL_ENV, check_run_dir
from specdistill.utils.fingerprint import run_fingerprint


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

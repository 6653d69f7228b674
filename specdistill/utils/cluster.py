"""Running on clusters: SLURM environment, signals and requeue, run-folder checks for safe resumes (the Lightning
callbacks that use them live in `specdistill.callbacks`: `preemption`, `fingerprint`, `scaleout`).

How a time limit or preemption notice becomes a resumed run:

1. SLURM sends a signal some seconds before the time limit (`#SBATCH --signal=USR2@<signal_delay_s>` written by the
   submitit launcher; `USR1` for hand-written sbatch scripts, Lightning's convention).
2. `PreemptionCheckpoint` only records it in the handler (a handler may fire in the middle of an optimizer step, or
   of a collective); at the next optimizer-step boundary all ranks agree, save `<run_dir>/checkpoints/last.ckpt`
   together, and then the previous handler runs: submitit's requeues the job with the same arguments (same Hydra
   config and run directory) and exits; without submitit, rank 0 calls `scontrol requeue` on SLURM, and every rank
   exits with `PREEMPTED_EXIT_CODE`.
3. The requeued job (or any re-launch with the same `hydra.run.dir`) resumes from `last.ckpt`
   (`specdistill.stages.trainer.fit`), with the data order restored by the datamodule's stateful sampler.

`RunFingerprint` (specdistill/callbacks/fingerprint.py) and `check_run_dir` make the resume refuse a checkpoint or a run directory that belongs to another
model or configuration.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_only

from specdistill.utils.fingerprint import (  # noqa: F401  (re-exported: the fingerprints' historical home)
    BASE_FINGERPRINT_KEYS,
    CHECKPOINT_SIGNATURE,
    FINGERPRINT_FILE,
    FINGERPRINT_KEYS,
    RESUMABLE_LEAF_KEYS,
    config_differences,
    run_fingerprint,
    sign_checkpoint_dir,
)

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"
DEBUG_SIGNAL_ENV = "SPECDISTILL_SIGNAL_AT_STEP"


def slurm_environment(auto_requeue: bool = False) -> SLURMEnvironment | None:
    """Lightning's SLURM cluster environment when running as SLURM tasks, else None (Lightning picks its default).

    World size, global/local/node ranks and the master address come from SLURM (`SLURM_NTASKS`, `SLURM_PROCID`,
    `SLURM_LOCALID`, `SLURM_NODEID`, `SLURM_NODELIST`). Lightning's own auto-requeue is off by default because it
    saves from inside the signal handler, possibly mid-step; `specdistill.callbacks.preemption.PreemptionCheckpoint` does it at a step boundary.
    """
    if not SLURMEnvironment.detect():
        return None
    return SLURMEnvironment(auto_requeue=auto_requeue)


def as_signal(value: str | int | signal.Signals) -> signal.Signals:
    """`"USR1"`, `"SIGUSR1"`, 10 or `signal.SIGUSR1` -> `signal.SIGUSR1`."""
    if isinstance(value, signal.Signals):
        return value
    if isinstance(value, int):
        return signal.Signals(value)
    name = value.upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    if not hasattr(signal, name):
        raise ValueError(f"unknown signal {value!r}; use a name such as USR1 or USR2")
    return signal.Signals(getattr(signal, name))


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

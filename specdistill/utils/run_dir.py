"""Run folders: check a launch against what the folder already holds before anything is written.

A run folder records what ran there in `run_fingerprint.json` (`specdistill.utils.cluster.run_fingerprint`: the
stage, its settings group and the groups that shape it). A launch into a folder is

- *fresh* when the folder holds no results (nothing, or only the record, `.hydra/` and logs of a run that stopped
  before it produced anything: such a run does not lock its folder);
- *resumed* when the record has the same fingerprint (keys that only say how long to train may differ);
- *refused* (`RunDirConflictError`, listing the differences) when the folder holds results of another run or of
  another stage. Nothing is written before this check: not the record, not `.hydra/`.

"Results" are what a relaunch must never overwrite: `result.json`, `results.json`, `report.json`, a non-empty
`export/`, `checkpoints/` or `rollouts/`, or a sub-folder holding any of these (a pipeline's steps).
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specdistill.errors import InputFileError, RunDirConflictError
from specdistill.utils.atomic import atomic_write_text
from specdistill.utils.fingerprint import (
    CHECKPOINT_SIGNATURE,
    FINGERPRINT_FILE,
    RESUMABLE_LEAF_KEYS,
    config_differences,
)

log = logging.getLogger(__name__)

RESULT_FILES = ("result.json", "results.json", "report.json")
RESULT_DIRS = (
    "export",
    "checkpoints",
    "rollouts",
)  # non-empty: trained weights, resumable state, rollout shards


def holds_results(folder: str | Path, depth: int = 1) -> bool:
    """Whether `folder` holds anything a relaunch must not overwrite (see the module docstring)."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    if any((folder / name).is_file() for name in RESULT_FILES):
        return True
    if any((folder / name).is_dir() and any((folder / name).iterdir()) for name in RESULT_DIRS):
        return True
    return depth > 0 and any(holds_results(sub, depth - 1) for sub in folder.iterdir() if sub.is_dir())


def is_rank_zero() -> bool:
    """Whether this process is global rank 0, from the launcher's environment (as Lightning reads it)."""
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if key in os.environ:
            return int(os.environ[key]) == 0
    return True


def read_record(folder: str | Path) -> dict[str, Any] | None:
    """The run record (`run_fingerprint.json`) of `folder`, or None when it has none."""
    path = Path(folder) / FINGERPRINT_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return {"fingerprint": "<unreadable>", "config": {}}


def write_record(folder: str | Path, record: Mapping[str, Any]) -> None:
    """Write `record` atomically (a crash leaves the old record or the new one, never half of one)."""
    atomic_write_text(
        Path(folder) / FINGERPRINT_FILE, json.dumps(dict(record), indent=2, sort_keys=True, default=str)
    )


def differences(
    previous: Mapping[str, Any], record: Mapping[str, Any], with_resumable: bool = False
) -> list[str]:
    """The dotted setting keys that differ between two records (the resumable leaves only if `with_resumable`)."""
    changed = config_differences(previous.get("config") or {}, record.get("config") or {})
    if not with_resumable:
        changed = [k for k in changed if k.rsplit(".", 1)[-1] not in RESUMABLE_LEAF_KEYS]
    if previous.get("upstream") != record.get("upstream"):
        changed.append("<an earlier pipeline step>")
    return changed


def describe(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit]) or "?"
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def check_stage_dir(out_dir: str | Path, record: Mapping[str, Any]) -> str:
    """Check a launch of one stage into `out_dir`; writes nothing.

    Returns:
        "fresh" or "resume".

    Raises:
        RunDirConflictError: the folder holds results of another stage, of another run, or without a record.
    """
    out_dir = Path(out_dir)
    previous = read_record(out_dir)
    taken = holds_results(out_dir)
    fix = "Use a new folder (hydra.run.dir=<new dir>, or leave hydra.run.dir unset for a fresh one)"
    if previous is None:
        if taken:
            raise RunDirConflictError(
                f"{out_dir} holds results but no {FINGERPRINT_FILE}, so nothing says what produced them; "
                f"refusing to write there. {fix}."
            )
        return "fresh"
    if previous.get("fingerprint") == record["fingerprint"]:
        return "resume"
    if not taken:
        log.warning(
            "%s holds the record of a run that stopped before producing results: replacing it", out_dir
        )
        return "fresh"
    if previous.get("config", {}).get("stage") != record["config"].get("stage"):
        raise RunDirConflictError(
            f"{out_dir} holds a {previous.get('config', {}).get('stage')!r} run; refusing to write a "
            f"{record['config'].get('stage')!r} run over its results. {fix}."
        )
    raise RunDirConflictError(
        f"{out_dir} holds another run (settings differ in: {describe(differences(previous, record))}); nothing was "
        f"written. {fix}, or relaunch with the folder's own settings to resume it."
    )


def check_checkpoint(path: str | Path, fingerprint: str | None) -> None:
    """Check a checkpoint before resuming from it; reads no pickle.

    A file must be a complete torch archive (a job killed while saving leaves a truncated one). A directory
    (DeepSpeed, whose loader calls `torch.load(weights_only=False)`, so its files could run code) is loaded only when
    its `CHECKPOINT_SIGNATURE` carries this run's fingerprint.

    Raises:
        InputFileError: an unreadable file, or an unsigned directory.
        RunDirConflictError: a directory signed by another run.
    """
    path = Path(path)
    if path.is_dir():
        signature = path / CHECKPOINT_SIGNATURE
        if not signature.is_file():
            raise InputFileError(
                f"{path} has no {CHECKPOINT_SIGNATURE}, so nothing says which run wrote it; DeepSpeed would unpickle "
                "it (torch.load(weights_only=False)), which can run code. Resume only from checkpoints this run "
                "wrote: move it away to start this stage from scratch."
            )
        saved = json.loads(signature.read_text()).get("fingerprint")
        if fingerprint is None or saved != fingerprint:
            raise RunDirConflictError(
                f"{path} was written by another run (fingerprint {saved}, this run {fingerprint}); it is not "
                "loaded. Move it away to start this stage from scratch, or relaunch with that run's settings."
            )
        return
    try:
        with zipfile.ZipFile(path) as archive:
            complete = any(name.endswith("data.pkl") for name in archive.namelist())
        problem = "" if complete else "no data.pkl in the archive"
    except (zipfile.BadZipFile, OSError) as error:
        problem = str(error)
    if problem:
        raise InputFileError(
            f"{path} is not a readable checkpoint ({problem}); it was probably cut short when its job was killed. "
            f"Move it away (e.g. to {path.name}.broken) to restart this stage from its start, or restore a good copy."
        )

"""The run's fingerprint in every checkpoint, checked on load (specdistill/utils/fingerprint.py makes it)."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L

from specdistill.utils.atomic import TMP_MARK, fsync_tree, raise_if_disk_full, recover, swap_into_place
from specdistill.utils.fingerprint import config_differences, sign_checkpoint_dir
from specdistill.utils.strategy import deepspeed_stage

log = logging.getLogger(__name__)


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

        signature = {"fingerprint": self.fingerprint, "models": self.models}

        def save_and_sign(checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
            if deepspeed_stage(strategy) is not None:  # a folder of every rank's shards
                save_folder_atomically(trainer, save, checkpoint, Path(filepath), storage_options, signature)
                return
            save(checkpoint, filepath, storage_options=storage_options)
            if Path(filepath).is_dir() and trainer.is_global_zero:
                sign_checkpoint_dir(filepath, signature)

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


def save_folder_atomically(
    trainer: L.Trainer,
    save: Callable[..., None],
    checkpoint: dict,
    path: Path,
    storage_options: Any,
    signature: Mapping[str, Any],
) -> None:
    """Save a checkpoint folder that every rank writes its shards into (DeepSpeed) so that `path` is only ever the
    previous complete, signed checkpoint or the new one (`specdistill/utils/atomic.py`).

    All ranks write into one staging sibling whose name they agree on without talking (`<name>.tmp-shards`); after a
    barrier rank 0 signs it, syncs it and swaps it into place, and a second barrier holds every rank until then. A
    save that dies (a kill, a full disk) leaves `path` as it was; the next save removes the staging folder first.
    """
    staging = path.with_name(f"{path.name}{TMP_MARK}shards")
    strategy = trainer.strategy
    if trainer.is_global_zero:
        recover(path)  # a folder an earlier, killed swap moved aside; leftovers
        shutil.rmtree(staging, ignore_errors=True)
    strategy.barrier()
    try:
        save(checkpoint, staging, storage_options=storage_options)
        strategy.barrier()  # every rank's shards are in the staging folder
        if trainer.is_global_zero:
            sign_checkpoint_dir(staging, signature)
            fsync_tree(staging)
            swap_into_place(staging, path)
    except Exception as error:
        if trainer.is_global_zero:
            shutil.rmtree(staging, ignore_errors=True)
        raise_if_disk_full(error, path)
        raise
    strategy.barrier()

"""How every trained model leaves a run: rank 0 writes its export, every rank waits, and the export goes up to W&B as a
model artifact when the logger was built with `log_model` (`specdistill.utils.wandb_logger.log_export`).

The export is written into a temporary folder beside `out_dir` and takes its place once complete
(`specdistill.utils.atomic.atomic_directory`): a later stage or a user reading `out_dir` sees the previous export or
the new one, never part of one, even when the job is killed or the disk fills up while it writes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch

from specdistill.utils.atomic import atomic_directory
from specdistill.utils.strategy import full_weights
from specdistill.utils.wandb_logger import log_export


def publish_export(
    trainer: L.Trainer,
    model: torch.nn.Module,
    out_dir: Path,
    write: Callable[[Path], object],
    metadata: Mapping[str, Any],
) -> Path:
    """Write `model`'s export into `out_dir` with `write` on rank 0 and upload it; returns `out_dir`.

    Args:
        trainer: the Trainer that trained `model` (its strategy, rank and logger).
        model: the trained module; under ZeRO-3 its shards are gathered while `write` runs (every rank enters).
        out_dir: the export directory; replaced whole by what `write` wrote.
        write: writes the export into the (empty, temporary) directory it is given (e.g. `export_pretrained`, `AcceptanceHead.save`).
        metadata: what the W&B artifact records (stage, task, ...).
    """
    with full_weights(model, trainer):
        if trainer.is_global_zero:
            with atomic_directory(out_dir) as tmp:
                write(tmp)
    trainer.strategy.barrier()
    log_export(trainer.logger, out_dir, metadata)
    return out_dir

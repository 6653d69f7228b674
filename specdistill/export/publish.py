"""How every trained model leaves a run: rank 0 writes its export, every rank waits, and the export goes up to W&B as a
model artifact when the logger was built with `log_model` (`specdistill.utils.wandb_logger.log_export`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch

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
        out_dir: the export directory `write` fills.
        write: writes the export into the directory it is given (e.g. `export_pretrained`, `AcceptanceHead.save`).
        metadata: what the W&B artifact records (stage, task, ...).
    """
    with full_weights(model, trainer):
        if trainer.is_global_zero:
            write(out_dir)
    trainer.strategy.barrier()
    log_export(trainer.logger, out_dir, metadata)
    return out_dir

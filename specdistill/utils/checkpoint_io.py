"""Checkpoint files written beside themselves and renamed into place (`specdistill.utils.atomic`).

Lightning's `TorchCheckpointIO` serialises into memory, writes a temporary file in the system's temporary folder
(`tempfile.mkstemp`) and moves it over the checkpoint. When that folder is on another file system than the run (a
node-local `/tmp`, a shared run folder) the move is a copy that first truncates the previous `last.ckpt`: a job
killed or a disk filled during the copy leaves neither the old checkpoint nor the new one. `AtomicCheckpointIO`
writes the same bytes into `<checkpoint>.tmp-<host>-<pid>` beside it, syncs them and renames.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from specdistill.utils.atomic import atomic_write_bytes, recover


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose `save_checkpoint` publishes a complete file or nothing (local paths)."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (as TorchCheckpointIO)")
        # the same serialisation as Lightning's `_atomic_save` (in memory), so the bytes are the same
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        recover(Path(path))  # a killed save's temporary file (rank 0 alone saves checkpoint files)
        atomic_write_bytes(Path(path), buffer.getvalue())


def use_atomic_checkpoints(trainer: L.Trainer) -> L.Trainer:
    """Give `trainer` an `AtomicCheckpointIO` where it would save with Lightning's default `TorchCheckpointIO`;
    returns it. A configured checkpoint plugin, or a strategy that does not save through one (DeepSpeed saves a
    folder), is left as it is."""
    if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
        trainer.strategy.checkpoint_io = AtomicCheckpointIO()
    return trainer

"""How every stage starts: Lightning's global seed from the root `seed` (Python, NumPy, torch and dataloader
workers; a part's own seed is specdistill/utils/seeds.py) and float32 matmul precision `high`."""

from __future__ import annotations

import lightning as L
import torch
from omegaconf import DictConfig


def seed_everything(cfg: DictConfig) -> None:
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    torch.set_float32_matmul_precision("high")

"""The optimizer and learning-rate schedule every training module configures the same way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
from torch import nn

from specdistill.utils.param_groups import weight_decay_groups


def configure_optimization(
    module: L.LightningModule,
    model: nn.Module,
    optimizer: Callable[..., Any],
    scheduler: Callable[..., Any] | None,
) -> Any:
    """`module.configure_optimizers`' answer for the trainable parameters of `model` (one of its parts).

    Weight decay skips biases and normalisation parameters (`specdistill.utils.param_groups`); the scheduler, when
    given, is called as `scheduler(optimizer, total_steps=...)` and stepped every optimizer step.
    """
    groups = weight_decay_groups(model)
    if not groups:
        raise ValueError(f"{type(model).__name__} has no trainable parameters; did it get frozen by mistake?")
    built = optimizer(groups)
    if scheduler is None:
        return built
    schedule = scheduler(built, total_steps=module.trainer.estimated_stepping_batches)
    return {"optimizer": built, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

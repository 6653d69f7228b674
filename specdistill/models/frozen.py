"""Frozen models (target, reference) held outside a LightningModule's parameters and checkpoints."""

from __future__ import annotations

import torch

from specdistill.models.loading import freeze


class Frozen:
    """Holds a frozen model without registering it as a submodule.

    A LightningModule that stores `Frozen(model)` keeps the model out of `state_dict()`, out of the optimizer and out
    of checkpoints; `to(device)` must be called explicitly (the module does it in `setup`).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = freeze(model)

    def to(self, device: torch.device | str) -> Frozen:
        self.model.to(device)
        return self

    def place(self, trainer) -> Frozen:
        """Place the model for `trainer`'s strategy: sharded with ZeRO-3 under DeepSpeed stage 3 (a 32B or 70B
        frozen target does not fit one GPU), else moved to the strategy's device. Safe to call more than once."""
        from specdistill.utils.frozen_sharding import prepare_frozen

        self.model = prepare_frozen(self.model, trainer)
        return self

    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

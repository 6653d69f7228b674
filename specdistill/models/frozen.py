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

    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

"""Frozen models (target, reference) held outside a LightningModule's parameters and checkpoints."""

from __future__ import annotations

import torch

from specdistill.caches.digest import weights_digest
from specdistill.models.loading import freeze


class Frozen:
    """Holds a frozen model without registering it as a submodule.

    A LightningModule that stores `Frozen(model)` keeps the model out of `state_dict()`, out of the optimizer and out
    of checkpoints; `to(device)` must be called explicitly (the module does it in `setup`).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = freeze(model)
        self._digest: str | None = None

    def weights_digest(self) -> str:
        """`specdistill.caches.weights_digest` of the model, taken once: the weights are frozen, and a model shared by
        two caches is hashed once. Call it before `place` under ZeRO-3 (the placed weights are partitioned)."""
        if self._digest is None:
            self._digest = weights_digest(self.model)
        return self._digest

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


def placed(model: torch.nn.Module | Frozen, trainer=None) -> torch.nn.Module:
    """What to run: a `Frozen` holder's model, placed for `trainer` first when one is given; else `model` itself."""
    if isinstance(model, Frozen):
        return (model.place(trainer) if trainer is not None else model).model
    return model


def digest_of(model: torch.nn.Module | Frozen) -> str:
    """`weights_digest` of a model, or of a `Frozen` holder's model (taken once per holder)."""
    return model.weights_digest() if isinstance(model, Frozen) else weights_digest(model)

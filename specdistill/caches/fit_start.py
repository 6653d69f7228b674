"""The one trigger of the fit-start caches: `prepare_caches(FitStart(trainer, target), providers)`.

A provider that caches something at fit start (`CacheOnceTarget`, `ScoreOnceReference`, `HiddenCache`) is a
`FitStartCache`. `DistillModule` (and `AcceptanceHeadModule`, for its `HiddenCache`) calls `prepare_caches` first
thing at fit and validation start (and test start; whichever comes first), before it places its own frozen models,
so every cache is keyed (its models' digests taken) before any model is sharded, and built with the models where
the Trainer's strategy puts them (`specdistill.caches.store.build_or_reuse`: each rank its share, rank 0 merges).
A provider that is ready already is skipped, so later hooks cost nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # models.frozen imports caches.digest: no import cycle at run time
    from specdistill.models.frozen import Frozen


@dataclass(frozen=True)
class FitStart:
    """What a fit-start cache may use.

    Attributes:
        trainer: the Lightning Trainer whose strategy has set up the devices (and process group).
        target: the module's own frozen target, when it holds one: a cache that also runs the target places it
            through this holder, so that it is placed once (None for a module trained from a cached target).
    """

    trainer: Any
    target: Frozen | None = None


class FitStartCache(ABC):
    """A provider whose values are computed once at fit start (or reused from disk) by `prepare_caches`."""

    @property
    @abstractmethod
    def ready(self) -> bool:
        """True once the cache is built or loaded (its models are released then)."""

    @abstractmethod
    def prepare(self, fit_start: FitStart) -> None:
        """Build or reuse the cache (`build_or_reuse`), keep what training reads, release the models."""


def prepare_caches(fit_start: FitStart, providers: Iterable[object | None]) -> None:
    """Prepare every provider that is a `FitStartCache` and not ready yet, in order (others are skipped)."""
    for provider in providers:
        if isinstance(provider, FitStartCache) and not provider.ready:
            provider.prepare(fit_start)

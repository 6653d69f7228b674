"""Where a training stage reads the target from: `TargetSource`, chosen by `<stage>.target_cache`.

- `null` (the default): the live target runs on every batch (`LiveTarget`).
- an integer m (e.g. 64): the target's top-m answer distributions are cached once at fit start and training runs
  without the target (`TopMCache`, `specdistill.data.target_cache`); for a draft that reads none of the target's
  hidden states.
- `bfloat16`, `float16` or `float32`: the target's hidden states at the layers a draft kind reads (EAGLE-3) are
  cached once at fit start in that precision and the target's body never runs in training (`StatesCache`,
  `specdistill.data.target_states`); its output layer still scores the rows.

`source_from_setting(group, value)` reads the setting; `TargetSource.check_kind(kind)` is the one place where a source is
held against the draft kind (validation calls it before anything loads, `DistillModule` when the pieces meet);
`TargetSource.build(...)` gives what `DistillModule` trains from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from specdistill.errors import ConfigError
from specdistill.models.frozen import Frozen

STATE_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class TrainingTarget:
    """What a training stage hands `DistillModule`.

    Attributes:
        target: the target model, or its cached top-m distributions (`CacheOnceTarget`).
        states: the target's cached hidden states (`CacheOnceTargetStates`), or None.
        frozen: the `Frozen` holder of the target that the top-m cache's fit-start pass places, which other
            fit-start passes may share (a reference scored once); None otherwise.
    """

    target: Any
    states: Any = None
    frozen: Frozen | None = None


@dataclass(frozen=True)
class TargetSource:
    """Where a stage of `group` reads the target from; the base serves the live target, as `LiveTarget` does."""

    group: str = "distill"

    @property
    def cached(self) -> bool:
        """Whether the stage writes a target cache (whose folder a pipeline hands to the next step)."""
        return False

    def check_kind(self, kind: Any) -> None:
        """Refuse a draft kind this source cannot serve (`kind.reads_target`: whether it reads the target's hidden
        states); the live target serves every kind."""

    def build(
        self, target: nn.Module, path: Path, tokenizer: Any, datamodule: Any, vocab_size: int, kind: Any
    ) -> TrainingTarget:
        """What `DistillModule` trains from for `target` (the loaded frozen target); `path` is the stage's target
        cache folder, `tokenizer`, `datamodule` and `vocab_size` those of the stage."""
        return TrainingTarget(target)


@dataclass(frozen=True)
class LiveTarget(TargetSource):
    """The live target, run on every batch (`target_cache: null`)."""


@dataclass(frozen=True)
class TopMCache(TargetSource):
    """The target's top-`m` answer distributions, cached once."""

    m: int = 64

    @property
    def cached(self) -> bool:
        return True

    def check_kind(self, kind: Any) -> None:
        if kind.reads_target:
            raise ConfigError(
                f"{self.group}.target_cache={self.m} caches the target's top-{self.m} distributions, but the draft "
                f"kind {type(kind).__name__} reads the target's hidden states, which that cache does not hold: set "
                f"{self.group}.target_cache to bfloat16, float16 or float32 to cache those states, or null"
            )

    def build(
        self, target: nn.Module, path: Path, tokenizer: Any, datamodule: Any, vocab_size: int, kind: Any
    ) -> TrainingTarget:
        from specdistill.data.target_cache import CacheOnceTarget

        # cached at fit start where the Trainer places the target, every rank a share of each split (or reused); the
        # target is released after that pass: training reads the cache
        frozen = Frozen(target)
        cache = CacheOnceTarget(frozen, path, tokenizer, datamodule, vocab_size, m=self.m)
        return TrainingTarget(cache, frozen=frozen)


@dataclass(frozen=True)
class StatesCache(TargetSource):
    """The target's hidden states at the layers the draft kind reads, cached once in `dtype`."""

    dtype: str = "bfloat16"

    @property
    def cached(self) -> bool:
        return True

    def check_kind(self, kind: Any) -> None:
        if not kind.reads_target:
            raise ConfigError(
                f"{self.group}.target_cache={self.dtype} caches the target's hidden states a draft kind reads, but "
                f"the draft kind {type(kind).__name__} reads none: set {self.group}.target_cache=<m> (e.g. 64, the "
                "target's top-m distributions) instead"
            )

    def build(
        self, target: nn.Module, path: Path, tokenizer: Any, datamodule: Any, vocab_size: int, kind: Any
    ) -> TrainingTarget:
        from specdistill.data.target_states import CacheOnceTargetStates

        states = CacheOnceTargetStates(
            target, path, tokenizer, datamodule, vocab_size, kind.target_layers, dtype=self.dtype
        )
        return TrainingTarget(target, states=states)


def source_from_setting(group: str, value: Any) -> TargetSource:
    """The source `<group>.target_cache=<value>` names (see the module docstring).

    Raises:
        ConfigError: `value` is none of null, a positive integer or a state dtype.
    """
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value == 0):
        return LiveTarget(group)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return TopMCache(group, m=value)
    if isinstance(value, str) and value in STATE_DTYPES:
        return StatesCache(group, dtype=value)
    raise ConfigError(
        f"{group}.target_cache={value!r}: it is null (the live target on every batch), a positive integer m (the "
        f"target's top-m distributions cached once, e.g. {group}.target_cache=64) or one of "
        f"{', '.join(STATE_DTYPES)} (the target's hidden states cached once, for a draft kind that reads them)"
    )


def source_of(target: Any, states: Any) -> TargetSource:
    """The source that `DistillModule`'s arguments amount to (a `CachedTarget` as `target`: top-m; `states` given:
    the states cache; else live), for `check_kind`."""
    from specdistill.data.target_cache import CachedTarget

    if isinstance(target, CachedTarget):
        return TopMCache(m=target.m)
    if states is not None:
        return StatesCache(dtype=str(states.dtype).removeprefix("torch."))
    return LiveTarget()

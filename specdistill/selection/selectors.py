"""Token selectors: AdaSPEC (top fraction by gap), random, draft loss, none (maths: docs/METHODS.md section 3).

Selectors are pure functions of per-token scores, usable without Lightning or models:

    selection = selector.select(draft_divergence, reference_divergence, sequence_index, normaliser)

with, for the N answer tokens of a micro-batch (see `specdistill.selection.base`):
    draft_divergence: `(N,)` the training divergence D(p, q) per answer token, detached.
    reference_divergence: `(N,)` D(p, r) of the reference per answer token, or None; only selectors with
        `needs_reference = True` (AdaSPEC) read it.
    sequence_index: `(N,)` long, the batch row of each answer token (read by `scope="sequence"`).
    normaliser: `()` the default loss normaliser, the answer tokens of the whole accumulation window
        (`specdistill.losses.reduction.window_normaliser`).
and a `Selection(keep (N,) bool, normaliser (), scores (N,) | None)` back. Every selector takes the kept fraction `k`
(the single config key `adaspec.k`); `NoSelector` accepts only k = 1.

Options shared by the top-fraction selectors:
    k: fraction of answer tokens kept, in (0, 1]; default 0.4 (AdaSPEC's default; the authors also use 0.8).
        Exactly round(k * n) tokens are kept per scope group, ties broken by position (lower index first).
    scope: where the top fraction is taken.
        - `microbatch` (default, the authors'): over all answer tokens of the micro-batch on this device.
        - `sequence`: within each sequence, so every example contributes its own top fraction.
        - `global`: over the micro-batches of all devices (scores are all-gathered), so the selection does not
          depend on the number of GPUs. Still per micro-batch in time: accumulation steps are not pooled.
    normalise: what the sum of the kept per-token losses is divided by.
        - `answer_tokens` (default, the authors'): all answer tokens of the accumulation window, so the loss is
          ~k times the plain distillation loss. Chosen as the default because it matches the published code,
          keeps gradient accumulation exact (the window count is known before any selection happens) and makes
          k = 1 identical to plain distillation.
        - `selected_tokens`: the tokens kept in the window, k * (window answer tokens), i.e. a mean over selected
          tokens. Because the counts are exact this is the `answer_tokens` loss times 1/k: the same direction, a
          larger step for SGD; under Adam it only changes the epsilon and gradient-clipping regimes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from specdistill.errors import ConfigError
from specdistill.selection.base import Selection
from specdistill.selection.topk import (
    check_fraction,
    top_fraction,
    top_fraction_across_devices,
    top_fraction_per_group,
)

Scope = Literal["microbatch", "sequence", "global"]
Normalise = Literal["answer_tokens", "selected_tokens"]

# scope -> (scores (N,), sequence_index (N,), k) -> keep (N,) bool
_SCOPES: dict[str, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "microbatch": lambda scores, rows, k: top_fraction(scores, k),
    "sequence": lambda scores, rows, k: top_fraction_per_group(scores, rows, k),
    "global": lambda scores, rows, k: top_fraction_across_devices(scores, k),
}
_NORMALISERS = ("answer_tokens", "selected_tokens")


@dataclass
class NoSelector:
    """Keep every answer token: plain distillation (with the selection statistics still reported).

    Attributes:
        k: must be 1: the stage passes `adaspec.k` to whichever selector is configured, and this one cannot honour
            any other fraction.
    """

    k: float = 1.0
    needs_reference = False

    def __post_init__(self) -> None:
        try:
            keeps_all = float(self.k) == 1.0
        except (TypeError, ValueError):
            keeps_all = False
        if not keeps_all:
            raise ConfigError(
                f"selector=none keeps every answer token; set adaspec.k=1 or choose another selector (got "
                f"adaspec.k={self.k})"
            )
        self.k = 1.0

    def select(
        self,
        draft_divergence: torch.Tensor,
        reference_divergence: torch.Tensor | None,
        sequence_index: torch.Tensor,
        normaliser: torch.Tensor,
    ) -> Selection:
        """Keep all N tokens; the normaliser is returned unchanged. See the module doc for the arguments."""
        keep = torch.ones(draft_divergence.shape[0], dtype=torch.bool, device=draft_divergence.device)
        return Selection(keep=keep, normaliser=normaliser, scores=None)


@dataclass
class TopFractionSelector:
    """Base of the selectors that keep the top fraction k of answer tokens by some score (see module doc)."""

    k: float = 0.4
    scope: Scope = "microbatch"
    normalise: Normalise = "answer_tokens"
    needs_reference = False

    def __post_init__(self) -> None:
        self.k = check_fraction(self.k)
        if self.scope not in _SCOPES:
            raise ConfigError(
                f"selector.scope={self.scope!r} must be one of {list(_SCOPES)}: set e.g. selector.scope=microbatch "
                "(the authors')"
            )
        if self.normalise not in _NORMALISERS:
            raise ConfigError(
                f"selector.normalise={self.normalise!r} must be one of {list(_NORMALISERS)}: set e.g. "
                "selector.normalise=answer_tokens (the authors')"
            )

    def scores(
        self, draft_divergence: torch.Tensor, reference_divergence: torch.Tensor | None
    ) -> torch.Tensor:
        """`(N,)` score per answer token from `(N,)` divergences; the highest are kept."""
        raise NotImplementedError

    def select(
        self,
        draft_divergence: torch.Tensor,
        reference_divergence: torch.Tensor | None,
        sequence_index: torch.Tensor,
        normaliser: torch.Tensor,
    ) -> Selection:
        """Keep the top fraction k of `scores` within the scope. See the module doc for the arguments."""
        scores = self.scores(draft_divergence, reference_divergence)
        keep = _SCOPES[self.scope](scores, sequence_index, self.k)
        normaliser = normaliser if self.normalise == "answer_tokens" else normaliser * self.k
        return Selection(keep=keep, normaliser=normaliser, scores=scores)


@dataclass
class AdaSpecSelector(TopFractionSelector):
    """AdaSPEC: keep the tokens with the largest gap D(p, q) - D(p, r) (draft minus reference divergence).

    Needs `reference_divergence`, which `DistillModule` takes from its reference provider
    (`specdistill.selection.reference`: an online frozen reference or cached scores).
    """

    needs_reference = True

    def scores(
        self, draft_divergence: torch.Tensor, reference_divergence: torch.Tensor | None
    ) -> torch.Tensor:
        if reference_divergence is None:
            raise ValueError(
                "AdaSpecSelector needs the reference divergence D(p, r): give DistillModule a reference provider "
                "(specdistill.selection.reference.OnlineReference, or CachedReferenceScores with batches carrying "
                "the 'ref_divergence' column)"
            )
        return draft_divergence.float() - reference_divergence.float()


@dataclass
class SelfReferenceSelector(AdaSpecSelector):
    """AdaSPEC's gap with the draft as its own reference: D(p, r) from an earlier state of the draft
    (`specdistill.selection.self_reference.SelfReference`, built by the adaspec stage), so no reference stage runs.

    Attributes:
        self_reference: `lagged` (a snapshot refreshed every `every` steps, N to 2N steps old) or `ema`.
        every: `lagged`: optimizer steps between refreshes, >= 1.
        decay: `ema`: the weight on the EMA's past, in (0, 1).
        warmup_steps: `ema`: optimizer steps of plain distillation before the EMA scores, >= 1.
    """

    self_reference: str = "lagged"
    every: int = 50
    decay: float = 0.99
    warmup_steps: int = 10

    def __post_init__(self) -> None:
        from specdistill.selection.self_reference import check_self_reference

        super().__post_init__()
        check_self_reference(self.self_reference, self.every, self.decay, self.warmup_steps)


@dataclass
class DraftLossSelector(TopFractionSelector):
    """Keep the tokens where the draft's own divergence is largest (no reference: the ablation of the gap)."""

    def scores(
        self, draft_divergence: torch.Tensor, reference_divergence: torch.Tensor | None
    ) -> torch.Tensor:
        return draft_divergence.float()


@dataclass
class RandomSelector(TopFractionSelector):
    """Keep a uniformly random fraction k of the answer tokens (the control for AdaSPEC).

    Attributes:
        seed: seed of the selector's own generator (offset by the rank under torch.distributed), so runs repeat
            and do not disturb the global RNG. Each call draws fresh scores.
    """

    seed: int = 0
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        # torch seeds a generator with a 64-bit value; the rank is added to it, so stay well inside
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ConfigError(
                f"selector.seed={self.seed!r} must be an integer in [0, 2**63): set e.g. selector.seed=0, or drop "
                "the override to derive it from the root seed"
            )

    def scores(
        self, draft_divergence: torch.Tensor, reference_divergence: torch.Tensor | None
    ) -> torch.Tensor:
        if self._generator is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            self._generator = torch.Generator().manual_seed(self.seed + rank)
        return torch.rand(draft_divergence.shape[0], generator=self._generator).to(draft_divergence.device)

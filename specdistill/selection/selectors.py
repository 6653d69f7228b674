"""Token selectors: AdaSPEC (top fraction by gap), random, draft loss, none.

Every selector implements `select(SelectionInput) -> Selection` (see `specdistill.selection.base`).

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

from specdistill.selection.base import Selection, SelectionInput
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
    """Keep every answer token: plain distillation."""

    needs_reference = False

    def select(self, inp: SelectionInput) -> Selection:
        keep = torch.ones(inp.num_tokens, dtype=torch.bool, device=inp.draft_divergence.device)
        return Selection(keep=keep, normaliser=inp.normaliser, scores=None)


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
            raise ValueError(f"scope must be one of {sorted(_SCOPES)}, got {self.scope!r}")
        if self.normalise not in _NORMALISERS:
            raise ValueError(f"normalise must be one of {list(_NORMALISERS)}, got {self.normalise!r}")

    def scores(self, inp: SelectionInput) -> torch.Tensor:
        """`(N,)` score per answer token; the highest are kept."""
        raise NotImplementedError

    def select(self, inp: SelectionInput) -> Selection:
        scores = self.scores(inp)
        keep = _SCOPES[self.scope](scores, inp.sequence_index, self.k)
        normaliser = inp.normaliser if self.normalise == "answer_tokens" else inp.normaliser * self.k
        return Selection(keep=keep, normaliser=normaliser, scores=scores)


@dataclass
class AdaSpecSelector(TopFractionSelector):
    """AdaSPEC: keep the tokens with the largest gap D(p, q) - D(p, r) (draft minus reference divergence).

    Needs `inp.ref_divergence`, filled in by the `TokenSelection` callback from a reference model or from cached
    scores.
    """

    needs_reference = True

    def scores(self, inp: SelectionInput) -> torch.Tensor:
        if inp.ref_divergence is None:
            raise ValueError(
                "AdaSpecSelector needs the reference divergence: use it through the TokenSelection callback with "
                "a reference model, or with batches carrying the cached 'ref_divergence' column (score stage)"
            )
        return inp.draft_divergence.float() - inp.ref_divergence.float()


@dataclass
class DraftLossSelector(TopFractionSelector):
    """Keep the tokens where the draft's own divergence is largest (no reference: the ablation of the gap)."""

    def scores(self, inp: SelectionInput) -> torch.Tensor:
        return inp.draft_divergence.float()


@dataclass
class RandomSelector(TopFractionSelector):
    """Keep a uniformly random fraction k of the answer tokens (the control for AdaSPEC).

    Attributes:
        seed: seed of the selector's own generator (offset by the rank under torch.distributed), so runs repeat
            and do not disturb the global RNG.
    """

    seed: int = 0
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)

    def scores(self, inp: SelectionInput) -> torch.Tensor:
        if self._generator is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            self._generator = torch.Generator().manual_seed(self.seed + rank)
        return torch.rand(inp.num_tokens, generator=self._generator).to(inp.draft_divergence.device)

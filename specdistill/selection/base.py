"""Token selection's data: the `Selector` contract, its `Selection`, and the `SelectionRecord` kept for reports.

N below is the number of answer tokens in a micro-batch (`answer_mask.sum()`, `answer_mask` `(B, T-1)`), in the
row-major order of `answer_mask` (sequence by sequence, position by position). The maths is in docs/METHODS.md
section 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Selection:
    """A selector's answer for one micro-batch.

    Attributes:
        keep: `(N,)` bool, True for the answer tokens that contribute to the loss.
        normaliser: `()` what the sum of the kept per-token losses is divided by.
        scores: `(N,)` float, the score the selector ranked by (the gap for AdaSPEC); None if it ranks nothing.
    """

    keep: torch.Tensor
    normaliser: torch.Tensor
    scores: torch.Tensor | None = None


@dataclass
class SelectionRecord:
    """One training micro-batch's selection, kept by `DistillModule` as `last_selection` for the report callback.

    All tensors are detached and live on the training device.

    Attributes:
        keep: `(N,)` bool, the tokens that entered the loss (all True without a selector).
        scores: `(N,)` the selector's ranking score, or None (no selector, or one that ranks nothing).
        draft_divergence: `(N,)` the training divergence D(p, q) per answer token.
        reference_divergence: `(N,)` D(p, r) per answer token when the selector used a reference, else None.
        token_ids: `(N,)` long, the label (next token) at each answer position.
        sequence_index: `(N,)` long, the micro-batch row (sequence) of each answer position, or None.
        answer_index: `(N,)` long, the answer token each row belongs to when a draft kind trains on several rows
            per answer token (`TrainingRows.answer_index`, e.g. EAGLE-3's unrolled steps), else None.
    """

    keep: torch.Tensor
    scores: torch.Tensor | None
    draft_divergence: torch.Tensor
    reference_divergence: torch.Tensor | None
    token_ids: torch.Tensor
    sequence_index: torch.Tensor | None = None
    answer_index: torch.Tensor | None = None

    @property
    def gap(self) -> torch.Tensor | None:
        """`(N,)` D(p, q) - D(p, r), or None without reference divergences."""
        if self.reference_divergence is None:
            return None
        return self.draft_divergence - self.reference_divergence


class Selector(Protocol):
    """What `DistillModule(selector=...)` accepts (`specdistill.selection.selectors` implements it).

    Attributes:
        needs_reference: True if `select` reads `reference_divergence` (the module then requires a reference
            provider and passes its `(N,)` scores; otherwise it passes None and never runs the reference).
    """

    needs_reference: bool

    def select(
        self,
        draft_divergence: torch.Tensor,
        reference_divergence: torch.Tensor | None,
        sequence_index: torch.Tensor,
        normaliser: torch.Tensor,
    ) -> Selection:
        """`(N,), (N,) | None, (N,) long, () -> Selection` (see `specdistill.selection.selectors`)."""
        ...

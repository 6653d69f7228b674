"""The contract between the distillation module and token selection.

`DistillModule.training_step` computes the per-token training divergence on the answer tokens of a micro-batch,
then, if `module.token_selector` is set, calls `token_selector.select(SelectionInput(...))` and trains on the kept
tokens only. Anything with that `select` method works: a bare selector from `specdistill.selection.selectors`
(none, random, draft_loss) or the `TokenSelection` callback, which adds the reference model's divergence
(`ref_divergence`) that AdaSPEC needs, then logs and counts the selection.

N below is the number of answer tokens in the micro-batch (`answer_mask.sum()`), in the row-major order of
`answer_mask` (sequence by sequence, position by position).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from specdistill.losses.divergence import Divergence


@dataclass
class SelectionInput:
    """What the module hands to a selector for one micro-batch.

    Attributes:
        target_logits: `(N, V)` target logits at the answer positions (no grad, real vocabulary only).
        draft_logits: `(N, V)` draft logits at the answer positions, detached.
        draft_divergence: `(N,)` the module's training divergence D(p, q) per answer token, detached.
        divergence: the module's divergence object (the reference must be scored with the same one).
        sequence_index: `(N,)` long, row of the batch each answer token belongs to.
        token_ids: `(N,)` long, the label (next token) at each answer position.
        answer_mask: `(B, T-1)` bool, True on answer positions (shifted, see ARCHITECTURE.md).
        batch: the raw micro-batch (for `input_ids`, `attention_mask` and cached columns such as `ref_divergence`).
        normaliser: `()` default loss normaliser: answer tokens of the whole gradient-accumulation window.
        ref_divergence: `(N,)` D(p, r) of the reference model per answer token, filled in by `TokenSelection`
            (online or from cached scores); None when no reference is involved.
    """

    target_logits: torch.Tensor
    draft_logits: torch.Tensor
    draft_divergence: torch.Tensor
    divergence: Divergence
    sequence_index: torch.Tensor
    token_ids: torch.Tensor
    answer_mask: torch.Tensor
    batch: Mapping[str, Any]
    normaliser: torch.Tensor
    ref_divergence: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.draft_divergence.shape[0])


@dataclass
class Selection:
    """A selector's answer for one micro-batch.

    Attributes:
        keep: `(N,)` bool, True for the answer tokens that contribute to the loss.
        normaliser: `()` what the sum of the kept per-token losses is divided by.
        scores: `(N,)` the score the selector ranked by (gap for AdaSPEC), for logging; None if it ranks nothing.
    """

    keep: torch.Tensor
    normaliser: torch.Tensor
    scores: torch.Tensor | None = None


class SupportsSelect(Protocol):
    """What `DistillModule.token_selector` must provide."""

    def select(self, inp: SelectionInput) -> Selection: ...

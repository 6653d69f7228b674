"""Input checks shared by the diagnostics: every logit tensor is `(N, V)` with N >= 1 positions."""

from __future__ import annotations

import torch


def check_logits(logits: torch.Tensor, name: str = "logits", min_vocab: int = 1) -> None:
    """Raise ValueError unless `logits` is `(N, V)` with N >= 1 and V >= `min_vocab`.

    Args:
        logits: the tensor to check.
        name: how the message names it (`draft_logits`, `target_logits`).
        min_vocab: the fewest vocabulary entries the caller needs (2 for a top-2 margin).
    """
    if logits.dim() != 2:
        raise ValueError(
            f"{name} must be (N, V), got shape {tuple(logits.shape)}; flatten (B, T, V) logits with "
            "logits.reshape(-1, logits.shape[-1]) and keep only the answer positions"
        )
    if logits.shape[0] == 0:
        raise ValueError(f"{name} has no positions (shape {tuple(logits.shape)}); pass at least one row")
    if logits.shape[1] < min_vocab:
        raise ValueError(
            f"{name} needs at least {min_vocab} vocabulary entries per row, got shape {tuple(logits.shape)}"
        )


def check_logit_pair(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> None:
    """Raise ValueError unless draft and target logits are both `(N, V)`, N >= 1, with the same N and the same V."""
    check_logits(draft_logits, "draft_logits")
    check_logits(target_logits, "target_logits")
    if draft_logits.shape[0] != target_logits.shape[0]:
        raise ValueError(
            f"draft and target logits cover different positions: draft {draft_logits.shape[0]} rows, target "
            f"{target_logits.shape[0]} rows; pass the same answer positions of both models in the same order"
        )
    if draft_logits.shape[1] != target_logits.shape[1]:
        raise ValueError(
            f"draft and target vocabularies differ: draft V = {draft_logits.shape[1]}, target V = "
            f"{target_logits.shape[1]}; slice both to the tokenizer's real vocabulary with [..., :vocab_size]"
        )

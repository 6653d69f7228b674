"""Answer-position helpers shared by training, selection and scoring (shifted positions, see ARCHITECTURE.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def answer_mask(labels: torch.Tensor) -> torch.Tensor:
    """`(B, T)` unshifted labels -> `(B, T-1)` bool, True where position t predicts an answer token t + 1."""
    return labels[:, 1:] != -100


def answer_logits(
    model: nn.Module, batch: Mapping[str, Any], keep: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Run `model` on the batch and return its logits at the kept shifted positions, real vocabulary only.

    Args:
        model: HF-style causal LM, `model(input_ids=, attention_mask=).logits` of shape `(B, T, V')`, V' >= vocab_size.
        batch: holds `input_ids` and `attention_mask`, both `(B, T)`.
        keep: `(B, T-1)` bool, usually `answer_mask(batch["labels"])`.
        vocab_size: the tokenizer's real vocabulary; padded embedding rows beyond it are dropped.

    Returns:
        `(N, vocab_size)` with N = `keep.sum()`, rows in row-major order of `keep`.
    """
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    if logits.shape[-1] < vocab_size:
        raise ValueError(
            f"{type(model).__name__} gives {logits.shape[-1]} logits but the tokenizer has {vocab_size} tokens: "
            "draft, reference and target must share the tokenizer (set vocab_size to len(tokenizer))"
        )
    return logits[:, :-1, :vocab_size][keep]


def answer_token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over answer positions (the SFT loss before normalisation).

    Args:
        logits: `(B, T, V)` model outputs (cast to fp32).
        labels: `(B, T)` unshifted labels with -100 on prompt and padding.

    Returns:
        `()` fp32 sum over answer tokens (0 with zero gradients when no answer token is present); divide it by
        `specdistill.losses.reduction.window_normaliser` for the training loss.
    """
    shifted_logits = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    shifted_labels = labels[:, 1:].reshape(-1)
    return F.cross_entropy(shifted_logits, shifted_labels, ignore_index=-100, reduction="sum")

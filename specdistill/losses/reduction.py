"""Token reductions shared by SFT and distillation: per-token losses `(N,)` -> one scalar, and its normaliser.

Every training loss is `sum over kept answer tokens / window_normaliser(batch, world_size)`, multiplied by the
Trainer's `accumulate_grad_batches` (Lightning divides each micro-batch loss by it, while the sum is already
normalised by the whole accumulation window). See docs/METHODS.md sections 1-3.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def window_normaliser(batch: Mapping[str, Any], world_size: int = 1) -> torch.Tensor:
    """What a micro-batch's per-token loss sum is divided by: `()` float32, on the batch column's device.

    Args:
        batch: holds `window_answer_tokens` `()` (answer tokens of this device's whole gradient-accumulation window)
            and, from specdistill's collate, `global_window_answer_tokens` `()` (the same over all devices).
        world_size: number of data-parallel devices (`trainer.world_size`).

    Returns:
        `global_window_answer_tokens / world_size` when `world_size > 1` and the column exists: DDP averages the
        devices' gradients, so the update is then the sum over every device's answer tokens divided by their
        total, however unevenly the tokens fall on devices. Otherwise `window_answer_tokens`.
    """
    if "window_answer_tokens" not in batch:
        raise ValueError(
            "batch has no 'window_answer_tokens' (answer tokens of the whole accumulation window); "
            "use specdistill's TaskDataModule or add the column to your collate function"
        )
    if world_size > 1 and "global_window_answer_tokens" in batch:
        return torch.as_tensor(batch["global_window_answer_tokens"]).float() / world_size
    return torch.as_tensor(batch["window_answer_tokens"]).float()


def normalise_sum(total: torch.Tensor, normaliser: torch.Tensor | float | int) -> torch.Tensor:
    """`total / normaliser` for a `()` loss sum, with a normaliser of 0 (nothing to sum) replaced by 1.

    Returns `()` in `total`'s dtype; a batch with nothing to sum gives 0 with zero gradients, never 0 / 0 = NaN.
    """
    normaliser = torch.as_tensor(normaliser, dtype=total.dtype, device=total.device)
    if normaliser.dim() != 0:
        raise ValueError(f"normaliser must be a scalar, got shape {tuple(normaliser.shape)}")
    return total / torch.where(normaliser > 0, normaliser, torch.ones_like(normaliser))


def reduce_tokens(
    per_token: torch.Tensor,
    keep: torch.Tensor | None = None,
    normaliser: torch.Tensor | float | int | None = None,
) -> torch.Tensor:
    """Sum the kept per-token values and divide by `normaliser`.

    Args:
        per_token: `(N,)` per-token losses.
        keep: `(N,)` bool mask of the tokens that contribute; None keeps all. Dropped tokens get exactly zero
            gradient (they are not part of the sum), even where their value is inf or NaN.
        normaliser: what the sum is divided by, e.g. `window_normaliser(batch, world_size)` so that accumulation
            does not change the update; None divides by the number of kept tokens.

    Returns:
        `()` loss. A batch with nothing kept gives 0 with zero gradients (never 0 / 0 = NaN): a normaliser of 0
        (possible only when there is nothing to sum) is replaced by 1.
    """
    if per_token.dim() != 1:
        raise ValueError(f"per_token must be (N,), got shape {tuple(per_token.shape)}; flatten it first")
    if keep is not None:
        if keep.dtype != torch.bool or keep.shape != per_token.shape:
            raise ValueError(
                f"keep must be a bool mask shaped like per_token {tuple(per_token.shape)}, "
                f"got {keep.dtype} {tuple(keep.shape)}"
            )
        per_token = per_token[keep]
    total = per_token.sum()
    if normaliser is None:
        normaliser = per_token.new_tensor(float(per_token.numel()))
    return normalise_sum(total, normaliser)

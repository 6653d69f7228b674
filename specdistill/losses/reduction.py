"""Token reductions: turn per-token losses `(N,)` into one scalar."""

from __future__ import annotations

import torch


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
        normaliser: what the sum is divided by, e.g. the answer tokens of the whole gradient-accumulation window
            so that accumulation does not change the update; None divides by the number of kept tokens.

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
    normaliser = torch.as_tensor(normaliser, dtype=total.dtype, device=total.device)
    if normaliser.dim() != 0:
        raise ValueError(f"normaliser must be a scalar, got shape {tuple(normaliser.shape)}")
    return total / torch.where(normaliser > 0, normaliser, torch.ones_like(normaliser))

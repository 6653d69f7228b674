"""Exact top-fraction token selection: pure functions on score vectors.

All functions keep exactly `keep_count(n, k)` = round(k * n) tokens per group (round half up), whatever the ties:
among equal scores the token with the lower index wins, so the result is deterministic and never keeps more or
fewer tokens than asked (unlike `gap >= quantile(gap, 1 - k)`, which keeps every tied token).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from specdistill.errors import ConfigError


def check_fraction(k: float) -> float:
    """Return `k` as a float if it lies in (0, 1]; raise ConfigError (a ValueError) naming `adaspec.k` otherwise
    (the stage passes that one key to every selector)."""
    given = k
    try:
        k = float(k)
    except (TypeError, ValueError):
        k = math.nan
    if not 0.0 < k <= 1.0 or math.isnan(k):
        raise ConfigError(
            f"adaspec.k={given}: the kept fraction k must lie in (0, 1] (AdaSPEC uses 0.4 or 0.8; 1 keeps every "
            "token): set e.g. adaspec.k=0.4"
        )
    return k


def keep_count(n: int, k: float) -> int:
    """Tokens kept out of `n`: round(k * n) with halves rounded up (a tiny epsilon absorbs float error in k * n)."""
    return min(n, int(math.floor(k * n + 0.5 + 1e-9)))


def _check_scores(scores: torch.Tensor) -> None:
    if scores.dim() != 1:
        raise ValueError(f"scores must be (N,), got shape {tuple(scores.shape)}")
    if torch.isnan(scores).any():
        raise ValueError(
            "selection scores contain NaN: a divergence is broken (check the reference logits, the vocabulary "
            "slice and, for cached scores, the ref_divergence column)"
        )


def top_fraction(scores: torch.Tensor, k: float) -> torch.Tensor:
    """Keep the `keep_count(N, k)` highest scores. `(N,) -> (N,) bool`; ties go to the lower index."""
    _check_scores(scores)
    k = check_fraction(k)
    # stable descending sort: among equal scores the original (lower) index comes first
    order = torch.sort(scores, descending=True, stable=True).indices
    keep = torch.zeros_like(scores, dtype=torch.bool)
    keep[order[: keep_count(scores.numel(), k)]] = True
    return keep


def top_fraction_per_group(scores: torch.Tensor, groups: torch.Tensor, k: float) -> torch.Tensor:
    """Keep the top `keep_count(n_g, k)` scores within every group g (e.g. per sequence).

    Args:
        scores: `(N,)` float.
        groups: `(N,)` long, non-negative group id of each token.

    Returns:
        `(N,)` bool; ties within a group go to the lower index.
    """
    _check_scores(scores)
    k = check_fraction(k)
    if groups.shape != scores.shape:
        raise ValueError(f"groups {tuple(groups.shape)} must be shaped like scores {tuple(scores.shape)}")
    if scores.numel() == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    # Order by group, then score descending, then index: two stable sorts, the primary key last.
    by_score = torch.sort(scores, descending=True, stable=True).indices
    order = by_score[torch.sort(groups[by_score], stable=True).indices]
    sizes = torch.bincount(groups)
    starts = torch.cumsum(sizes, 0) - sizes
    ranks_in_order = torch.arange(scores.numel(), device=scores.device) - starts[groups[order]]
    quotas = torch.floor(sizes.double() * k + 0.5 + 1e-9).long().clamp(max=sizes)
    keep = torch.zeros_like(scores, dtype=torch.bool)
    keep[order] = ranks_in_order < quotas[groups[order]]
    return keep


def top_fraction_global(per_device_scores: list[torch.Tensor], k: float) -> list[torch.Tensor]:
    """Select over the concatenation of every device's scores and hand each device its part.

    This is what the `global` scope computes after gathering; it equals `top_fraction` on the whole batch put on
    one device in rank order, so the selection does not depend on how many devices share the batch.

    Args:
        per_device_scores: one `(N_r,)` tensor per rank, in rank order.

    Returns:
        one `(N_r,)` bool mask per rank.
    """
    sizes = [int(s.numel()) for s in per_device_scores]
    keep = top_fraction(torch.cat(per_device_scores), k)
    return list(torch.split(keep, sizes))


def gather_across_devices(scores: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    """All-gather variable-length `(N_r,)` scores from every rank; returns `(per-rank list, this rank)`.

    Without an initialised process group (single device) this is `([scores], 0)`.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [scores], 0
    world, rank = dist.get_world_size(), dist.get_rank()
    count = torch.tensor([scores.numel()], device=scores.device, dtype=torch.long)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    sizes = [int(c.item()) for c in counts]
    padded = scores.new_zeros(max(sizes))
    padded[: scores.numel()] = scores
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [g[:n] for g, n in zip(gathered, sizes, strict=True)], rank


def top_fraction_across_devices(scores: torch.Tensor, k: float) -> torch.Tensor:
    """`global` scope: top fraction over all devices' tokens; returns this rank's `(N,)` bool mask."""
    per_device, rank = gather_across_devices(scores)
    return top_fraction_global(per_device, k)[rank]

"""Plain-number summaries of per-position values (margins, KL) for result.json."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def _quantile(sorted_values: torch.Tensor, q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of an ascending 1-D tensor; no size limit."""
    position = q * (sorted_values.numel() - 1)
    low, high = math.floor(position), math.ceil(position)
    low_value, high_value = float(sorted_values[low]), float(sorted_values[high])
    return low_value + (high_value - low_value) * (position - low)


def summarise(values: torch.Tensor | Sequence[float]) -> dict[str, float | int]:
    """Count, mean, median, 10th and 90th percentiles and the fraction of values above 0.

    Args:
        values: `(N,)` tensor or sequence of numbers, N >= 1, no NaN.

    Returns:
        `count` (int), `mean`, `median`, `p10`, `p90`, `fraction_positive` (share of values > 0) as Python floats.
        Quantiles interpolate linearly between order statistics, as numpy's default.
    """
    tensor = torch.as_tensor(values, dtype=torch.float64).detach().cpu()
    if tensor.dim() != 1:
        raise ValueError(f"summarise takes (N,) values, got shape {tuple(tensor.shape)}; flatten them first")
    if tensor.numel() == 0:
        raise ValueError(
            "summarise got no values; pass at least one (an empty selection has nothing to summarise)"
        )
    if torch.isnan(tensor).any():
        raise ValueError(
            "summarise got NaN values; drop or fix them first (a NaN margin or KL means broken logits)"
        )
    ordered = tensor.sort().values
    return {
        "count": int(tensor.numel()),
        "mean": float(tensor.mean().item()),
        "median": _quantile(ordered, 0.5),
        "p10": _quantile(ordered, 0.1),
        "p90": _quantile(ordered, 0.9),
        "fraction_positive": float((tensor > 0).double().mean().item()),
    }

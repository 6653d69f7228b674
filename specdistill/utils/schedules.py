"""Learning-rate schedules, built with `_partial_: true` and called as `factory(optimizer, total_steps=...)`."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def constant(optimizer: torch.optim.Optimizer, total_steps: int, warmup_fraction: float = 0.0) -> LambdaLR:
    """Constant learning rate after an optional linear warmup (AdaSPEC uses a constant rate)."""
    warmup = _warmup_steps(total_steps, warmup_fraction)
    return LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)


def cosine(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_fraction: float = 0.03, min_ratio: float = 0.0
) -> LambdaLR:
    """Linear warmup then cosine decay to `min_ratio` of the peak (SpecDec++: 3% warmup, cosine)."""
    warmup = _warmup_steps(total_steps, warmup_fraction)
    total = max(1, int(total_steps))

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def _warmup_steps(total_steps: int, warmup_fraction: float) -> int:
    if not 0.0 <= warmup_fraction < 1.0:
        raise ValueError(f"warmup_fraction={warmup_fraction} must be in [0, 1).")
    return int(round(warmup_fraction * max(0, int(total_steps))))

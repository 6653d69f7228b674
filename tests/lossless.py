"""The statistical test of losslessness shared by the engine tests: the first two tokens the speculative decoder
emits follow the target's exact (warped) distribution, which is enumerable for a small vocabulary."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from specdistill.decoding.engine import SpeculativeDecoder
from specdistill.decoding.sampling import SamplingConfig


def exact_two_token_distribution(
    target: torch.nn.Module, prompt: Sequence[int], sampling: SamplingConfig, vocab_size: int
) -> torch.Tensor:
    """`(V, V)` exact probability of the first two generated tokens, by enumerating the first one."""
    with torch.inference_mode():
        ids = torch.tensor([[*prompt, x] for x in range(vocab_size)])
        logits = target(ids).logits[..., :vocab_size]
    first = sampling.warp_probs(logits[0, -2])
    second = sampling.warp_probs(logits[:, -1])
    return first[:, None] * second


def chi_square_fails(counts: torch.Tensor, exact: torch.Tensor, z: float = 3.7) -> bool:
    """Pearson chi-square goodness of fit at level ~1e-4 (Wilson-Hilferty critical value); small cells pooled.

    A sample in a cell of probability 0 fails outright.
    """
    counts, exact = counts.flatten().double(), exact.flatten().double()
    if counts[exact == 0].sum() > 0:
        return True
    expected = exact * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    expected = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if expected[-1] < 5:
        observed, expected = observed[:-1], expected[:-1]
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = len(observed) - 1
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > critical


def two_token_counts(
    decoder: SpeculativeDecoder, prompt: Sequence[int], vocab_size: int, samples: int
) -> torch.Tensor:
    """`(V, V)` counts of the first two tokens over `samples` seeded generations."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(vocab_size, vocab_size)
    for _ in range(samples):
        first, second = decoder.generate(prompt, 2, gen).tokens
        counts[first, second] += 1
    return counts


def matches_two_token_distribution(counts: torch.Tensor, exact: torch.Tensor) -> bool:
    """The joint and both marginals of `counts` fit `exact`."""
    pairs = ((counts, exact), (counts.sum(1), exact.sum(1)), (counts.sum(0), exact.sum(0)))
    return not any(chi_square_fails(c, e) for c, e in pairs)

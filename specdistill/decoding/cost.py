"""The target's verification cost: one forward over `n` new tokens after a cached context, relative to `n = 1`.

Speculation pays when verifying `K + 1` tokens in one pass costs much less than `K + 1` one-token steps. How much less
depends on the model, the device, the dtype and the thread count, and the curve need not be smooth (a matrix kernel
chosen by shape): benchmarks/bench_verification_cost.py prints it for float32 and bfloat16 side by side (README). `measure_verification_cost` measures the curve (`evaluate` does it once per run,
for its target as it decodes, and reports it); `tokens_per_cost` combines it with tokens per target call at each K (the
decoded figure or the offline estimate, `specdistill.evaluation.offline`) into the expected tokens per unit of
target cost, where one autoregressive step costs 1. A drafter that costs nothing (prompt lookup) runs at that ratio
times the autoregressive speed; a draft model's own steps come on top.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence

import torch

from specdistill.models.cache import crop_cache, forward_with_cache, new_cache


@torch.no_grad()
def measure_verification_cost(
    target: torch.nn.Module,
    lengths: Sequence[int],
    context_length: int = 128,
    repeats: int = 5,
    vocab_size: int | None = None,
    seed: int = 0,
) -> dict[int, float]:
    """Seconds of one target forward over `n` new tokens after a cached context of `context_length`, for each `n` in
    `lengths`: the median of `repeats` timings, the `n`s interleaved within each repeat so that machine drift hits them
    alike (one untimed pass of each first). The cache is cropped back after every pass.

    Args:
        target: the target causal LM, in the dtype and on the device it verifies in.
        lengths: the token counts to time (each >= 1).
        context_length: tokens already in the cache (>= 1).
        repeats: timed passes per length (>= 1).
        vocab_size: random token ids are drawn below it (default: the model's output rows).
        seed: the random context's seed.
    """
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"lengths must be ints >= 1, got {list(lengths)!r}")
    if context_length < 1 or repeats < 1:
        raise ValueError(f"context_length ({context_length}) and repeats ({repeats}) must be >= 1")
    device = next(target.parameters()).device
    vocab = vocab_size or target.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, context_length + max(lengths)), generator=generator).to(device)
    cache = new_cache(target)
    _, cache = forward_with_cache(target, ids[:, :context_length], cache)
    times: dict[int, list[float]] = {n: [] for n in lengths}
    for timed in [False] + [True] * repeats:
        for n in lengths:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            forward_with_cache(target, ids[:, context_length : context_length + n], cache)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if timed:
                times[n].append(time.perf_counter() - start)
            crop_cache(cache, context_length)
    return {n: statistics.median(t) for n, t in times.items()}


def relative_cost(seconds: Mapping[int, float]) -> dict[int, float]:
    """Each length's seconds over one token's (`seconds` must hold `1`)."""
    if 1 not in seconds:
        raise ValueError(f"the cost of one token is the unit: lengths {sorted(seconds)} lack 1")
    return {n: s / seconds[1] for n, s in sorted(seconds.items())}


def tokens_per_cost(
    tokens_per_call: Mapping[int, float | None], cost: Mapping[int, float]
) -> dict[int, float]:
    """K -> tokens per target call at K over the cost of verifying `K + 1` tokens (one autoregressive step = 1):
    the speedup a drafter that costs nothing would reach. Ks without a figure or a measured cost are left out."""
    return {
        k: value / cost[k + 1]
        for k, value in sorted(tokens_per_call.items())
        if value is not None and k + 1 in cost
    }

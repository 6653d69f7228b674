"""The target's verification cost: one forward over `n` new tokens after a cached context, relative to `n = 1`.

Speculation pays when verifying `K + 1` tokens in one pass costs much less than `K + 1` one-token steps. How much less
depends on the model, the device, the dtype and the thread count, and the curve need not be smooth (a matrix kernel
chosen by shape): benchmarks/bench_verification_cost.py prints it for float32 and bfloat16 side by side (README). `measure_verification_cost` measures the curve (`evaluate` does it once per run,
for its target as it decodes, and reports it); `tokens_per_cost` combines it with tokens per target call at each K (the
decoded figure or the offline estimate, `specdistill.evaluation.offline`) into the expected tokens per unit of
target cost, where one autoregressive step costs 1. A drafter that costs nothing (prompt lookup) runs at that ratio
times the autoregressive speed; a draft model's own steps come on top.

The curve depends on the model, device, dtype, thread count and context, not on the run: `cached_verification_cost`
keeps it in a JSON file per such key (`evaluate.cost_cache`, by default under `~/.cache/specdistill/`), so a machine
measures it once. `padded_length` is what a length policy does with it (`specdistill.decoding.policies.CostPadded`):
where the curve falls (on these CPUs in float32 verifying 4 tokens can cost less than 3), a round that stops at K
is verified at the longer K' that costs the target no more, when the K' - K extra candidates are free (the rest of a
block already drafted).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

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


def cost_cache_key(target: torch.nn.Module, context_length: int) -> str:
    """What the curve depends on, as a file name: the target (where it was loaded from and its config), the device,
    the dtype, torch's thread count and version and the context length. The token counts timed are not in it: one
    file holds the curve at every count measured so far (`cached_verification_cost`)."""
    parameter = next(target.parameters())
    config = getattr(target, "config", None)
    described = {
        "model": getattr(config, "name_or_path", None) or type(target).__name__,
        "config": config.to_json_string(use_diff=False)
        if hasattr(config, "to_json_string")
        else repr(config),
        "device": str(parameter.device),
        "hardware": hardware_name(parameter.device),
        "dtype": str(parameter.dtype),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "context_length": context_length,
    }
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"verification_cost-{digest}.json"


def hardware_name(device: torch.device) -> str:
    """The processor a curve was measured on (a home directory shared by a cluster's nodes must not hand one node's
    curve to another kind): the GPU's name, else the CPU's model name (Linux) or `platform.processor()`."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cached_verification_cost(
    target: torch.nn.Module,
    lengths: Sequence[int],
    context_length: int,
    cache_dir: str | Path | None,
    vocab_size: int | None = None,
) -> dict[int, float]:
    """`relative_cost` of `measure_verification_cost` for `lengths`, read from `cache_dir` when this target, device,
    dtype, thread count and context were measured before at those counts (`cost_cache_key`). Otherwise the counts
    asked for and those the file already holds are measured again together, in one interleaved timing with one
    token's pass as the unit, and the file is replaced by the whole curve; with `cache_dir` None, measured every call.
    A cached file that is not such a table is refused, naming it."""

    def measure(counts: Sequence[int]) -> dict[int, float]:
        return relative_cost(measure_verification_cost(target, counts, context_length, vocab_size=vocab_size))

    if cache_dir is None:
        return measure(lengths)
    path = Path(cache_dir).expanduser() / cost_cache_key(target, context_length)
    table = read_cost_table(path) if path.exists() else {}
    if not set(lengths) <= set(table):
        table = measure(sorted(set(table) | set(lengths) | {1}))
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps({str(n): c for n, c in table.items()}, indent=1) + "\n")
        partial.replace(path)  # whole or absent, also with two runs measuring at once
    return {n: table[n] for n in sorted(lengths)}


def read_cost_table(path: Path) -> dict[int, float]:
    """The relative cost table in `path` (`{"1": 1.0, "2": ...}`): positive finite numbers with the one-token pass
    cost 1."""
    try:
        table = {int(n): float(c) for n, c in json.loads(path.read_text()).items()}
    except (ValueError, TypeError, AttributeError) as error:
        raise ValueError(
            f"{path} is not a verification cost table ({error}): delete it to measure again"
        ) from error
    if table.get(1) != 1.0 or not all(math.isfinite(c) and c > 0 for c in table.values()):
        raise ValueError(
            f"{path} is not a verification cost table (a cost that is not a positive number, or a one-token cost "
            "other than 1): delete it to measure again"
        )
    return table


def padded_length(k: int, cost: Mapping[int, float], cap: int) -> int:
    """The most candidates `m` in `[k, cap]` whose verification (`m + 1` tokens) costs the target no more than
    verifying `k + 1` tokens, by the relative cost table `cost`; `k` where the table lacks `k + 1`. Where extra
    candidates cost no drafting (a block already drafted), stopping at `m` instead of `k` is free."""
    if k + 1 not in cost:
        return k
    return max([k] + [m for m in range(k + 1, cap + 1) if m + 1 in cost and cost[m + 1] <= cost[k + 1]])

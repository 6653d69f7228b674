"""Offline passes shared by ranks (reference scoring, target caching): who this process is, and its batches.

Both passes run at fit start under the Trainer's strategy, so a process group may be up; each rank takes the batches
`rank, rank + world_size, ...` of an unsharded dataloader, and every rank runs the same number of forward passes (a
rank with fewer batches repeats its last one and discards it): frozen models sharded with ZeRO-3 gather their weights
collectively, so a rank that stopped early would hang the others.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch


def rank_and_world_size() -> tuple[int, int]:
    """This process's rank and the world size of the running process group; `(0, 1)` without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_sharded(dataloader: Any) -> bool:
    """Whether the dataloader already gives this rank only its share (a datamodule attached to a multi-device
    Trainer does, with equal lengths on every rank)."""
    return getattr(getattr(dataloader, "sampler", None), "num_replicas", 1) > 1


def batches_of_rank(dataloader: Sized, rank: int, world_size: int) -> Iterator[tuple[Any, bool]]:
    """`(batch, counts)` for this rank's batches of `dataloader` (`counts` True), then as many repeats of its last
    batch (`counts` False, to be discarded) as keep it in step with the rank that has the most."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, world_size = {world_size}), got {rank}")
    rounds = math.ceil(len(dataloader) / world_size)
    done, last = 0, None
    for index, batch in enumerate(dataloader):
        if index % world_size != rank:
            continue
        last = batch
        done += 1
        yield batch, True
    for _ in range(rounds - done):
        yield (last if last is not None else next(iter(dataloader))), False

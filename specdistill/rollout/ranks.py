"""Rollouts across ranks: which shards a process rolls out, and how the stage starts its processes.

Shard `s` belongs to rank `s % world_size` (`rank_shards`, a pure function of the shard count, rank and world
size), so every rank knows its share without talking to the others, an interrupted run resumes with any world size
(each rank skips its finished shards), and neighbouring prompts, often alike in length, land on different ranks.

`launch_ranks` starts the processes of the rollout stage with Lightning Fabric's DDP strategy: on one node it
re-launches the command once per extra device; under SLURM (`srun`, one task per device) or `torchrun` it reads the
ranks from the launcher's environment. A process group already running (a pipeline whose training steps started
one) is used as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch

log = logging.getLogger(__name__)


def _no_barrier() -> None:
    """One process has no one to wait for."""


@dataclass(frozen=True)
class Ranks:
    """The processes that share one rollout run: this one is `rank` of `world_size`; `barrier` returns once all of
    them have called it (e.g. `Fabric.barrier` or `torch.distributed.barrier`)."""

    rank: int = 0
    world_size: int = 1
    barrier: Callable[[], None] = field(default=_no_barrier, compare=False)

    def __post_init__(self) -> None:
        _check_rank(self.rank, self.world_size)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that creates the output directory and writes the stage's result."""
        return self.rank == 0


def rank_shards(num_shards: int, rank: int, world_size: int) -> list[int]:
    """The shards rank `rank` of `world_size` rolls out: `rank, rank + world_size, ...` below `num_shards`."""
    _check_rank(rank, world_size)
    return list(range(rank, num_shards, world_size))


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"rank must lie in [0, world_size) with world_size >= 1, got rank {rank} of {world_size}"
        )


def launch_ranks(
    device: torch.device, devices: int, num_nodes: int, timeout_minutes: float
) -> tuple[torch.device, Ranks]:
    """Start (or join) the rollout processes; return this process's device and its `Ranks`.

    Args:
        device: where a single process would run (`cpu`, `cuda`); with several ranks only its type counts, each rank
            getting its own device of that type.
        devices: processes per node (one per GPU; 1 with a target placed across the node's GPUs by `device_map`).
        num_nodes: nodes.
        timeout_minutes: how long a rank waits at a barrier for the others (the slowest rank's last shard).
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        log.info("rollouts join the running process group: rank %d of %d on %s", rank, world_size, device)
        return device, Ranks(rank, world_size, dist.barrier)
    if devices * num_nodes == 1:
        return device, Ranks()
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    fabric = Fabric(
        accelerator=device.type,
        devices=devices,
        num_nodes=num_nodes,
        strategy=DDPStrategy(timeout=timedelta(minutes=timeout_minutes)),
    )
    fabric.launch()
    log.info("rollouts on rank %d of %d (%s)", fabric.global_rank, fabric.world_size, fabric.device)
    return fabric.device, Ranks(fabric.global_rank, fabric.world_size, fabric.barrier)

"""Global batches: the papers state examples per optimizer step; devices, micro-batches and accumulation follow.

A training stage's `batch_size` is the global batch (all devices, one optimizer step) and `micro_batch_size` the
examples one device runs per forward pass (AdaSPEC's selection scope: the authors ran 2 per device x 8 GPUs = 16).
`batch_plan` derives the gradient accumulation from the world size (devices x nodes), so the update and the
selection scope are the paper's on any GPU count; a global batch the world size cannot divide is refused.

Step counts are pure functions of the dataset size and the plan, mirroring specdistill.data.sampler (each rank gets
`ceil(n / world)` examples, micro-batches of `micro_batch_size`, the last partial window still steps as Lightning
does): `optimizer_steps_per_epoch` and `matched_max_steps` (AdaSPEC's compute matching).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from specdistill.utils.strategy import _requested_devices as requested_devices


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's global batch is split.

    Attributes:
        global_batch_size: examples per optimizer step, all devices together.
        world_size: processes (devices x nodes).
        micro_batch_size: examples per device per forward pass.
        accumulate_grad_batches: micro-batches per device per optimizer step.
    """

    global_batch_size: int
    world_size: int
    micro_batch_size: int
    accumulate_grad_batches: int

    def __post_init__(self) -> None:
        product = self.world_size * self.micro_batch_size * self.accumulate_grad_batches
        if (
            min(self.global_batch_size, self.world_size, self.micro_batch_size, self.accumulate_grad_batches)
            < 1
        ):
            raise ValueError(f"every size of a batch plan must be >= 1: {self}")
        if product != self.global_batch_size:
            raise ValueError(
                f"world x micro x accumulation = {product} != global batch {self.global_batch_size}"
            )


def batch_plan(
    global_batch_size: int,
    world_size: int,
    micro_batch_size: int | None = None,
    accumulate_grad_batches: int | None = None,
) -> BatchPlan:
    """Split `global_batch_size` over `world_size` devices.

    With `micro_batch_size` the accumulation is derived (`accumulate_grad_batches` of 1 or None means "derive"; any
    other value must agree); without it the micro-batch is what is left per device after `accumulate_grad_batches`
    (default 1: no accumulation).

    Raises:
        ValueError: the world size does not divide the global batch, or the micro-batch (or the accumulation) does
            not divide what each device gets; the message names the sizes that would.
    """
    if global_batch_size < 1 or world_size < 1:
        raise ValueError(f"global batch {global_batch_size} and world size {world_size} must be >= 1.")
    if global_batch_size % world_size:
        raise ValueError(
            f"the global batch {global_batch_size} cannot be split over {world_size} devices (devices x nodes): "
            f"pick a global batch that is a multiple of {world_size} (<stage>.batch_size), or another device count"
        )
    per_device = global_batch_size // world_size
    accumulate = accumulate_grad_batches if accumulate_grad_batches and accumulate_grad_batches > 1 else None
    if micro_batch_size is not None:
        if micro_batch_size < 1 or per_device % micro_batch_size:
            raise ValueError(
                f"each of {world_size} devices gets {per_device} examples of the global batch {global_batch_size}, "
                f"which micro-batches of {micro_batch_size} do not divide; set <stage>.micro_batch_size to a "
                f"divisor of {per_device}"
            )
        derived = per_device // micro_batch_size
        if accumulate is not None and accumulate != derived:
            raise ValueError(
                f"trainer.accumulate_grad_batches={accumulate_grad_batches} disagrees with the global batch "
                f"{global_batch_size} = {world_size} devices x micro-batch {micro_batch_size} x {derived}: the "
                "accumulation is derived from <stage>.batch_size and <stage>.micro_batch_size; leave it unset"
            )
        return BatchPlan(global_batch_size, world_size, micro_batch_size, derived)
    accumulate = accumulate or 1
    if per_device % accumulate:
        raise ValueError(
            f"each of {world_size} devices gets {per_device} examples of the global batch {global_batch_size}, "
            f"which trainer.accumulate_grad_batches={accumulate} does not divide"
        )
    return BatchPlan(global_batch_size, world_size, per_device // accumulate, accumulate)


def world_size(trainer_cfg: Mapping[str, Any]) -> int:
    """Processes a trainer config will run: devices per node x nodes (`auto`/-1: every visible GPU, 1 on CPU)."""
    devices = trainer_cfg.get("devices", "auto")
    num_nodes = int(trainer_cfg.get("num_nodes", 1) or 1)
    per_node = requested_devices(devices)  # the parser check_devices uses
    if per_node is None:  # auto / -1: every visible GPU, or one CPU process
        accelerator = str(trainer_cfg.get("accelerator", "auto"))
        gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
        per_node = max(torch.cuda.device_count(), 1) if gpu else 1
    return per_node * num_nodes


def optimizer_steps_per_epoch(num_examples: int, plan: BatchPlan) -> int:
    """Optimizer steps of one epoch over `num_examples` (as WindowedSampler shards them and Lightning steps)."""
    per_rank = math.ceil(num_examples / plan.world_size)
    micro_batches = math.ceil(per_rank / plan.micro_batch_size)
    return math.ceil(micro_batches / plan.accumulate_grad_batches)


def matched_max_steps(num_examples: int, baseline: BatchPlan, baseline_epochs: int) -> int:
    """The optimizer steps of the baseline run (`baseline_epochs` epochs of `baseline`): AdaSPEC's exact budget."""
    return baseline_epochs * optimizer_steps_per_epoch(num_examples, baseline)

"""A seeded, epoch-aware, rank-aware sampler that also tells each example its accumulation window's token count.

Gradient accumulation sums `accumulate_grad_batches` consecutive micro-batches into one update. Normalising each
micro-batch's loss sum by the answer tokens of the *whole window* makes the update independent of how the window is
split. The sampler knows every micro-batch in advance (the order is a pure function of `(seed, epoch)`), so it
yields `(index, window_answer_tokens, global_window_answer_tokens)` keys that `WindowedDataset` turns into
examples; the DataLoader groups them into micro-batches of `batch_size` exactly as the sampler planned.

A run resumed in the middle of an epoch sets `resume_at = (epoch, micro_batches_done)`: that epoch's iteration then
starts after the micro-batches already trained, with the window totals of the full plan.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler

WindowKey = tuple[int, int, int]


class WindowedSampler(DistributedSampler):
    """Shuffled (or sequential) indices with their window totals; one shard per rank.

    It subclasses `DistributedSampler` so that Lightning keeps it under DDP (it shards itself: with `num_replicas`
    ranks, the order is padded by wrapping around to a multiple of the world size and rank r takes every
    `num_replicas`-th index, like `DistributedSampler`). Lightning calls `set_epoch` at each epoch start, and the
    order of epoch e is `torch.randperm(n, generator=manual_seed(seed + epoch))`, so a resumed run reproduces it.

    Args:
        answer_tokens: per example, the number of answer tokens (labels[1:] != -100).
        batch_size: micro-batch size per rank; the DataLoader must use the same.
        accumulate_grad_batches: micro-batches per optimizer step (the Trainer's setting).
        shuffle: shuffle each epoch (training) or keep the order (evaluation).
        seed: shuffling seed.
        num_replicas: world size; rank: this process's rank.
        resume_at: `(epoch, micro_batches_done)` of a run resumed mid-epoch: the next iteration of that epoch skips
            the first `micro_batches_done` micro-batches of this rank's shard (the window totals stay those of the
            full windows). Consumed by the first iteration; later epochs are complete.
    """

    def __init__(
        self,
        answer_tokens: Sequence[int],
        batch_size: int,
        accumulate_grad_batches: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        resume_at: tuple[int, int] | None = None,
    ) -> None:
        if batch_size < 1 or accumulate_grad_batches < 1:
            raise ValueError(
                f"batch_size={batch_size} and accumulate_grad_batches={accumulate_grad_batches} must be >= 1."
            )
        if len(answer_tokens) == 0:
            raise ValueError("WindowedSampler needs at least one example.")
        super().__init__(answer_tokens, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.answer_tokens = [int(n) for n in answer_tokens]
        self.batch_size = batch_size
        self.accumulate_grad_batches = accumulate_grad_batches
        self.resume_at = resume_at

    def order(self) -> list[int]:
        """All indices of this epoch, before sharding, padded to a multiple of the world size."""
        n = len(self.answer_tokens)
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=generator).tolist()
        else:
            indices = list(range(n))
        padding = self.total_size - n
        indices += (indices * math.ceil(padding / n))[:padding]
        return indices

    def plan(self) -> list[list[WindowKey]]:
        """Per rank, the keys `(index, window_answer_tokens, global_window_answer_tokens)` in yield order."""
        indices = self.order()
        shards = [indices[r :: self.num_replicas] for r in range(self.num_replicas)]
        window = self.batch_size * self.accumulate_grad_batches
        n_windows = math.ceil(self.num_samples / window)
        local = [
            [
                sum(self.answer_tokens[i] for i in shard[w * window : (w + 1) * window])
                for w in range(n_windows)
            ]
            for shard in shards
        ]
        global_totals = [sum(rank_totals[w] for rank_totals in local) for w in range(n_windows)]
        return [
            [(i, local[r][pos // window], global_totals[pos // window]) for pos, i in enumerate(shard)]
            for r, shard in enumerate(shards)
        ]

    def __iter__(self) -> Iterator[WindowKey]:  # type: ignore[override]
        keys = self.plan()[self.rank]
        resume_at, self.resume_at = self.resume_at, None  # only the first iteration after a resume is partial
        if resume_at is not None and resume_at[0] == self.epoch:
            done = resume_at[1]
            n_batches = math.ceil(self.num_samples / self.batch_size)
            if not 0 <= done <= n_batches:
                raise ValueError(
                    f"resume_at={resume_at}: {done} micro-batches done, but epoch {self.epoch} has {n_batches} "
                    f"micro-batches of {self.batch_size} on this rank; the checkpoint was written with another "
                    "batch size, world size or dataset. Resume with the settings it was written with."
                )
            # the plan is sharded before skipping: every rank skips its own first `done` micro-batches
            keys = keys[done * self.batch_size :]
        return iter(keys)

    def __len__(self) -> int:
        # the full epoch even while resuming: Lightning sizes the epoch from it and counts the resumed epoch's
        # batch_idx on from the micro-batches already done
        return self.num_samples

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])


class WindowedDataset(Dataset):
    """Indexable by the sampler's keys: returns the example with its window totals added.

    Args:
        examples: a map-style dataset of example dicts (e.g. a `datasets.Dataset` in torch format).
    """

    def __init__(self, examples: Any) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, key: WindowKey) -> dict[str, Any]:
        index, window_total, global_total = key
        example = dict(self.examples[int(index)])
        example["window_answer_tokens"] = window_total
        example["global_window_answer_tokens"] = global_total
        return example

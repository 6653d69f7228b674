"""`RolloutDataModule`: rollouts (or their hidden-state cache) split into training and validation sets."""

from __future__ import annotations

import datasets
import lightning as L
import torch
from torch.utils.data import DataLoader

from specdistill.head_data.collate import RolloutCollator
from specdistill.head_data.hidden_cache import load_hidden_cache
from specdistill.rollout.run import load_rollouts


def split_indices(num_examples: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic `(train, val)` split of example indices (a seeded permutation)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1).")
    num_val = round(val_fraction * num_examples)
    if val_fraction > 0 and num_val == 0:
        num_val = 1
    if num_examples - num_val < 1:
        raise ValueError(
            f"{num_examples} rollouts leave no training example with val_fraction={val_fraction}."
        )
    order = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[num_val:]), sorted(order[:num_val])


class RolloutDataModule(L.LightningDataModule):
    """Serves rollouts (or their hidden-state cache) for `AcceptanceHeadModule`.

    Args:
        rollout_dir: output of `run_rollouts`.
        batch_size: training examples (whole rollouts) per batch.
        eval_batch_size: validation batch size (default: batch_size).
        mixing_ratio: r of the mixed sequence (ignored with a cache, whose mixing is fixed: it must match).
        val_fraction: share of rollouts held out for validation (split by a seeded permutation).
        seed: seed of the split and of the fixed validation mixing.
        pad_token_id: padding id.
        hidden_cache_dir: output of `build_hidden_cache`; when set, batches carry hidden states and no draft runs.
        num_workers: DataLoader workers.
        head_input: the head's input, `"candidate"` or `"proposer"` (see `specdistill.head_data.collate`).
    """

    def __init__(
        self,
        rollout_dir: str,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        mixing_ratio: float = 0.15,
        val_fraction: float = 0.05,
        seed: int = 0,
        pad_token_id: int = 0,
        hidden_cache_dir: str | None = None,
        num_workers: int = 0,
        head_input: str = "candidate",
    ) -> None:
        super().__init__()
        self.rollout_dir = rollout_dir
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.mixing_ratio = mixing_ratio
        self.val_fraction = val_fraction
        self.seed = seed
        self.pad_token_id = pad_token_id
        self.hidden_cache_dir = hidden_cache_dir
        self.num_workers = num_workers
        self.head_input = head_input
        self.train_set: datasets.Dataset | None = None
        self.val_set: datasets.Dataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if self.hidden_cache_dir is not None:
            data = load_hidden_cache(self.hidden_cache_dir, self.mixing_ratio, self.head_input)
            data = data.with_format("torch", columns=["hidden"], output_all_columns=True)
        else:
            data = load_rollouts(self.rollout_dir)
        train, val = split_indices(len(data), self.val_fraction, self.seed)
        self.train_set, self.val_set = data.select(train), data.select(val)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            collate_fn=RolloutCollator(self.pad_token_id, self.mixing_ratio, None, self.head_input),
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_set,
            batch_size=self.eval_batch_size,
            shuffle=False,
            collate_fn=RolloutCollator(self.pad_token_id, self.mixing_ratio, self.seed, self.head_input),
            num_workers=self.num_workers,
        )

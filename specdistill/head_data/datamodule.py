"""`RolloutDataModule`: rollouts (or their hidden-state cache) split into training and validation sets."""

from __future__ import annotations

from typing import Any

import datasets
import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from specdistill.head_data.collate import RolloutCollator
from specdistill.head_data.hidden_cache import HiddenCache, check_hidden_cache, load_hidden_cache
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
        hidden_cache: a `HiddenCache` built at fit start (by `AcceptanceHeadModule(hidden_cache=)`, the same object):
            batches carry its hidden states, read once it is ready (the split is known at `setup`, the rows after
            the module's fit or validation start); instead of `hidden_cache_dir`.
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
        hidden_cache: HiddenCache | None = None,
    ) -> None:
        super().__init__()
        if hidden_cache is not None and hidden_cache_dir is not None:
            raise ValueError(
                "RolloutDataModule takes hidden_cache (built at fit start) or hidden_cache_dir (built already), "
                "not both"
            )
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
        self.hidden_cache = hidden_cache
        self.train_set: datasets.Dataset | CachedRows | None = None
        self.val_set: datasets.Dataset | CachedRows | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if self.hidden_cache is not None:
            check_hidden_cache(
                self.hidden_cache.key, self.hidden_cache.path, self.mixing_ratio, self.head_input
            )
            train, val = split_indices(self.hidden_cache.num_examples, self.val_fraction, self.seed)
            self.train_set, self.val_set = (
                CachedRows(self.hidden_cache, train),
                CachedRows(self.hidden_cache, val),
            )
            return
        if self.hidden_cache_dir is not None:
            data = _torch_rows(load_hidden_cache(self.hidden_cache_dir, self.mixing_ratio, self.head_input))
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


def _torch_rows(cache: datasets.Dataset) -> datasets.Dataset:
    """Hidden-cache rows as the collator reads them: `hidden` as a tensor, the other columns as stored."""
    return cache.with_format("torch", columns=["hidden"], output_all_columns=True)


class CachedRows(Dataset):
    """Rows `indices` of a `HiddenCache` built at fit start: the length is known at `setup`, the rows once the cache is
    ready (a validate-only run makes its dataloaders before the module's `on_validation_start` builds the cache, and
    reads them after).

    Args:
        cache: the fit-start hidden cache.
        indices: the rows of this split, in order.
    """

    def __init__(self, cache: HiddenCache, indices: list[int]) -> None:
        self.cache = cache
        self.indices = indices
        self._rows: datasets.Dataset | None = None

    def rows(self) -> datasets.Dataset:
        """The selected rows (the cache must be ready)."""
        if self._rows is None:
            self._rows = _torch_rows(self.cache.dataset).select(self.indices)
        return self._rows

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows()[index]

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        # the DataLoader's batched fetch, as it reads a `datasets.Dataset` directly: the same rows
        return self.rows().__getitems__(indices)

"""Acceptance-head training data: the mixed sequence Z, collation, and a small LightningDataModule.

Training input (METHODS.md section 4): Z_i = X_i (the target's token) with probability r and Y_i (the draft's token)
otherwise. The head is trained only at positions holding a draft token, on the hidden state whose *input* token is
Y_i, i.e. at absolute position `len(prompt) + i` of prompt + Z (no shift: the head judges the token it just read).

Batches (right-padded):

- from rollouts: `input_ids (B, L) long`, `attention_mask (B, L) long`, `loss_mask (B, L) bool` (True where the input
  token is a draft token), `head_labels (B, L) float` (soft label there, 0 elsewhere), `example_id (B,) long`;
- from a hidden-state cache (`specdistill.rollout.hidden_cache`): `hidden_states (B, N, H) float`,
  `loss_mask (B, N) bool`, `head_labels (B, N) float`, `example_id (B,) long`.
"""

from __future__ import annotations

from typing import Any

import datasets
import lightning as L
import torch
from torch.utils.data import DataLoader

from specdistill.rollout.run import load_rollouts


def mix_sequence(
    response_ids: torch.Tensor, draft_tokens: torch.Tensor, r: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mix target and draft tokens position by position.

    Args:
        response_ids: `(T,)` target response X.
        draft_tokens: `(T,)` draft tokens Y (Y_i sampled given prompt + X_<i).
        r: mixing ratio, the probability of keeping the target token (0.15 in SpecDec++).
        generator: random source (None: the global torch RNG).

    Returns:
        `(mixed_ids, is_draft_mask)`, both `(T,)`: Z, and True where Z_i is the draft token Y_i (the positions that
        carry the loss), even where Y_i happens to equal X_i.
    """
    if response_ids.shape != draft_tokens.shape or response_ids.dim() != 1:
        raise ValueError(
            f"response_ids {tuple(response_ids.shape)} and draft_tokens {tuple(draft_tokens.shape)} must be (T,)."
        )
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"mixing ratio r={r} must be in [0, 1] (SpecDec++ uses 0.15).")
    keep_target = torch.rand(response_ids.shape, generator=generator) < r
    is_draft_mask = ~keep_target
    return torch.where(is_draft_mask, draft_tokens, response_ids), is_draft_mask


def example_generator(seed: int, example_id: int) -> torch.Generator:
    """A generator that depends only on (seed, example): reproducible whatever the batching or worker."""
    return torch.Generator().manual_seed((seed * 1_000_003 + example_id) % (2**63 - 1))


class RolloutCollator:
    """Builds head-training batches from rollout rows or hidden-state cache rows.

    Args:
        pad_token_id: id for padding (masked out of attention).
        mixing_ratio: r, probability of keeping the target token at each response position.
        seed: None draws the mixing from the global RNG (fresh every epoch: training); an int fixes each example's
            mixing by `(seed, prompt_index)` (validation, cache building).
    """

    def __init__(self, pad_token_id: int = 0, mixing_ratio: float = 0.15, seed: int | None = None) -> None:
        if not 0.0 <= mixing_ratio <= 1.0:
            raise ValueError(f"mixing_ratio={mixing_ratio} must be in [0, 1].")
        self.pad_token_id = pad_token_id
        self.mixing_ratio = mixing_ratio
        self.seed = seed

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if "hidden" in rows[0]:
            return self._collate_cached(rows)
        return self._collate_rollouts(rows)

    def _collate_rollouts(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sequences, masks, labels = [], [], []
        for row in rows:
            prompt = torch.as_tensor(row["prompt_ids"], dtype=torch.long)
            response = torch.as_tensor(row["response_ids"], dtype=torch.long)
            generator = None if self.seed is None else example_generator(self.seed, int(row["prompt_index"]))
            mixed, is_draft = mix_sequence(
                response, torch.as_tensor(row["draft_tokens"], dtype=torch.long), self.mixing_ratio, generator
            )
            sequences.append(torch.cat([prompt, mixed]))
            masks.append(torch.cat([torch.zeros(len(prompt), dtype=torch.bool), is_draft]))
            labels.append(
                torch.cat([torch.zeros(len(prompt)), torch.as_tensor(row["labels"], dtype=torch.float32)])
            )
        width = max(len(s) for s in sequences)
        batch = {
            "input_ids": torch.full((len(rows), width), self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros((len(rows), width), dtype=torch.long),
            "loss_mask": torch.zeros((len(rows), width), dtype=torch.bool),
            "head_labels": torch.zeros((len(rows), width)),
        }
        for i, (seq, mask, label) in enumerate(zip(sequences, masks, labels, strict=True)):
            batch["input_ids"][i, : len(seq)] = seq
            batch["attention_mask"][i, : len(seq)] = 1
            batch["loss_mask"][i, : len(seq)] = mask
            batch["head_labels"][i, : len(seq)] = torch.where(mask, label, 0.0)
        batch["example_id"] = torch.tensor([int(row["prompt_index"]) for row in rows], dtype=torch.long)
        return batch

    def _collate_cached(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        hidden = [torch.as_tensor(row["hidden"], dtype=torch.float32) for row in rows]
        width, size = max(len(h) for h in hidden), hidden[0].shape[-1]
        batch = {
            "hidden_states": torch.zeros((len(rows), width, size)),
            "loss_mask": torch.zeros((len(rows), width), dtype=torch.bool),
            "head_labels": torch.zeros((len(rows), width)),
        }
        for i, (row, h) in enumerate(zip(rows, hidden, strict=True)):
            batch["hidden_states"][i, : len(h)] = h
            batch["loss_mask"][i, : len(h)] = True
            batch["head_labels"][i, : len(h)] = torch.as_tensor(row["head_labels"], dtype=torch.float32)
        batch["example_id"] = torch.tensor([int(row["prompt_index"]) for row in rows], dtype=torch.long)
        return batch


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
        self.train_set: datasets.Dataset | None = None
        self.val_set: datasets.Dataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if self.hidden_cache_dir is not None:
            from specdistill.rollout.hidden_cache import load_hidden_cache

            data = load_hidden_cache(self.hidden_cache_dir, expected_mixing_ratio=self.mixing_ratio)
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
            collate_fn=RolloutCollator(self.pad_token_id, self.mixing_ratio, seed=None),
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_set,
            batch_size=self.eval_batch_size,
            shuffle=False,
            collate_fn=RolloutCollator(self.pad_token_id, self.mixing_ratio, seed=self.seed),
            num_workers=self.num_workers,
        )

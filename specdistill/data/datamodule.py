"""`TaskDataModule`: a task's splits tokenised, masked and batched for Lightning (batch format: docs/ARCHITECTURE.md)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import datasets
import lightning as L
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from specdistill.data.collate import BATCH_KEYS, Collator
from specdistill.data.packing import PackingCollator
from specdistill.data.sampler import WindowedDataset, WindowedSampler
from specdistill.data.tokenize import IGNORE_INDEX, tokenize_records, truncation_policy
from specdistill.errors import DataError
from specdistill.tasks.base import SPLITS, Task

log = logging.getLogger(__name__)

_STAGE_SPLITS: dict[str | None, tuple[str, ...]] = {
    "fit": ("train", "validation"),
    "validate": ("validation",),
    "test": ("test",),
    "predict": ("test",),
    None: SPLITS,
}
_RESERVED = {*BATCH_KEYS, "attention_mask"}


class TaskDataModule(L.LightningDataModule):
    """Tokenised splits of one task, with prompt masking, truncation, seeded shuffling and window token counts.

    Each example is `prompt ids + answer ids + eos` with labels -100 on the prompt (see
    `specdistill.data.tokenize` for the truncation policy). Batches are right-padded with the tokenizer's pad id and
    carry `input_ids, attention_mask, labels, example_id, window_answer_tokens, global_window_answer_tokens` plus
    attached float columns (`attach_column`).

    Args:
        task: the task (built by Hydra from `conf/task`).
        tokenizer: the tokenizer shared by all models of the run; needs an EOS and a pad token.
        max_length: longest example in tokens (prompt + answer + EOS).
        batch_size: training micro-batch size per device.
        eval_batch_size: validation/test batch size (default: batch_size).
        accumulate_grad_batches: micro-batches per optimizer step; must match the Trainer's.
        seed: shuffling seed; the order of epoch e depends only on (seed, e).
        num_workers: DataLoader worker processes.
        truncation: "prompt_left" (default) or "drop"; see `specdistill.data.tokenize`.
        pad_to_multiple_of: round the padded length up to a multiple of this (None: longest in batch).
        packing: training and validation batches packed into rows of `max_length` (`specdistill.data.packing`);
            `scoring_dataloader` stays one example per row.
    """

    def __init__(
        self,
        task: Task,
        tokenizer: PreTrainedTokenizerBase,
        max_length: int = 512,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        accumulate_grad_batches: int = 1,
        seed: int = 0,
        num_workers: int = 0,
        truncation: str = "prompt_left",
        pad_to_multiple_of: int | None = None,
        packing: bool = False,
    ) -> None:
        super().__init__()
        if max_length < 2:
            raise ValueError(
                f"max_length={max_length}: an example needs at least a prompt and an answer token."
            )
        if batch_size < 1 or (eval_batch_size is not None and eval_batch_size < 1):
            raise ValueError(
                f"batch sizes must be >= 1 (batch_size={batch_size}, eval_batch_size={eval_batch_size})."
            )
        if accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches={accumulate_grad_batches} must be >= 1.")
        if tokenizer.pad_token_id is None:
            raise ValueError(
                "The tokenizer has no pad token; set tokenizer.pad_token (e.g. to its EOS token)."
            )
        truncation_policy(truncation)  # fail early on an unknown policy
        self.task = task
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.accumulate_grad_batches = accumulate_grad_batches
        self.seed = seed
        self.num_workers = num_workers
        self.truncation = truncation
        self.collator = Collator(tokenizer.pad_token_id, pad_to_multiple_of)
        self.packing_collator = PackingCollator(tokenizer.pad_token_id, max_length) if packing else None
        self.dropped: dict[str, int] = {}
        self._records: dict[str, datasets.Dataset] = {}
        self._tokenized: dict[str, datasets.Dataset] = {}
        self._source_index: dict[str, list[int]] = {}
        self._prompt_lengths: dict[str, list[int]] = {}  # where each example's (last) answer starts
        self._epoch = 0
        self._train_sampler: WindowedSampler | None = None
        # (epoch, micro-batches done) from a mid-epoch checkpoint, for the next training sampler
        self._resume_at: tuple[int, int] | None = None

    # ------------------------------------------------------------------ splits
    def setup(self, stage: str | None = None) -> None:
        """Tokenise the splits a stage needs (fit: train + validation when the task has it; test: test)."""
        if stage not in _STAGE_SPLITS:
            raise ValueError(f"Unknown stage {stage!r}; Lightning passes one of {list(_STAGE_SPLITS)}.")
        for split in _STAGE_SPLITS[stage]:
            if split == "train" or self.task.has_split(split):
                self.tokenized(split)

    def records(self, split: str) -> datasets.Dataset:
        """The task's raw records of `split` (loaded once)."""
        if split not in self._records:
            self._records[split] = self.task.load_split(split)
        return self._records[split]

    def tokenized(self, split: str) -> datasets.Dataset:
        """Columns `input_ids`, `labels`, `example_id` (row index here) and any attached columns of `split`."""
        if split not in self._tokenized:
            records = self.records(split)
            encoded, kept = tokenize_records(
                self.task, records.to_list(), self.tokenizer, self.max_length, self.truncation
            )
            self.dropped[split] = len(records) - len(kept)
            if self.dropped[split]:
                log.warning(
                    "%s/%s: dropped %d of %d examples with no answer token left after truncation to max_length=%d "
                    "(truncation=%r)",
                    self.task.name, split, self.dropped[split], len(records), self.max_length, self.truncation,
                )  # fmt: skip
            if not encoded:
                raise DataError(
                    f"Split {split!r} of task {self.task.name!r} is empty after tokenisation: all {len(records)} "
                    f"examples lost their answer to truncation (max_length={self.max_length}, "
                    f"truncation={self.truncation!r}); raise max_length."
                )
            self._source_index[split] = kept
            self._prompt_lengths[split] = [e.prompt_length for e in encoded]
            self._tokenized[split] = datasets.Dataset.from_dict(
                {
                    "input_ids": [e.input_ids for e in encoded],
                    "labels": [e.labels for e in encoded],
                    "example_id": list(range(len(encoded))),
                }
            )
        return self._tokenized[split]

    def prompts(self, split: str) -> list[dict[str, Any]]:
        """For generation/evaluation: `{"example_id", "prompt_ids", "record"}` per tokenised example of `split`.

        `prompt_ids` are the example's prompt tokens as trained on (left-truncated when the example was too long);
        for a chat trained on every assistant turn, the chat before its last one.
        """
        ds = self.tokenized(split)
        records = self.records(split)
        out = []
        rows = ds.select_columns(["example_id", "input_ids"])
        starts = zip(self._source_index[split], self._prompt_lengths[split], strict=True)
        for row, (source, prompt_length) in zip(rows, starts, strict=True):
            out.append(
                {
                    "example_id": row["example_id"],
                    "prompt_ids": row["input_ids"][:prompt_length],
                    "record": records[source],
                }
            )
        return out

    def attach_column(self, split: str, name: str, values: Sequence[Sequence[float]]) -> None:
        """Add (or replace) a per-example float column aligned with the shifted positions: `(T_i - 1,)` each.

        Batches then carry it as `name: (B, T - 1) float32`, padded with 0.0 (e.g. cached reference divergences).
        """
        if name in _RESERVED:
            raise ValueError(
                f"Column name {name!r} is reserved; choose another (reserved: {sorted(_RESERVED)})."
            )
        ds = self.tokenized(split)
        if len(values) != len(ds):
            raise ValueError(
                f"attach_column({split!r}, {name!r}): {len(values)} rows given, the split has {len(ds)}."
            )
        rows = []
        for example_id, (row, ids) in enumerate(zip(values, ds["input_ids"], strict=True)):
            row = [float(v) for v in row]
            if len(row) != len(ids) - 1:
                raise ValueError(
                    f"attach_column({split!r}, {name!r}): example {example_id} has {len(row)} values; it needs "
                    f"len(input_ids) - 1 = {len(ids) - 1} (one per shifted position)."
                )
            if not all(math.isfinite(v) for v in row):
                raise ValueError(
                    f"attach_column({split!r}, {name!r}): example {example_id} has NaN or inf values."
                )
            rows.append(row)
        if name in ds.column_names:
            ds = ds.remove_columns(name)
        feature = datasets.Sequence(datasets.Value("float32"))
        self._tokenized[split] = ds.add_column(name, rows, feature=feature)

    def answer_tokens(self, split: str) -> list[int]:
        """Per example of `split`, the number of answer tokens (labels[1:] != -100)."""
        return [
            sum(1 for label in labels[1:] if label != IGNORE_INDEX)
            for labels in self.tokenized(split)["labels"]
        ]

    # ------------------------------------------------------------------ loaders
    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    def _loader(
        self, split: str, batch_size: int, accumulate: int, shuffle: bool, packed: bool = False
    ) -> DataLoader:
        ds = self.tokenized(split)
        world_size, rank = self._world()
        sampler = WindowedSampler(
            self.answer_tokens(split),
            batch_size,
            accumulate,
            shuffle,
            self.seed,
            num_replicas=world_size,
            rank=rank,
        )
        if shuffle:
            sampler.set_epoch(self._epoch)
            sampler.resume_at, self._resume_at = self._resume_at, None
            self._train_sampler = sampler
        return DataLoader(
            WindowedDataset(ds.with_format("torch")),
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=self.packing_collator if packed and self.packing_collator else self.collator,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", self.batch_size, self.accumulate_grad_batches, shuffle=True, packed=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation", self.eval_batch_size, 1, shuffle=False, packed=True)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.eval_batch_size, 1, shuffle=False)

    def scoring_dataloader(self, split: str) -> DataLoader:
        """Every example of `split` once, in `example_id` order (for offline passes such as reference scoring)."""
        return self._loader(split, self.eval_batch_size, 1, shuffle=False)

    # ------------------------------------------------------------------ resume
    def _batches_done(self) -> int:
        """Micro-batches of the current epoch whose training step ran (0 without a trainer).

        Checkpoints are written in `on_train_batch_end` (ModelCheckpoint, PreemptionCheckpoint) after the batch's
        `processed` count was incremented, or after validation, when it equals `completed`: in both cases it counts
        exactly the micro-batches whose gradients are in the checkpoint (both callbacks save only right after an
        optimizer step, so with gradient accumulation this is a whole number of windows).
        """
        trainer = self.trainer
        if trainer is None:
            return 0
        return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)

    def state_dict(self) -> dict[str, int]:
        """The data state saved in Lightning checkpoints: `{"epoch", "seed", "batches_done"}`.

        `batches_done` (micro-batches of `epoch` already trained) lets a run resumed mid-epoch continue that epoch's
        order after them instead of from its first batch.
        """
        epoch = self._train_sampler.epoch if self._train_sampler is not None else self._epoch
        return {"epoch": epoch, "seed": self.seed, "batches_done": self._batches_done()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if int(state_dict.get("seed", self.seed)) != self.seed:
            log.warning(
                "resuming with data seed %d but the checkpoint was written with seed %s: the example order differs",
                self.seed, state_dict["seed"],
            )  # fmt: skip
        if "batches_done" not in state_dict:
            log.warning(
                "the checkpoint's data state has no batches_done (written by an older version): a run resumed "
                "mid-epoch restarts that epoch's data from its first batch"
            )
        self._epoch = int(state_dict["epoch"])
        self._resume_at = (self._epoch, int(state_dict.get("batches_done", 0)))
        if self._train_sampler is not None:
            # the training loader may exist already (`trainer.estimated_stepping_batches` in configure_optimizers
            # builds it, before the checkpoint is restored under DeepSpeed) and Lightning does not rebuild it
            self._train_sampler.set_epoch(self._epoch)
            self._train_sampler.resume_at, self._resume_at = self._resume_at, None

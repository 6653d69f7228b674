"""Right-padding collation of tokenised examples into the batch format of docs/ARCHITECTURE.md."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdistill.data.tokenize import IGNORE_INDEX

# per-example keys every batch carries; any other key is an attached float column aligned with shifted positions
BATCH_KEYS = ("input_ids", "labels", "example_id", "window_answer_tokens", "global_window_answer_tokens")


def pad_rows(rows: Sequence[Any], width: int, value: float | int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        row = torch.as_tensor(row, dtype=dtype)
        out[i, : row.numel()] = row
    return out


@dataclass
class Collator:
    """Collate examples `{"input_ids", "labels", "example_id", "window_answer_tokens", ...}` into a batch.

    Returns `input_ids: (B, T) long` (right-padded with `pad_token_id`), `attention_mask: (B, T) long` (1 on real
    tokens, from the lengths: the pad id may equal EOS), `labels: (B, T) long` (-100 on padding),
    `example_id: (B,) long`, `window_answer_tokens: () long`, `global_window_answer_tokens: () long`, and every
    attached float column as `(B, T - 1) float32` padded with 0.0.

    Args:
        pad_token_id: id used for padding `input_ids`.
        pad_to_multiple_of: round T up to a multiple of this (tensor-core friendly shapes); None pads to the longest.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("Cannot collate an empty list of examples.")
        lengths = [len(e["input_ids"]) for e in examples]
        width = max(lengths)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = {
            "input_ids": pad_rows([e["input_ids"] for e in examples], width, self.pad_token_id, torch.long),
            "attention_mask": (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long(),
            "labels": pad_rows([e["labels"] for e in examples], width, IGNORE_INDEX, torch.long),
            "example_id": torch.tensor([int(e["example_id"]) for e in examples], dtype=torch.long),
        }
        for key in ("window_answer_tokens", "global_window_answer_tokens"):
            if key in examples[0]:
                # every example of a micro-batch carries its window's total; they agree by construction
                batch[key] = torch.tensor(int(examples[0][key]), dtype=torch.long)
        for key in examples[0]:
            if key in BATCH_KEYS:
                continue
            for e, n in zip(examples, lengths, strict=True):
                if len(e[key]) != n - 1:
                    raise ValueError(
                        f"Column {key!r} of example {int(e['example_id'])} has {len(e[key])} values; it must be "
                        f"aligned with the shifted positions: len(input_ids) - 1 = {n - 1}."
                    )
            batch[key] = pad_rows([e[key] for e in examples], width - 1, 0.0, torch.float32)
        return batch

"""Packing: the examples of a micro-batch laid end to end in as few rows of `max_length` as they fit, so a batch
carries answer tokens instead of padding (`distill.packing` / `+adaspec.packing`).

A packed batch has the keys of `specdistill.data.collate.Collator`'s and:

* `position_ids: (R, T) long`: positions restarting at 0 with each example (padding continues its row's last
  example), which is how Hugging Face models see packed rows: given `position_ids` and no attention mask, they attend
  only within each run of increasing positions (`transformers.masking_utils.find_packed_sequence_indices`), so an
  example's hidden states are those it has alone;
* `segment_ids: (R, T) long`: which of its row's examples a position belongs to (0, 1, ...), -1 on padding; heads
  that attend themselves (EAGLE-3's training-time test) mask across segments with it;
* `segments: (S, 4) long`: per example, `[row, start, length, example_id]`, in row-major order (the order of the
  answer rows `labels[:, 1:] != -100` too), for caches that hold one entry per example;
* `example_id: (S,) long`: the examples in that order (one per segment, not per row).

`attention_mask` is still 1 on every real token of a row. An example never spans two rows. The last token of one
example and the first of the next sit side by side; the next example's first token is a prompt token (label -100),
so no answer row ever predicts across a boundary. Attached float columns (`Collator`) are not packed: a stage that
attaches them (AdaSPEC's cached reference scores) refuses packing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdistill.data.collate import BATCH_KEYS, pad_rows
from specdistill.data.tokenize import IGNORE_INDEX


def pack(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Rows of indices into `lengths`, each row's total at most `max_length`: first fit over the examples in order
    (so a row keeps the sampler's order, and the result depends on nothing else).

    Raises:
        ValueError: an example longer than `max_length`.
    """
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        if n > max_length:
            raise ValueError(f"an example of {n} tokens does not fit a packed row of max_length={max_length}")
        row = next((r for r, free in enumerate(room) if free >= n), None)
        if row is None:
            rows.append([])
            room.append(max_length)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= n
    return rows


@dataclass
class PackingCollator:
    """Collate examples into packed rows (module docstring).

    Args:
        pad_token_id: id used for padding `input_ids`.
        max_length: the longest row.
    """

    pad_token_id: int
    max_length: int

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("Cannot collate an empty list of examples.")
        attached = sorted(set(examples[0]) - set(BATCH_KEYS))
        if attached:
            raise ValueError(
                f"packed batches carry no attached columns ({attached}): turn packing off for this stage"
            )
        lengths = [len(e["input_ids"]) for e in examples]
        rows = pack(lengths, self.max_length)
        width = max(sum(lengths[i] for i in row) for row in rows)
        ids, labels, positions, segment_ids, segments = [], [], [], [], []
        for r, row in enumerate(rows):
            ids.append(torch.cat([torch.as_tensor(examples[i]["input_ids"]) for i in row]))
            labels.append(torch.cat([torch.as_tensor(examples[i]["labels"]) for i in row]))
            positions.append(torch.cat([torch.arange(lengths[i]) for i in row]))
            segment_ids.append(torch.cat([torch.full((lengths[i],), s) for s, i in enumerate(row)]))
            start = 0
            for i in row:
                segments.append([r, start, lengths[i], int(examples[i]["example_id"])])
                start += lengths[i]
        used = torch.tensor([len(row_ids) for row_ids in ids])
        position_ids = pad_rows(positions, width, 0, torch.long)
        tail = torch.arange(width)[None, :] - used[:, None]  # padding continues its row's last example
        last_start = torch.tensor([int(p[-1]) + 1 for p in positions])[:, None]
        position_ids = torch.where(tail >= 0, last_start + tail, position_ids)
        batch = {
            "input_ids": pad_rows(ids, width, self.pad_token_id, torch.long),
            "attention_mask": (tail < 0).long(),
            "labels": pad_rows(labels, width, IGNORE_INDEX, torch.long),
            "position_ids": position_ids,
            "segment_ids": pad_rows(segment_ids, width, -1, torch.long),
            "segments": torch.tensor(segments, dtype=torch.long).reshape(-1, 4),
            "example_id": torch.tensor([s[3] for s in segments], dtype=torch.long),
        }
        for key in ("window_answer_tokens", "global_window_answer_tokens"):
            if key in examples[0]:
                batch[key] = torch.tensor(int(examples[0][key]), dtype=torch.long)
        return batch


def padding_share(lengths: Sequence[int], batch_size: int, max_length: int) -> tuple[float, float, int]:
    """`(padded share unpacked, padded share packed, packed rows)` of batches of `batch_size` consecutive examples of
    `lengths`: what packing saves (the sampler shuffles, so a training epoch's figures differ a little)."""
    plain = packed = tokens = rows = 0
    for i in range(0, len(lengths), batch_size):
        batch = list(lengths[i : i + batch_size])
        tokens += sum(batch)
        plain += len(batch) * max(batch)
        layout = pack(batch, max_length)
        rows += len(layout)
        packed += len(layout) * max(sum(batch[j] for j in row) for row in layout)
    return 1 - tokens / plain, 1 - tokens / packed, rows


def is_packed(batch: Any) -> bool:
    """Whether `batch` is a packed batch (`PackingCollator`)."""
    return "segments" in batch

"""Cached reference scores: D(p, r) per answer token, computed once so AdaSPEC training skips the reference forward.

Storage format (one row per example): `scores[example_id]` is a list of `L - 1` floats, L = the example's real
(unpadded) length, aligned with the shifted positions (`scores[i][t]` scores the prediction of token t + 1 from
position t) and 0.0 on positions that are not answer tokens. A collate function turns rows back into the batch
column `ref_divergence: (B, T-1)` with `pad_scores`; `specdistill.selection.reference.cached_reference_scores` saves
and reloads them, and `CachedReferenceScores` reads the column during training (docs/METHODS.md section 3).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from specdistill.losses.answers import answer_mask
from specdistill.losses.divergence import Divergence
from specdistill.losses.rows import answer_rows
from specdistill.utils.distributed import batches_of_rank


@torch.no_grad()
def score_batch(
    target: nn.Module, reference: nn.Module, batch: Mapping[str, Any], divergence: Divergence, vocab_size: int
) -> torch.Tensor:
    """Reference divergence D(p, r) on one batch. Returns `(B, T-1)` float, 0 where not an answer token."""
    answers = answer_mask(batch["labels"])
    target_rows = answer_rows(target, batch, answers, vocab_size)
    reference_rows = answer_rows(reference, batch, answers, vocab_size)
    out = torch.zeros(answers.shape, dtype=torch.float32, device=answers.device)
    out[answers] = divergence.rows(target_rows, reference_rows)
    return out


def score_reference(
    target: nn.Module,
    reference: nn.Module,
    dataloader: Iterable[Mapping[str, Any]],
    divergence: Divergence,
    vocab_size: int,
    rank: int = 0,
    world_size: int = 1,
    progress: bool = False,
) -> dict[int, list[float]]:
    """Score the examples of `dataloader` with the reference: `{example_id: [D(p, r) per shifted position]}`.

    Use the same divergence as the AdaSPEC training (the gap is D(p, q) - D(p, r)). Models must already be where
    they run (the batches follow the target's first parameter); they are put in eval mode. Each row has the
    example's real length minus one (see module doc).

    With `world_size > 1` this rank scores batches `rank, rank + world_size, ...` only, in step with the other ranks
    (`specdistill.utils.distributed.batches_of_rank`).
    """
    target.eval()
    reference.eval()
    scores: dict[int, list[float]] = {}
    device = next(target.parameters()).device
    rounds = math.ceil(len(dataloader) / world_size)
    bar = tqdm(total=rounds, desc="reference scores", unit="batch", disable=not progress or rank != 0)
    for batch, counts in batches_of_rank(dataloader, rank, world_size):
        batch = _to(batch, device)
        values = score_batch(target, reference, batch, divergence, vocab_size).cpu()
        bar.update()
        if not counts:  # kept step with the other ranks; the result is discarded
            continue
        lengths = batch["attention_mask"].sum(dim=1).cpu()
        for example_id, row, length in zip(
            batch["example_id"].tolist(), values, lengths.tolist(), strict=True
        ):
            if example_id in scores:
                raise ValueError(
                    f"example_id {example_id} appears twice in the dataloader; ids must be unique"
                )
            scores[int(example_id)] = row[: max(int(length) - 1, 0)].tolist()
    bar.close()
    return scores


def _to(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def pad_scores(rows: Sequence[Sequence[float]], length: int) -> torch.Tensor:
    """Stack per-example score rows into the batch column `ref_divergence: (B, length)`, zero-padded.

    `length` is the padded sequence length minus one (T - 1).
    """
    out = torch.zeros(len(rows), length, dtype=torch.float32)
    for i, row in enumerate(rows):
        if len(row) > length:
            raise ValueError(
                f"cached score row {i} has {len(row)} positions but the batch has only {length}; "
                "the cache was computed with a different tokenisation or max_length: re-run the score stage"
            )
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out

"""Reference-score providers: D(p, r) per answer token, the reference half of AdaSPEC's gap (docs/METHODS.md section 3).

`DistillModule(reference=...)` takes one of these and, when its selector `needs_reference`, calls

    provider.score(batch, answer_mask, target_rows) -> (N,) float32

once per training micro-batch, with `answer_mask` `(B, T-1)` bool (shifted answer positions) and `target_rows` the
target's answer rows at those positions (`specdistill.losses.rows`: final hidden states and output layer, already
computed by the module, no grad), N = `answer_mask.sum()`:

- `OnlineReference(model, divergence, vocab_size)`: runs the frozen reference on the batch (no grad) and compares it
  with the target rows, so the target still runs once per batch.
- `CachedReferenceScores()`: reads the batch column `ref_divergence` `(B, T-1)` written from scores computed once
  by `cached_reference_scores` (see `specdistill.selection.scoring` for the storage format).

Both give the same values, so online and cached runs select the same tokens. The module also calls
`provider.place(trainer)` at fit/validation/test start (or `provider.to(device)` without a trainer).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import datasets
import torch
from torch import nn

from specdistill.losses.divergence import Divergence
from specdistill.losses.rows import answer_rows
from specdistill.models.frozen import Frozen
from specdistill.selection.scoring import score_reference
from specdistill.utils.distributed import is_sharded, rank_and_world_size

log = logging.getLogger(__name__)

CACHED_COLUMN = "ref_divergence"


class ReferenceScores:
    """Base of the providers: `score` per micro-batch, and device placement (nothing to place by default)."""

    def score(self, batch: Mapping[str, Any], answer_mask: torch.Tensor, target_rows: Any) -> torch.Tensor:
        """D(p, r) per answer token: `(B, T-1)` bool mask and the target's N answer rows -> `(N,)` float32."""
        raise NotImplementedError

    def place(self, trainer: Any) -> None:
        """Put whatever the provider runs on `trainer`'s devices (ZeRO-3 sharded under DeepSpeed stage 3)."""

    def to(self, device: torch.device | str) -> None:
        """Move whatever the provider runs to `device` (used outside a Trainer)."""


class OnlineReference(ReferenceScores):
    """Score with a frozen reference model on every batch.

    Args:
        model: HF-style causal LM `r` (`model(input_ids=, attention_mask=).logits` `(B, T, V')`, V' >= vocab_size),
            from the same tokenizer family as draft and target. Frozen, and held outside any `state_dict`,
            optimizer or checkpoint (`specdistill.models.frozen.Frozen`).
        divergence: the module's training divergence D; the gap needs the same one on both sides.
        vocab_size: the tokenizer's real vocabulary; logits are sliced `[..., :vocab_size]`.
    """

    def __init__(self, model: nn.Module, divergence: Divergence, vocab_size: int) -> None:
        model_vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if model_vocab is not None and model_vocab < vocab_size:
            raise ValueError(
                f"the reference model has vocab_size {model_vocab} but the target's tokenizer has {vocab_size} "
                "tokens: the reference must come from the same family as draft and target (same tokenizer); "
                "re-run the distill stage with this model pair"
            )
        self._frozen = Frozen(model)
        self.divergence = divergence
        self.vocab_size = vocab_size

    @property
    def model(self) -> nn.Module:
        return self._frozen.model

    def place(self, trainer: Any) -> None:
        self._frozen.place(trainer)

    def to(self, device: torch.device | str) -> None:
        self._frozen.to(device)

    def score(self, batch: Mapping[str, Any], answer_mask: torch.Tensor, target_rows: Any) -> torch.Tensor:
        """D(p, r) `(N,)`: one reference forward on `batch` (`input_ids`, `attention_mask` `(B, T)`), no grad,
        projected chunk by chunk like the training divergence."""
        with torch.no_grad():
            reference_rows = answer_rows(self.model, batch, answer_mask, self.vocab_size)
            return self.divergence.rows(target_rows, reference_rows)


class CachedReferenceScores(ReferenceScores):
    """Read D(p, r) from the batch column `ref_divergence` `(B, T-1)` float (0 off the answer positions)."""

    def score(self, batch: Mapping[str, Any], answer_mask: torch.Tensor, target_rows: Any) -> torch.Tensor:
        """The cached column at the answer positions: `(N,)` float32 on `answer_mask`'s device."""
        cached = batch.get(CACHED_COLUMN)
        if cached is None:
            raise ValueError(
                f"the batch has no '{CACHED_COLUMN}' column for CachedReferenceScores: attach the scores of "
                "cached_reference_scores to the train split (TaskDataModule.attach_column), or score online with "
                "OnlineReference(<frozen reference>, divergence, vocab_size)"
            )
        if cached.shape != answer_mask.shape:
            raise ValueError(
                f"cached {CACHED_COLUMN} has shape {tuple(cached.shape)} but the batch's shifted positions are "
                f"{tuple(answer_mask.shape)} (B, T-1); re-run the score stage on this tokenisation"
            )
        return cached.to(answer_mask.device, torch.float32)[answer_mask]


class ScoreOnceReference(CachedReferenceScores):
    """`CachedReferenceScores` that computes the cache itself, once, where the Trainer placed the models.

    At fit start (`place`) the reference is placed like the target (the strategy's device, or ZeRO-3 shards), the
    train split is scored by all ranks together (`cached_reference_scores`), the column is attached to the train
    split before its dataloader is built, and the reference is released; training then reads the column.

    Args:
        model: the frozen reference r.
        divergence: the training divergence D.  vocab_size: the tokenizer's real vocabulary.
        path: where the scores are saved (and reused from by a later run with the same inputs).
        datamodule: the `TaskDataModule` whose train split is scored and receives the column.
        target: the frozen target, when the module trains without one (a cached target distribution): placed here
            like the reference and released after scoring; its `Frozen` holder when the target cache holds the same
            one, so that it is placed once. None: the module's own target.
    """

    def __init__(
        self,
        model: nn.Module,
        divergence: Divergence,
        vocab_size: int,
        path: Path,
        datamodule: Any,
        target: nn.Module | Frozen | None = None,
    ) -> None:
        self._frozen: Frozen | None = Frozen(model)
        self._target: Frozen | None = Frozen(target) if isinstance(target, nn.Module) else target
        self.divergence = divergence
        self.vocab_size = vocab_size
        self.path = Path(path)
        self.datamodule = datamodule

    def place(self, trainer: Any) -> None:
        if self._frozen is None:  # scored already
            return
        reference = self._frozen.place(trainer).model
        if self._target is not None:
            target = self._target.place(trainer).model
        else:
            target = trainer.lightning_module.target  # placed by the module just before its reference
        rows = cached_reference_scores(
            self.path, target, reference, self.datamodule, self.divergence, self.vocab_size
        )
        self.datamodule.attach_column("train", CACHED_COLUMN, rows)
        self._frozen = self._target = None

    def to(self, device: torch.device | str) -> None:
        if self._frozen is not None:
            raise ValueError(
                "ScoreOnceReference scores at fit start under a Trainer; without one use OnlineReference"
            )


def cached_reference_scores(
    path: Path,
    target: nn.Module,
    reference: nn.Module,
    datamodule: Any,
    divergence: Divergence,
    vocab_size: int,
) -> list[list[float]]:
    """Per train example, D(target, reference) at each shifted position; computed once and saved under `path`.

    Args:
        path: directory of the saved copy (a `datasets` dataset with columns `example_id`, `ref_divergence`, plus
            `specdistill_scores.json`).
        target, reference: the frozen models, already on the device the scoring batches should use.
        datamodule: a `TaskDataModule`; its `tokenized("train")` split is scored through `scoring_dataloader`.
        divergence: the training divergence D (the gap is D(p, q) - D(p, r)).
        vocab_size: the tokenizer's real vocabulary.

    Returns:
        One row per train example in `example_id` order, `len(input_ids) - 1` floats each (0.0 off the answer
        positions), ready for `datamodule.attach_column("train", "ref_divergence", rows)`.

    The saved copy records the tokenised inputs' fingerprint, the divergence, the vocabulary size and the reference's
    name, so a changed dataset, tokenizer, max_length, divergence or reference is recomputed rather than reused.
    """
    path = Path(path)
    train = datamodule.tokenized("train")
    key = {
        "fingerprint": train._fingerprint,
        "divergence": repr(divergence),
        "vocab_size": int(vocab_size),
        "reference": str(getattr(getattr(reference, "config", None), "_name_or_path", "")),
    }
    meta = path / "specdistill_scores.json"
    if meta.is_file() and json.loads(meta.read_text()) == key:
        log.info("reusing cached reference scores from %s", path)
        return datasets.load_from_disk(str(path)).data.column(CACHED_COLUMN).to_pylist()
    rank, world_size = rank_and_world_size()
    log.info("scoring %d train examples with the reference (once, %d rank(s))", len(train), world_size)
    loader = datamodule.scoring_dataloader("train")
    sharded = is_sharded(loader)  # a datamodule attached to a multi-device Trainer gives each rank its share
    scores = score_reference(
        target, reference, loader, divergence, vocab_size,
        rank=0 if sharded else rank, world_size=1 if sharded else world_size, progress=True,
    )  # fmt: skip
    if world_size > 1:
        scores = _merge_across_ranks(path, scores, rank, world_size)
    if rank == 0:
        missing = [i for i in range(len(train)) if i not in scores]
        if missing:
            raise RuntimeError(
                f"reference scoring left {len(missing)} train examples unscored, e.g. {missing[:5]}"
            )
        rows = [scores[i] for i in range(len(train))]
        columns = {"example_id": list(range(len(rows))), CACHED_COLUMN: rows}
        datasets.Dataset.from_dict(columns).save_to_disk(str(path))
        meta.write_text(json.dumps(key))
    if world_size > 1:
        torch.distributed.barrier()  # rank 0 has written the one set of scores
    return datasets.load_from_disk(str(path)).data.column(CACHED_COLUMN).to_pylist()


def _merge_across_ranks(
    path: Path, scores: dict[int, list[float]], rank: int, world_size: int
) -> dict[int, list[float]]:
    """Each rank writes its shard beside `path`; rank 0 reads them all (examples scored twice keep one copy).

    Returns the merged scores on rank 0 and this rank's own elsewhere. Files, not collectives, carry the rows: a
    shard of a large train split would not fit a gather of Python objects comfortably.
    """
    shards = path.with_name(path.name + "_shards")
    shards.mkdir(parents=True, exist_ok=True)
    (shards / f"rank{rank}.json").write_text(json.dumps({str(k): v for k, v in scores.items()}))
    torch.distributed.barrier()
    if rank != 0:
        return scores
    merged: dict[int, list[float]] = {}
    for other in range(world_size):
        for key, row in json.loads((shards / f"rank{other}.json").read_text()).items():
            merged.setdefault(int(key), row)
    shutil.rmtree(shards)
    return merged

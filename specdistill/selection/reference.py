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

Both give the same values, so online and cached runs select the same tokens.

A draft kind that trains on several rows per answer token (EAGLE-3's unrolled steps, `DraftKind.one_row_per_token`
False) is scored row by row instead: `KindReference(model, kind, divergence, vocab_size)` is a frozen reference of
the same kind, and `provider.score_rows(batch, answer_mask, target_pass, rows) -> (M,)` gives D(p, r) on each of
the draft's `M` training rows (`per_row` True). The module also calls
`provider.place(trainer)` at fit/validation/test start (or `provider.to(device)` without a trainer), after
`specdistill.caches.prepare_caches` has built a `ScoreOnceReference`'s scores.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import datasets
import torch
from torch import nn

from specdistill.caches.fit_start import FitStart, FitStartCache
from specdistill.caches.store import SharedPass, build_or_reuse
from specdistill.losses.divergence import Divergence
from specdistill.losses.rows import answer_rows
from specdistill.models.frozen import Frozen, digest_of, placed
from specdistill.selection.scoring import score_reference
from specdistill.utils.distributed import is_sharded

log = logging.getLogger(__name__)

CACHED_COLUMN = "ref_divergence"
KEY_FILE = "specdistill_scores.json"


class ReferenceScores:
    """Base of the providers: `score` per micro-batch, and device placement (nothing to place by default).

    `per_row` False: the provider scores answer tokens (`score`); True: the draft kind's training rows
    (`score_rows`). `follows_draft` True: the provider is built from the draft being trained and follows it
    (`before_optimizer_step`), and its state travels in the checkpoint (`state_dict`, `load_state_dict`)."""

    per_row = False
    follows_draft = False

    def score(self, batch: Mapping[str, Any], answer_mask: torch.Tensor, target_rows: Any) -> torch.Tensor:
        """D(p, r) per answer token: `(B, T-1)` bool mask and the target's N answer rows -> `(N,)` float32."""
        raise NotImplementedError

    def score_rows(
        self, batch: Mapping[str, Any], answer_mask: torch.Tensor, target: Any, rows: Any
    ) -> torch.Tensor:
        """D(p, r) per training row (`per_row` providers): the batch, its `(B, T-1)` answer mask, the target pass
        (`specdistill.drafts.TargetPass`) and the draft's `TrainingRows` -> `(M,)` float32."""
        raise NotImplementedError(
            f"{type(self).__name__} scores answer tokens, not a draft kind's training rows"
        )

    def scores_step(self, step: int) -> bool:
        """Whether the provider may score optimizer step `step` (a self-reference waits until it is old enough)."""
        return True

    def place(self, trainer: Any) -> None:
        """Put whatever the provider runs on `trainer`'s devices (ZeRO-3 sharded under DeepSpeed stage 3)."""

    def to(self, device: torch.device | str) -> None:
        """Move whatever the provider runs to `device` (used outside a Trainer)."""

    def before_optimizer_step(self, draft: nn.Module, step: int) -> None:
        """Follow `draft` before optimizer step `step` (`follows_draft` providers; nothing by default)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the provider (`follows_draft` providers; nothing by default)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned (`follows_draft` providers; nothing by default)."""


class _FrozenReference(ReferenceScores):
    """A provider that runs a frozen reference model (`model`), held outside every state dict and placed like the
    target."""

    def __init__(self, model: nn.Module) -> None:
        self._frozen = Frozen(model)

    @property
    def model(self) -> nn.Module:
        return self._frozen.model

    def place(self, trainer: Any) -> None:
        self._frozen.place(trainer)

    def to(self, device: torch.device | str) -> None:
        self._frozen.to(device)


class OnlineReference(_FrozenReference):
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
        super().__init__(model)
        self.divergence = divergence
        self.vocab_size = vocab_size

    def score(self, batch: Mapping[str, Any], answer_mask: torch.Tensor, target_rows: Any) -> torch.Tensor:
        """D(p, r) `(N,)`: one reference forward on `batch` (`input_ids`, `attention_mask` `(B, T)`), no grad,
        projected chunk by chunk like the training divergence."""
        with torch.no_grad():
            reference_rows = answer_rows(self.model, batch, answer_mask, self.vocab_size)
            return self.divergence.rows(target_rows, reference_rows)


class KindReference(_FrozenReference):
    """Score with a frozen reference draft of the trained draft's own kind, on the draft's own training rows.

    For a kind with several rows per answer token (EAGLE-3: step `j` of the unroll scores answer token `s` from a
    chain of `j` of the head's own steps), the reference is unrolled the same way on the same target pass, so its
    row `i` is the draft's row `i` (same answer token, same step): D(p, r) is then compared row by row, as AdaSPEC
    compares tokens. The reference runs once per micro-batch without gradients; the target is not run again.

    Args:
        model: the frozen reference draft (e.g. an EAGLE-3 head trained on all tokens, the distill stage's export).
        kind: the draft kind of both draft and reference (its `training_rows` makes the rows).
        divergence: the module's training divergence D.
        vocab_size: the tokenizer's real vocabulary.
    """

    per_row = True

    def __init__(self, model: nn.Module, kind: Any, divergence: Divergence, vocab_size: int) -> None:
        super().__init__(model)
        self.kind = kind
        self.divergence = divergence
        self.vocab_size = vocab_size

    def score_rows(
        self, batch: Mapping[str, Any], answer_mask: torch.Tensor, target: Any, rows: Any
    ) -> torch.Tensor:
        """D(p, r) `(M,)` on the rows of `rows` (the draft's `TrainingRows` of this batch)."""
        with torch.no_grad():
            reference = self.kind.training_rows(self.model, batch, answer_mask, target, self.vocab_size)
            if not _same_rows(reference.answer_index, rows.answer_index):
                raise ValueError(
                    "the reference's training rows are not the draft's (a different draft vocabulary or unroll): "
                    "train the reference with the draft's draft settings"
                )
            return self.divergence.rows(reference.target, reference.draft)


def _same_rows(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(torch.equal(a, b.to(a.device)))


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


class ScoreOnceReference(CachedReferenceScores, FitStartCache):
    """`CachedReferenceScores` that computes the cache itself, once, where the Trainer placed the models.

    At fit start (`specdistill.caches.prepare_caches`, called by `DistillModule` before it places its own models)
    the scores at `path` are reused if their key matches (the target's and the reference's weights, the divergence,
    the data); else the reference and the target are placed like any frozen model (the strategy's device, or ZeRO-3
    shards) and the train split is scored by all ranks together (`build_or_reuse`). The column is attached to the
    train split before its dataloader is built, and the models are released; training then reads the column.

    Args:
        model: the frozen reference r.
        divergence: the training divergence D.  vocab_size: the tokenizer's real vocabulary.
        path: where the scores are saved (and reused from by a later run with the same inputs).
        datamodule: the `TaskDataModule` whose train split is scored and receives the column.
        target: the frozen target, when the module trains without one (a cached target distribution): placed here
            like the reference and released after scoring; its `Frozen` holder when the target cache holds the same
            one, so that it is placed once. None: the module's own target (`FitStart.target`).
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
        self._frozen.weights_digest()  # before a ZeRO-3 placement partitions the weights
        self._target: Frozen | None = Frozen(target) if isinstance(target, nn.Module) else target
        self.divergence = divergence
        self.vocab_size = vocab_size
        self.path = Path(path)
        self.datamodule = datamodule

    @property
    def ready(self) -> bool:
        return self._frozen is None

    def prepare(self, fit_start: FitStart) -> None:
        target = self._target if self._target is not None else fit_start.target
        if target is None:
            raise ValueError(
                "ScoreOnceReference has no target to score against: the module trains from a cached target, so "
                "pass the target model (or its Frozen holder) as ScoreOnceReference(..., target=)"
            )
        scores = _ReferencePass(
            self.path,
            target,
            self._frozen,
            fit_start.trainer,
            self.datamodule,
            self.divergence,
            self.vocab_size,
        )
        _, tables = build_or_reuse(scores)
        self.datamodule.attach_column("train", CACHED_COLUMN, _rows(tables))
        self._frozen = self._target = None

    def to(self, device: torch.device | str) -> None:
        if self._frozen is not None:
            raise ValueError(
                "ScoreOnceReference scores at fit start under a Trainer; without one use OnlineReference"
            )


class _ReferencePass(SharedPass):
    """The reference scores as a `SharedPass`: one table, `train`, with D(target, reference) per shifted position.

    `target` and `reference` are models, or `Frozen` holders placed on `trainer`'s devices only when the pass runs."""

    key_file = KEY_FILE

    def __init__(
        self,
        path: Path,
        target: nn.Module | Frozen,
        reference: nn.Module | Frozen,
        trainer: Any,
        datamodule: Any,
        divergence: Divergence,
        vocab_size: int,
    ) -> None:
        self.path, self.target, self.reference, self.trainer = Path(path), target, reference, trainer
        self.datamodule, self.divergence, self.vocab_size = datamodule, divergence, vocab_size

    def key(self) -> dict[str, Any]:
        return {
            "fingerprint": self.datamodule.tokenized("train")._fingerprint,
            "divergence": repr(self.divergence),
            "vocab_size": int(self.vocab_size),
            "target": digest_of(self.target),
            "reference": digest_of(self.reference),
        }

    def sizes(self) -> dict[str, int]:
        return {"train": len(self.datamodule.tokenized("train"))}

    def compute(self, name: str, rank: int, world_size: int) -> datasets.Dataset:
        reference, target = placed(self.reference, self.trainer), placed(self.target, self.trainer)
        log.info(
            "scoring %d train examples with the reference (once, %d rank(s))", self.sizes()[name], world_size
        )
        loader = self.datamodule.scoring_dataloader(name)
        sharded = is_sharded(
            loader
        )  # a datamodule attached to a multi-device Trainer gives each rank its share
        scores = score_reference(
            target, reference, loader, self.divergence, self.vocab_size,
            rank=0 if sharded else rank, world_size=1 if sharded else world_size, progress=True,
        )  # fmt: skip
        ids = sorted(scores)
        columns = {"example_id": ids, CACHED_COLUMN: [scores[i] for i in ids]}
        return datasets.Dataset.from_dict(columns, features=_FEATURES)


# float64 holds the float32 scores exactly; explicit, so that a part whose rows are all empty has the same type
_FEATURES = datasets.Features(
    {"example_id": datasets.Value("int64"), CACHED_COLUMN: datasets.Sequence(datasets.Value("float64"))}
)


def _rows(tables: dict[str, datasets.Dataset]) -> list[list[float]]:
    return tables["train"].data.column(CACHED_COLUMN).to_pylist()


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
        path: directory of the saved copy (`train/`, a `datasets` dataset with columns `example_id` and
            `ref_divergence`, and the key `specdistill_scores.json`).
        target, reference: the frozen models, already on the device the scoring batches should use.
        datamodule: a `TaskDataModule`; its `tokenized("train")` split is scored through `scoring_dataloader`.
        divergence: the training divergence D (the gap is D(p, q) - D(p, r)).
        vocab_size: the tokenizer's real vocabulary.

    Returns:
        One row per train example in `example_id` order, `len(input_ids) - 1` floats each (0.0 off the answer
        positions), ready for `datamodule.attach_column("train", "ref_divergence", rows)`.

    The key records the tokenised inputs' fingerprint, the divergence, the vocabulary size and the digests of every
    weight of the target and of the reference (`specdistill.caches.weights_digest`), so a changed dataset,
    tokenizer, max_length, divergence, target or reference (even one retrained into the same directory) is
    recomputed rather than reused. With a process group running, the ranks share the pass and rank 0 merges
    (`specdistill.caches.build_or_reuse`).
    """
    scores = _ReferencePass(path, target, reference, None, datamodule, divergence, vocab_size)
    _, tables = build_or_reuse(scores)
    return _rows(tables)

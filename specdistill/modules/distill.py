"""`DistillModule`: train a draft to match a frozen target on answer tokens (DistillSpec / AdaSPEC stages).

Wiring only: the maths lives in `specdistill.losses` (divergences, reductions), token selection in
`specdistill.selection` (a pure `selector` and an optional `reference` provider, both given to the constructor);
see docs/METHODS.md sections 2 and 3.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from lightning import LightningModule
from torch import nn

from specdistill.caches import FitStart, prepare_caches
from specdistill.data.target_cache import CachedTarget
from specdistill.data.target_source import source_of
from specdistill.drafts.base import DraftKind, TargetPass, TrainingRows, target_pass
from specdistill.drafts.standalone.kind import Standalone
from specdistill.losses.answers import answer_mask
from specdistill.losses.chunked import rowwise
from specdistill.losses.divergence import Divergence, expected_acceptance, forward_kl
from specdistill.losses.fused import fused_divergence_sum
from specdistill.losses.reduction import reduce_tokens, window_normaliser
from specdistill.models.frozen import Frozen
from specdistill.modules.optimization import configure_optimization
from specdistill.selection.base import SelectionRecord, Selector
from specdistill.selection.reference import ReferenceScores

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[..., Any]


class DistillModule(LightningModule):
    """Distil a frozen target into a trainable draft with a per-token divergence on answer tokens.

    The training loss of a micro-batch is `sum of the kept D(p, q) / window_normaliser(batch, world_size)` times the
    Trainer's `accumulate_grad_batches` (Lightning divides each micro-batch loss by it, while the sum is already
    normalised by the whole window's answer tokens); outside a Trainer the accumulation and world size are 1.

    Args:
        draft: trainable causal LM (HF-style: `model(input_ids=, attention_mask=).logits`).
        target: frozen causal LM; kept out of `state_dict()` and placed on the trainer's devices at fit/eval start.
            Or a `CachedTarget` (`specdistill.data.target_cache`): the target's cached top-m distributions, read per
            batch by `example_id`, so no target model is loaded.
        vocab_size: the tokenizer's real vocabulary; logits are sliced `[..., :vocab_size]`.
        divergence: per-token divergence object, e.g. `ForwardKL()` (see `conf/divergence/`).
        optimizer: factory called with the draft's trainable parameters (Hydra `_partial_: true`).
        scheduler: factory called as `scheduler(optimizer, total_steps=...)` (see `specdistill.utils.schedules`),
            stepped every optimizer step; None for a constant rate.
        selector: chooses the answer tokens that train the draft (`specdistill.selection.selectors`, e.g.
            `AdaSpecSelector(k=0.4)`); None keeps every answer token.
        reference: where D(p, r) comes from (`specdistill.selection.reference`: `OnlineReference` or
            `CachedReferenceScores`); required when the selector `needs_reference`, never run otherwise.
        kind: the draft's kind (`specdistill.drafts`), which gives the draft's rows from the batch and the target
            pass; default `Standalone()`, a causal LM's own answer rows.
        target_states: the target's states cached at fit start (`specdistill.data.target_states`), for a kind that
            reads them: every target pass is read from it and the target's body never runs (the target model stays
            placed: its output layer scores the rows, and an EAGLE-3 head reads its embeddings).

    After each training step `last_selection` holds that micro-batch's `SelectionRecord` (for `SelectionReport`).
    """

    def __init__(
        self,
        draft: nn.Module,
        target: nn.Module | CachedTarget,
        vocab_size: int,
        divergence: Divergence,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        selector: Selector | None = None,
        reference: ReferenceScores | None = None,
        kind: DraftKind | None = None,
        target_states: Any = None,
    ) -> None:
        super().__init__()
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive (len(tokenizer)), got {vocab_size}")
        _check_reference(selector, reference, divergence, vocab_size)
        self.save_hyperparameters(
            ignore=[
                "draft",
                "target",
                "divergence",
                "optimizer",
                "scheduler",
                "selector",
                "reference",
                "kind",
                "target_states",
            ]
        )
        self.draft = draft
        self.cached_target = target if isinstance(target, CachedTarget) else None
        if self.cached_target is not None and self.cached_target.vocab_size != vocab_size:
            raise ValueError(
                f"the cached target distributions have vocab_size {self.cached_target.vocab_size} but the module "
                f"{vocab_size}: build the cache with this tokenizer"
            )
        if self.cached_target is not None and divergence.kernel != "torch":
            raise ValueError(
                f"divergence.kernel={divergence.kernel} projects the target's hidden states itself, so it cannot "
                "train from cached target distributions: set target_cache=null or use divergence.kernel=torch"
            )
        self.kind = kind if kind is not None else Standalone()
        _check_reference_rows(selector, reference, self.kind)
        if target_states is not None and self.cached_target is not None:
            raise ValueError(
                "target_states (the target's cached hidden states) and cached target distributions are two target "
                "caches: give target_states with the target model"
            )
        source_of(target, target_states).check_kind(self.kind)
        self.target_states = target_states
        if self.cached_target is not None:
            self._target = None
        else:  # with cached states, the cache's holder: the target is placed once, its digest taken once
            self._target = target_states.frozen if target_states is not None else Frozen(target)
        self.vocab_size = vocab_size
        self.divergence = divergence
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.selector = selector
        self.reference = reference
        self.last_selection: SelectionRecord | None = None

    @property
    def target(self) -> nn.Module:
        if self._target is None:
            raise RuntimeError(
                "this DistillModule trains from cached target distributions: it has no target model"
            )
        return self._target.model

    @property
    def uses_reference(self) -> bool:
        """True when the selector reads reference divergences (the reference then runs or is read every step)."""
        return self.selector is not None and bool(self.selector.needs_reference)

    # -- device placement of the frozen models (Lightning only moves registered submodules) --

    def _place_frozen(self) -> None:
        reference = self.reference if self.uses_reference else None
        if self._trainer is not None:
            # the fit-start caches (CacheOnceTarget, ScoreOnceReference) are keyed before any model is placed, then
            # built by the ranks together or reused
            prepare_caches(
                FitStart(self.trainer, self._target), (self.cached_target, self.target_states, reference)
            )
            if self._target is not None:
                self._target.place(self.trainer)
            if reference is not None:
                reference.place(self.trainer)
        else:
            if self._target is not None:
                self._target.to(self.device)
            if reference is not None:
                reference.to(self.device)

    def on_fit_start(self) -> None:
        self._place_frozen()

    def on_validation_start(self) -> None:
        self._place_frozen()

    def on_test_start(self) -> None:
        self._place_frozen()

    # -- a reference that follows the draft (`specdistill.selection.self_reference`) --

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Let a self-reference follow the draft with the weights this step started from."""
        if self.uses_reference and self.reference.follows_draft:
            self.reference.before_optimizer_step(self.draft, self.trainer.global_step)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.uses_reference and self.reference.follows_draft:
            checkpoint["self_reference"] = self.reference.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.uses_reference and self.reference.follows_draft:
            if "self_reference" not in checkpoint:
                raise ValueError(
                    "this run's selector scores with a self-reference, but the checkpoint holds none: it was written "
                    "by a run with another selector; resume with that selector or start a new run folder"
                )
            self.reference.load_state_dict(checkpoint["self_reference"])

    # -- steps --

    def _window(self) -> tuple[int, int]:
        """`(world_size, accumulate_grad_batches)` of the attached Trainer; `(1, 1)` without one."""
        if self._trainer is None:
            return 1, 1
        return self._trainer.world_size, self._trainer.accumulate_grad_batches

    def _answer_rows(
        self, batch: Mapping[str, Any], split: str
    ) -> tuple[torch.Tensor, TargetPass, TrainingRows]:
        """Return `(answer_mask (B, T-1), target pass, training rows)`: the target's and the draft's rows, final hidden states
        `(M, H)` and each model's output layer, never full logits (`specdistill.losses.rows`); the target runs once,
        no grad (or its cached top-m rows of `split` are read), and the draft kind turns the batch and that target
        pass into the rows (`DraftKind.training_rows`: one per answer token, or more with weights). The divergence
        projects `chunk_size` rows at a time."""
        keep = answer_mask(batch["labels"])
        if self.cached_target is not None:
            target = TargetPass(self.cached_target.rows(batch, keep, split))
        elif self.target_states is not None:
            target = self.target_states.target_pass(batch, keep, split)
        else:
            with torch.no_grad():
                target = target_pass(self.target, batch, keep, self.vocab_size, self.kind.target_layers)
        return keep, target, self.kind.training_rows(self.draft, batch, keep, target, self.vocab_size)

    def _select(
        self,
        batch: Mapping[str, Any],
        answers: torch.Tensor,
        target: TargetPass,
        rows: TrainingRows,
        per_token: torch.Tensor,
        normaliser: torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Run the selector (and the reference it needs) on one micro-batch; record it in `last_selection`.

        Args:
            answers: `(B, T-1)` bool answer mask; target: the target pass; rows: the training rows, whose
            `answer_index` `(M,)` names the answer token of each row (None when the rows are the `N` answer tokens);
            per_token: `(M,)` D(p, q); normaliser: `()` the window normaliser.

        Returns:
            `(keep (M,) bool or None for every row, normaliser ())` for `reduce_tokens`.
        """
        answer_index = rows.answer_index
        draft_divergence = per_token.detach()
        token_ids = batch["labels"][:, 1:][answers]
        if answer_index is not None:
            token_ids = token_ids[answer_index]
        if self.selector is None:
            keep = torch.ones_like(draft_divergence, dtype=torch.bool)
            self.last_selection = SelectionRecord(keep, None, draft_divergence, None, token_ids)
            return None, normaliser
        sequences = torch.arange(answers.shape[0], device=answers.device)
        sequence_index = sequences[:, None].expand_as(answers)[answers]
        if answer_index is not None:
            sequence_index = sequence_index[answer_index]
        if self.uses_reference and not self.reference.scores_step(self.global_step):
            # a self-reference still as young as the draft: plain distillation until it is old enough
            keep = torch.ones_like(draft_divergence, dtype=torch.bool)
            self.last_selection = SelectionRecord(
                keep, None, draft_divergence, None, token_ids, sequence_index, answer_index
            )
            return None, normaliser
        reference_divergence = None
        if self.uses_reference and self.reference.per_row:
            reference_divergence = self.reference.score_rows(batch, answers, target, rows)
        elif self.uses_reference:
            reference_divergence = self.reference.score(batch, answers, target.rows)
        selection = self.selector.select(draft_divergence, reference_divergence, sequence_index, normaliser)
        self.last_selection = SelectionRecord(
            selection.keep, selection.scores, draft_divergence, reference_divergence, token_ids, sequence_index,
            answer_index,
        )  # fmt: skip
        return selection.keep, selection.normaliser

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        world_size, accumulate = self._window()
        normaliser = window_normaliser(batch, world_size)
        answers, target, rows = self._answer_rows(batch, "train")
        target_rows, draft_rows = rows.target, rows.draft
        fused = (
            self.divergence.kernel != "torch"
        )  # the kernel gives the loss; `rows` the values to select from
        if fused and rows.weight is not None:
            raise ValueError(
                f"divergence.kernel={self.divergence.kernel} sums unweighted rows, but the draft kind "
                f"{type(self.kind).__name__} weighs its rows: use divergence.kernel=torch"
            )
        with torch.no_grad() if fused else contextlib.nullcontext():
            per_token = self.divergence.rows(target_rows, draft_rows)
        keep, normaliser = self._select(
            batch, answers, target, rows, per_token, normaliser.to(per_token.device)
        )
        if rows.weight is not None:
            per_token = per_token * rows.weight.to(per_token)
        if fused:
            total = fused_divergence_sum(self.divergence, target_rows, draft_rows, keep)
            loss = total / torch.where(normaliser > 0, normaliser, 1).to(total) * accumulate
        else:
            loss = reduce_tokens(per_token, keep, normaliser) * accumulate
        # Logged value is this micro-batch's share of the window loss, as Lightning will scale it.
        self.log("train/loss", loss / accumulate, on_step=True, prog_bar=True)
        return loss

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        answers, _, rows = self._answer_rows(batch, "validation")
        num_tokens = int(answers.sum())
        if num_tokens == 0:
            return
        loss, kl, acceptance = rowwise(
            [self.divergence.per_token, forward_kl, expected_acceptance],
            rows.target,
            rows.draft,
            self.divergence.chunk_size,
            self.divergence.chunk_budget_mb,
        )
        # batch_size = answer tokens, so the epoch value is the mean per answer token, not per batch.
        log = functools.partial(self.log, batch_size=num_tokens, sync_dist=True, on_epoch=True, on_step=False)
        if rows.weight is None:
            log("val/loss", loss.mean())
            log("val/kl", kl.mean())
            log("val/expected_acceptance", acceptance.mean(), prog_bar=True)
            return
        # weighted rows: the loss as training sums it (per answer token), the metrics as weighted row means
        weight = rows.weight.to(loss)
        total = weight.sum().clamp_min(torch.finfo(weight.dtype).tiny)
        log("val/loss", (weight * loss).sum() / num_tokens)
        log("val/kl", (weight * kl).sum() / total)
        log("val/expected_acceptance", (weight * acceptance).sum() / total, prog_bar=True)

    def configure_optimizers(self) -> Any:
        return configure_optimization(self, self.draft, self.optimizer_factory, self.scheduler_factory)


def _check_reference(
    selector: Selector | None, reference: ReferenceScores | None, divergence: Divergence, vocab_size: int
) -> None:
    """Refuse a selector that needs a reference without one, and a reference scored differently from training."""
    if selector is None or not selector.needs_reference:
        return
    if reference is None:
        raise ValueError(
            f"{type(selector).__name__} needs the reference divergence D(p, r) but DistillModule got reference=None: "
            "pass reference=OnlineReference(<frozen reference>, divergence, vocab_size), or CachedReferenceScores() "
            "with batches carrying the cached 'ref_divergence' column (specdistill.selection.reference)"
        )
    reference_divergence = getattr(reference, "divergence", None)
    if reference_divergence is not None and not _same_divergence(reference_divergence, divergence):
        raise ValueError(
            f"the reference is scored with {reference_divergence!r} but training uses {divergence!r}; "
            "the gap D(p, q) - D(p, r) needs the same divergence on both sides"
        )
    reference_vocab = getattr(reference, "vocab_size", None)
    if reference_vocab is not None and reference_vocab != vocab_size:
        raise ValueError(f"the reference uses vocab_size {reference_vocab} but the module {vocab_size}")


def _check_reference_rows(
    selector: Selector | None, reference: ReferenceScores | None, kind: DraftKind
) -> None:
    """Refuse a reference that scores answer tokens for a kind that trains on several rows per token, and the
    reverse: the selector compares D(p, q) and D(p, r) row by row."""
    if selector is None or not selector.needs_reference or reference is None:
        return
    if reference.per_row == (not kind.one_row_per_token):
        return
    several = not kind.one_row_per_token
    raise ValueError(
        f"{type(selector).__name__} compares the draft's and the reference's divergence row by row; the draft kind "
        f"{type(kind).__name__} trains on {'several rows' if several else 'one row'} per answer token, which "
        f"{type(reference).__name__} does not score: use "
        + ("KindReference(<a reference draft of the same kind>, kind, divergence, vocab_size)" if several
           else "OnlineReference or CachedReferenceScores")
    )  # fmt: skip


def _same_divergence(a: Divergence, b: Divergence) -> bool:
    """Equal up to `chunk_size` and `kernel`, which change speed and memory use, not values."""
    if isinstance(a, Divergence) and isinstance(b, Divergence):
        same = {"chunk_size": None, "kernel": "torch"}
        return dataclasses.replace(a, **same) == dataclasses.replace(b, **same)
    return a == b

"""`AcceptanceHeadModule`: train the SpecDec++ acceptance head on rollouts, with the draft frozen.

Wiring only: batches come from `specdistill.head_data.RolloutDataModule` (mixed or plain sequences, or cached head
inputs), the head inputs from `specdistill.head_data.judged_head_inputs`, the loss and metrics from
`specdistill.losses.head_bce`. The head predicts each judged draft token's soft acceptance label
(`batch["loss_mask"]`: for a candidate head the states whose input is a draft token, for a proposer head the states
that proposed one). A hidden-state cache built at fit start (`specdistill.head_data.HiddenCache`) is prepared by
`specdistill.caches.prepare_caches`, as `DistillModule` prepares its caches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning import LightningModule
from torch import nn

from specdistill.caches import FitStart, prepare_caches
from specdistill.decoding.sampling import SamplingConfig
from specdistill.drafts.base import DraftKind
from specdistill.head_data.hidden_cache import HiddenCache
from specdistill.head_data.inputs import judged_head_inputs
from specdistill.losses.head_bce import (
    auroc_rejection,
    binary_kl,
    expected_calibration_error,
    weighted_bce_with_logits,
    write_reliability_diagram,
)
from specdistill.models.acceptance_head import AcceptanceHead
from specdistill.models.frozen import Frozen
from specdistill.modules.optimization import configure_optimization

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[..., Any]
RELIABILITY_DIAGRAM = "reliability_diagram.png"


class AcceptanceHeadModule(LightningModule):
    """Trains `head` with the weighted soft-label BCE; the draft stays frozen and out of checkpoints.

    Args:
        head: the trainable `AcceptanceHead` (its `hidden_size` must equal the draft's).
        draft: frozen causal LM whose hidden states feed the head; may be None with `cache_hidden_states`.
        optimizer: factory called with the head's parameters (Hydra `_partial_: true`).
        scheduler: factory called as `scheduler(optimizer, total_steps=...)` (`specdistill.utils.schedules.cosine`
            gives SpecDec++'s cosine with 3% warmup), stepped every optimizer step; None for a constant rate.
        w_acc: weight of the acceptance term of the loss.
        w_rej: weight of the rejection term (SpecDec++: 6).
        cache_hidden_states: read `batch["hidden_states"]` (a hidden-state cache) instead of running the draft.
        reliability_bins: bins of the ECE and of the reliability diagram.
        sampling: the decoding settings the rollouts were labelled for; a proposer head's features read the draft's
            distribution as the engine's policies will see it (default: greedy).
        hidden_cache: a `HiddenCache` (with `cache_hidden_states=True`) built at fit or validation start, before
            the datamodule reads its rows (give the `RolloutDataModule` the same object); None when the cache is
            built already (`hidden_cache_dir`) or not used.
        draft_kind: the draft's kind, whose teacher-forced pass gives the head inputs (default `DraftKind()`, a
            causal LM).
        target: the frozen target, for a kind that reads its hidden states (`DraftKind.reads_target`: an EAGLE-3
            head) when the draft runs every step; kept out of checkpoints like the draft.

    Validation logs `val/head_bce` (the weighted loss over the whole split), `val/binary_kl`, `val/auroc_rejection`
    and `val/ece`, and writes `reliability_diagram.png` into the trainer's log directory.
    The loss is normalised per micro-batch (by its summed weights), so gradient accumulation averages micro-batches.
    """

    def __init__(
        self,
        head: AcceptanceHead,
        draft: nn.Module | None,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        w_acc: float = 1.0,
        w_rej: float = 6.0,
        cache_hidden_states: bool = False,
        reliability_bins: int = 10,
        sampling: SamplingConfig | None = None,
        hidden_cache: HiddenCache | None = None,
        draft_kind: DraftKind | None = None,
        target: nn.Module | None = None,
    ) -> None:
        super().__init__()
        draft_kind = draft_kind or DraftKind()
        if draft is not None and draft_kind.reads_target and target is None:
            raise ValueError(
                "this draft reads the target's hidden states (an EAGLE-3 head): give AcceptanceHeadModule the "
                "target (target=...)"
            )
        if draft is None and not cache_hidden_states:
            raise ValueError("AcceptanceHeadModule needs the draft unless cache_hidden_states=True.")
        if hidden_cache is not None and not cache_hidden_states:
            raise ValueError(
                "AcceptanceHeadModule got a hidden_cache but cache_hidden_states=False: set it to True to train "
                "on the cache, or leave hidden_cache out to run the draft every step."
            )
        if draft is not None and int(draft.config.hidden_size) != head.hidden_size:
            raise ValueError(
                f"head.hidden_size={head.hidden_size} but the draft's hidden_size is {draft.config.hidden_size}: "
                "build the head with the draft's config.hidden_size."
            )
        if not (w_acc > 0 and w_rej > 0):
            raise ValueError(f"w_acc={w_acc} and w_rej={w_rej} must both be positive.")
        self.save_hyperparameters(
            ignore=[
                "head",
                "draft",
                "optimizer",
                "scheduler",
                "sampling",
                "hidden_cache",
                "draft_kind",
                "target",
            ]
        )
        self.head = head
        self._draft = Frozen(draft) if draft is not None else None
        self.draft_kind = draft_kind
        self._target = Frozen(target) if draft is not None and draft_kind.reads_target else None
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.w_acc = w_acc
        self.w_rej = w_rej
        self.cache_hidden_states = cache_hidden_states
        self.hidden_cache = hidden_cache
        self.reliability_bins = reliability_bins
        self._said_auroc_undefined = False
        self.sampling = sampling or SamplingConfig(greedy=True)
        self._val_logits: list[torch.Tensor] = []
        self._val_labels: list[torch.Tensor] = []

    @property
    def draft(self) -> nn.Module | None:
        return None if self._draft is None else self._draft.model

    # -- device placement of the frozen draft (Lightning only moves registered submodules) --

    def _place_frozen(self) -> None:
        if self._trainer is None:
            for frozen in (self._draft, self._target):
                if frozen is not None:
                    frozen.to(self.device)
            return
        # the fit-start cache (keyed already) is built by the ranks together, or reused, before any batch is read
        prepare_caches(FitStart(self.trainer), (self.hidden_cache,))
        for frozen in (self._draft, self._target):
            if frozen is not None:
                frozen.place(self.trainer)

    def on_fit_start(self) -> None:
        self._place_frozen()

    def on_validation_start(self) -> None:
        self._place_frozen()

    # -- steps --

    def head_logits(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """`(logits (N,), labels (N,))` at the batch's judged positions (`loss_mask`)."""
        keep = batch["loss_mask"]
        if self.cache_hidden_states:
            if "hidden_states" not in batch:
                raise ValueError(
                    "cache_hidden_states=True but the batch has no 'hidden_states': give the same "
                    "specdistill.head_data.HiddenCache to this module and to RolloutDataModule (hidden_cache=), or "
                    "pass a built cache (build_hidden_cache) as RolloutDataModule(hidden_cache_dir=)."
                )
            inputs = batch["hidden_states"][keep]
        else:
            if "input_ids" not in batch:
                raise ValueError(
                    "the batch holds cached hidden states but cache_hidden_states=False: set it to True (and the "
                    "draft may then be None)."
                )
            target = None if self._target is None else self._target.model
            inputs = judged_head_inputs(
                self.draft, batch, self.head.input, self.sampling, self.draft_kind, target
            )
        return self.head(inputs), batch["head_labels"][keep]

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits, labels = self.head_logits(batch)
        loss = weighted_bce_with_logits(logits, labels, self.w_acc, self.w_rej)
        self.log("train/head_bce", loss, on_step=True, prog_bar=True, batch_size=max(1, labels.numel()))
        return loss

    def on_validation_epoch_start(self) -> None:
        self._val_logits, self._val_labels = [], []

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> None:
        logits, labels = self.head_logits(batch)
        self._val_logits.append(logits.detach().float())
        self._val_labels.append(labels.detach().float())

    def on_validation_epoch_end(self) -> None:
        logits = _gather_ragged(
            torch.cat(self._val_logits) if self._val_logits else torch.zeros(0, device=self.device)
        )
        labels = _gather_ragged(
            torch.cat(self._val_labels) if self._val_labels else torch.zeros(0, device=self.device)
        )
        self._val_logits, self._val_labels = [], []
        if labels.numel() == 0:
            return
        # Every rank holds the whole split after the gather, so each logs the same value (no sync needed).
        self.log(
            "val/head_bce", weighted_bce_with_logits(logits, labels, self.w_acc, self.w_rej), prog_bar=True
        )
        self.log("val/binary_kl", binary_kl(logits, labels).mean())
        self.log("val/ece", expected_calibration_error(logits, labels, self.reliability_bins))
        rejected, accepted = float((1 - labels).sum()), float(labels.sum())
        if rejected > 0 and accepted > 0:
            self.log("val/auroc_rejection", auroc_rejection(logits, labels))
        elif not self._said_auroc_undefined:  # the same validation split every time: say it once
            self._said_auroc_undefined = True
            log.warning(
                "val/auroc_rejection not logged: the validation labels are all accepted or all rejected."
            )
        log_dir = self.trainer.log_dir  # called on every rank: it broadcasts
        if self.trainer.is_global_zero and not self.trainer.sanity_checking and log_dir is not None:
            write_reliability_diagram(
                logits.cpu(), labels.cpu(), Path(log_dir) / RELIABILITY_DIAGRAM, self.reliability_bins,
                title=f"acceptance head, epoch {self.current_epoch}, step {self.global_step}",
            )  # fmt: skip

    def configure_optimizers(self) -> Any:
        return configure_optimization(self, self.head, self.optimizer_factory, self.scheduler_factory)


def _gather_ragged(values: torch.Tensor) -> torch.Tensor:
    """Concatenate a 1-D tensor of rank-dependent length across processes (identity without distributed)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    size = torch.tensor([values.numel()], device=values.device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    parts = [torch.zeros_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([part[: int(s.item())] for part, s in zip(parts, sizes, strict=True)])

"""`DistillModule`: train a draft to match a frozen target on answer tokens (DistillSpec / AdaSPEC stages).

Wiring only: the maths lives in `specdistill.losses` (divergences, reductions) and token selection in
`specdistill.selection` (reached through the `token_selector` attribute, None = keep every answer token).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from lightning import LightningModule
from torch import nn

from specdistill.losses.answers import answer_logits, answer_mask
from specdistill.losses.divergence import Divergence, expected_acceptance, forward_kl
from specdistill.losses.reduction import reduce_tokens
from specdistill.models.frozen import Frozen
from specdistill.selection.base import SelectionInput, SupportsSelect

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[..., Any]


class DistillModule(LightningModule):
    """Distil a frozen target into a trainable draft with a per-token divergence on answer tokens.

    Args:
        draft: trainable causal LM (HF-style: `model(input_ids=, attention_mask=).logits`).
        target: frozen causal LM; kept out of `state_dict()` and moved to the module's device at fit/eval start.
        vocab_size: the tokenizer's real vocabulary; logits are sliced `[..., :vocab_size]`.
        divergence: per-token divergence object, e.g. `ForwardKL()` (see `conf/divergence/`).
        optimizer: factory called with the draft's trainable parameters (Hydra `_partial_: true`).
        scheduler: factory called as `scheduler(optimizer, total_steps=...)` (see `specdistill.utils.schedules`),
            stepped every optimizer step; None for a constant rate.
        accumulate_grad_batches: must equal the Trainer's. The loss is multiplied by it because Lightning divides
            each micro-batch loss by it, while our sum is already normalised by the whole window's answer tokens.
    """

    def __init__(
        self,
        draft: nn.Module,
        target: nn.Module,
        vocab_size: int,
        divergence: Divergence,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        accumulate_grad_batches: int = 1,
    ) -> None:
        super().__init__()
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive (len(tokenizer)), got {vocab_size}")
        if accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches must be >= 1, got {accumulate_grad_batches}")
        self.save_hyperparameters(ignore=["draft", "target", "divergence", "optimizer", "scheduler"])
        self.draft = draft
        self._target = Frozen(target)
        self.vocab_size = vocab_size
        self.divergence = divergence
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.accumulate_grad_batches = accumulate_grad_batches
        self.token_selector: SupportsSelect | None = None

    @property
    def target(self) -> nn.Module:
        return self._target.model

    # -- device placement of the frozen target (Lightning only moves registered submodules) --

    def _place_frozen(self) -> None:
        if self._trainer is not None:
            self._target.place(self.trainer)
        else:
            self._target.to(self.device)

    def on_fit_start(self) -> None:
        trainer_accumulation = self.trainer.accumulate_grad_batches
        if trainer_accumulation != self.accumulate_grad_batches:
            raise ValueError(
                f"DistillModule.accumulate_grad_batches={self.accumulate_grad_batches} but the Trainer accumulates "
                f"{trainer_accumulation}; set both from the same config value so the loss normalisation is right"
            )
        self._place_frozen()

    def on_validation_start(self) -> None:
        self._place_frozen()

    def on_test_start(self) -> None:
        self._place_frozen()

    # -- steps --

    def _answer_logits(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return `(answer_mask (B, T-1), target rows (N, V), draft rows (N, V))`; the target runs once, no grad."""
        keep = answer_mask(batch["labels"])
        with torch.no_grad():
            target_rows = answer_logits(self.target, batch, keep, self.vocab_size)
        draft_rows = answer_logits(self.draft, batch, keep, self.vocab_size)
        return keep, target_rows, draft_rows

    def loss_normaliser(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """What the per-token loss sum of a micro-batch is divided by (see ARCHITECTURE.md, batches).

        Data-parallel runs use `global_window_answer_tokens / world_size`: DDP averages the devices' gradients, so
        the update is then the sum over every device's answer tokens divided by their total, however unevenly the
        tokens fall on devices. On one device this is `window_answer_tokens`.
        """
        world_size = self._trainer.world_size if self._trainer is not None else 1
        if world_size > 1 and "global_window_answer_tokens" in batch:
            return torch.as_tensor(batch["global_window_answer_tokens"]).float() / world_size
        return torch.as_tensor(batch["window_answer_tokens"]).float()

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        if "window_answer_tokens" not in batch:
            raise ValueError(
                "batch has no 'window_answer_tokens' (answer tokens of the whole accumulation window); "
                "use specdistill's TaskDataModule or add the column to your collate function"
            )
        answers, target_rows, draft_rows = self._answer_logits(batch)
        per_token = self.divergence(target_rows, draft_rows)
        normaliser = self.loss_normaliser(batch).to(per_token.device)
        keep = None
        if self.token_selector is not None:
            rows = torch.arange(answers.shape[0], device=answers.device)
            selection = self.token_selector.select(
                SelectionInput(
                    target_logits=target_rows,
                    draft_logits=draft_rows.detach(),
                    draft_divergence=per_token.detach(),
                    divergence=self.divergence,
                    sequence_index=rows[:, None].expand_as(answers)[answers],
                    token_ids=batch["labels"][:, 1:][answers],
                    answer_mask=answers,
                    batch=batch,
                    normaliser=normaliser,
                )
            )
            keep, normaliser = selection.keep, selection.normaliser
        loss = reduce_tokens(per_token, keep, normaliser) * self.accumulate_grad_batches
        # Logged value is this micro-batch's share of the window loss, as Lightning will scale it.
        self.log("train/loss", loss / self.accumulate_grad_batches, on_step=True, prog_bar=True)
        return loss

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        answers, target_rows, draft_rows = self._answer_logits(batch)
        num_tokens = int(answers.sum())
        if num_tokens == 0:
            return
        # batch_size = answer tokens, so the epoch value is the mean per answer token, not per batch.
        log = functools.partial(self.log, batch_size=num_tokens, sync_dist=True, on_epoch=True, on_step=False)
        log("val/loss", self.divergence(target_rows, draft_rows).mean())
        log("val/kl", forward_kl(target_rows, draft_rows).mean())
        log("val/expected_acceptance", expected_acceptance(target_rows, draft_rows).mean(), prog_bar=True)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.draft.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the draft has no trainable parameters; did it get frozen by mistake?")
        optimizer = self.optimizer_factory(params)
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer, total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

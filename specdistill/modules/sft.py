"""Target fine-tuning: cross-entropy on answer tokens (prompt and padding masked), docs/METHODS.md section 1."""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch

from specdistill.losses.answers import answer_token_cross_entropy
from specdistill.losses.reduction import normalise_sum, window_normaliser
from specdistill.modules.optimization import configure_optimization


class SFTModule(L.LightningModule):
    """Fine-tunes a causal LM on a task's answers.

    The training loss is the cross-entropy summed over the micro-batch's answer tokens
    (`answer_token_cross_entropy`), divided by `window_normaliser(batch, world_size)` (the answer tokens of the whole
    gradient-accumulation window, all devices counted under data parallelism, exactly as distillation) and
    multiplied by the Trainer's `accumulate_grad_batches`, so batch 8 x accumulation 1 and batch 2 x accumulation 4
    give the same update. Outside a Trainer the accumulation and world size are 1.

    Args:
        model: trainable causal LM (HF-style: `model(input_ids=, attention_mask=).logits` `(B, T, V)`).
        optimizer: factory called with the model's trainable parameters (Hydra `_partial_: true`).
        scheduler: factory called as `scheduler(optimizer, total_steps=...)`, stepped every optimizer step; None for
            a constant rate.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., object] | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler

    def _loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return answer_token_cross_entropy(logits, batch["labels"])

    def _window(self) -> tuple[int, int]:
        """`(world_size, accumulate_grad_batches)` of the attached Trainer; `(1, 1)` without one."""
        if self._trainer is None:
            return 1, 1
        return self._trainer.world_size, self._trainer.accumulate_grad_batches

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        world_size, accumulate = self._window()
        normaliser = window_normaliser(batch, world_size)
        loss = normalise_sum(self._loss_sum(batch), normaliser) * accumulate
        self.log("train/loss", loss / accumulate, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        tokens = (batch["labels"][:, 1:] != -100).sum()
        loss = self._loss_sum(batch) / tokens.clamp_min(1)
        self.log("val/loss", loss, prog_bar=True, batch_size=int(tokens), sync_dist=True)

    def configure_optimizers(self):
        return configure_optimization(self, self.model, self.optimizer_factory, self.scheduler_factory)

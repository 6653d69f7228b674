"""Target fine-tuning: cross-entropy on answer tokens (prompt and padding masked)."""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
import torch.nn.functional as F


def answer_token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over answer positions.

    Args:
        logits: `(B, T, V)` model outputs.
        labels: `(B, T)` unshifted labels with -100 on prompt and padding.

    Returns:
        Scalar sum over answer tokens (0 with zero gradients when no answer token is present).
    """
    shifted_logits = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    shifted_labels = labels[:, 1:].reshape(-1)
    return F.cross_entropy(shifted_logits, shifted_labels, ignore_index=-100, reduction="sum")


class SFTModule(L.LightningModule):
    """Fine-tunes a causal LM on a task's answers.

    The loss is summed over answer tokens and divided by the answer tokens of the whole gradient-accumulation window
    (`batch["window_answer_tokens"]`), so batch 8 x accumulation 1 and batch 2 x accumulation 4 give the same update.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., object] | None = None,
        accumulate_grad_batches: int = 1,
    ) -> None:
        super().__init__()
        self.model = model
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.accumulate_grad_batches = accumulate_grad_batches

    def _loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return answer_token_cross_entropy(logits, batch["labels"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        window_tokens = batch["window_answer_tokens"].clamp_min(1)
        loss = self._loss_sum(batch) / window_tokens * self.accumulate_grad_batches
        self.log(
            "train/loss",
            loss / self.accumulate_grad_batches,
            prog_bar=True,
            batch_size=batch["input_ids"].shape[0],
        )
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        tokens = (batch["labels"][:, 1:] != -100).sum()
        loss = self._loss_sum(batch) / tokens.clamp_min(1)
        self.log("val/loss", loss, prog_bar=True, batch_size=int(tokens), sync_dist=True)

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = self.optimizer_factory(params)
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer, total_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

"""`TokenSelection`: the Lightning callback that plugs a token selector (AdaSPEC & co.) into `DistillModule`.

On `setup` it registers itself as `pl_module.token_selector`; the module then calls `select` once per micro-batch.
For selectors that need the reference divergence D(p, r) (AdaSPEC), it reads the batch's cached `ref_divergence`
column when present (written by the score stage, see `specdistill.selection.scoring`), otherwise it runs the frozen
reference model on the batch (no grad) and compares it with the target logits the module already computed, so the
target still runs once per batch. Online and cached scoring select the same tokens.

It logs `selection/kept_fraction`, the mean draft divergence and (with a reference) the mean gap of kept and dropped
tokens, a gap histogram when the logger supports histograms, and at the end of training writes into the run
directory `selection_tokens.json` (tokens most often dropped / kept) and `gap_histogram.png`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from torch import nn

from specdistill.losses.answers import answer_logits
from specdistill.models.frozen import Frozen
from specdistill.selection.base import Selection, SelectionInput, SupportsSelect
from specdistill.utils.wandb_logger import log_report


class TokenSelection(L.Callback):
    """Hold a selector and the reference source; select, log and count tokens.

    Args:
        selector: e.g. `AdaSpecSelector(k=0.4)`, `RandomSelector`, `DraftLossSelector`, `NoSelector`.
        reference: frozen reference model for online scoring (kept out of every checkpoint); None when batches
            carry cached `ref_divergence` or the selector needs no reference.
        tokenizer: decodes token ids in `selection_tokens.json`; None writes ids only.
        output_dir: where the end-of-training files go; None uses the trainer's log dir (or default_root_dir).
        top_tokens: how many most-dropped / most-kept tokens to list.
        histogram_every_n_steps: log a gap histogram to the logger and keep a sample for the final plot every this
            many optimizer steps (step 0 included).
        max_stored_scores: cap on the stored sample for the final plot (thinned evenly when exceeded).
    """

    def __init__(
        self,
        selector: SupportsSelect,
        reference: nn.Module | None = None,
        tokenizer: Any | None = None,
        output_dir: str | None = None,
        top_tokens: int = 50,
        histogram_every_n_steps: int = 50,
        max_stored_scores: int = 200_000,
    ) -> None:
        if histogram_every_n_steps < 1 or top_tokens < 1 or max_stored_scores < 1:
            raise ValueError("histogram_every_n_steps, top_tokens and max_stored_scores must be positive")
        self.selector = selector
        self._reference = Frozen(reference) if reference is not None else None
        self.tokenizer = tokenizer
        self.output_dir = output_dir
        self.top_tokens = top_tokens
        self.histogram_every_n_steps = histogram_every_n_steps
        self.max_stored_scores = max_stored_scores
        self._module: L.LightningModule | None = None
        self.kept_counts: torch.Tensor | None = None  # (V,) long
        self.dropped_counts: torch.Tensor | None = None  # (V,) long
        self._stored: dict[str, list[torch.Tensor]] = {"kept": [], "dropped": []}
        self._stored_size = 0
        self._last_recorded_step = -1
        self.last_selection: Selection | None = None

    @property
    def reference(self) -> nn.Module | None:
        return None if self._reference is None else self._reference.model

    @property
    def needs_reference(self) -> bool:
        return bool(getattr(self.selector, "needs_reference", False))

    # -- wiring --

    def attach(self, pl_module: L.LightningModule) -> None:
        """Check the reference against the module's vocabulary and register as `pl_module.token_selector`."""
        vocab_size = int(pl_module.vocab_size)
        if self.reference is not None:
            reference_vocab = getattr(getattr(self.reference, "config", None), "vocab_size", None)
            if reference_vocab is not None and reference_vocab < vocab_size:
                raise ValueError(
                    f"the reference model has vocab_size {reference_vocab} but the target's tokenizer has "
                    f"{vocab_size} tokens: the reference must come from the same family as draft and target "
                    "(same tokenizer); re-run the distill stage with this model pair"
                )
        pl_module.token_selector = self
        self._module = pl_module

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.attach(pl_module)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._reference is not None:
            self._reference.place(trainer)

    # -- selection --

    def reference_divergence(self, inp: SelectionInput) -> torch.Tensor:
        """D(p, r) per answer token `(N,)`: cached column if the batch has one, else the online reference."""
        cached = inp.batch.get("ref_divergence")
        if cached is not None:
            if cached.shape != inp.answer_mask.shape:
                raise ValueError(
                    f"cached ref_divergence has shape {tuple(cached.shape)} but the batch's shifted positions are "
                    f"{tuple(inp.answer_mask.shape)} (B, T-1); re-run the score stage on this tokenisation"
                )
            return cached.to(inp.draft_divergence.device, torch.float32)[inp.answer_mask]
        if self._reference is None:
            raise ValueError(
                f"{type(self.selector).__name__} needs the reference divergence, but the batch has no "
                "'ref_divergence' column and no reference model was given: pass reference=<frozen reference> "
                "or run the score stage first to cache the scores"
            )
        with torch.no_grad():
            vocab_size = inp.target_logits.shape[-1]
            reference_rows = answer_logits(self.reference, inp.batch, inp.answer_mask, vocab_size)
            return inp.divergence(inp.target_logits, reference_rows)

    def select(self, inp: SelectionInput) -> Selection:
        if self.needs_reference:
            inp = replace(inp, ref_divergence=self.reference_divergence(inp))
        selection = self.selector.select(inp)
        self.last_selection = selection
        self._record(inp, selection)
        return selection

    # -- statistics --

    def _record(self, inp: SelectionInput, selection: Selection) -> None:
        keep = selection.keep
        vocab_size = inp.target_logits.shape[-1]
        if self.kept_counts is None:
            self.kept_counts = torch.zeros(vocab_size, dtype=torch.long, device=keep.device)
            self.dropped_counts = torch.zeros(vocab_size, dtype=torch.long, device=keep.device)
        self.kept_counts = self.kept_counts.to(keep.device)
        self.dropped_counts = self.dropped_counts.to(keep.device)
        self.kept_counts += torch.bincount(inp.token_ids[keep], minlength=vocab_size)
        self.dropped_counts += torch.bincount(inp.token_ids[~keep], minlength=vocab_size)

        gap = None if inp.ref_divergence is None else inp.draft_divergence - inp.ref_divergence
        module = self._module
        if module is not None and getattr(module, "_trainer", None) is not None:
            n_kept = keep.sum().clamp_min(1)
            n_dropped = (~keep).sum().clamp_min(1)
            draft = inp.draft_divergence
            log = {"selection/kept_fraction": keep.sum() / max(keep.numel(), 1)}
            # masked means; an empty side (e.g. k = 1 has no dropped token) logs 0, never NaN
            log["selection/divergence_kept"] = (draft * keep).sum() / n_kept
            log["selection/divergence_dropped"] = (draft * ~keep).sum() / n_dropped
            if gap is not None:
                log["selection/gap_kept"] = (gap * keep).sum() / n_kept
                log["selection/gap_dropped"] = (gap * ~keep).sum() / n_dropped
            module.log_dict(log, on_step=True, on_epoch=False)
            step = module.trainer.global_step
            if step % self.histogram_every_n_steps == 0 and step != self._last_recorded_step:
                self._last_recorded_step = step
                values = gap if gap is not None else draft
                self._store(values.detach().float().cpu(), keep.cpu())
                self._log_histogram(module.trainer, values, step)

    def _store(self, values: torch.Tensor, keep: torch.Tensor) -> None:
        self._stored["kept"].append(values[keep])
        self._stored["dropped"].append(values[~keep])
        self._stored_size += values.numel()
        if self._stored_size > self.max_stored_scores:  # thin evenly so the sample spans the whole run
            for side in self._stored:
                self._stored[side] = [v[::2] for v in self._stored[side]]
            self._stored_size = sum(v.numel() for side in self._stored.values() for v in side)

    def _log_histogram(self, trainer: L.Trainer, values: torch.Tensor, step: int) -> None:
        """Send the histogram to the loggers that support one (TensorBoard, W&B); others get the final PNG only."""
        if values.numel() == 0:
            return
        values = values.detach().float().cpu()
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_histogram("selection/gap", values, step)
            elif isinstance(logger, WandbLogger):
                import wandb

                logger.experiment.log(
                    {"selection/gap": wandb.Histogram(values.numpy()), "trainer/global_step": step}
                )

    # -- end of training --

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.kept_counts is None:
            return
        kept = trainer.strategy.reduce(self.kept_counts.clone(), reduce_op="sum").long().cpu()
        dropped = trainer.strategy.reduce(self.dropped_counts.clone(), reduce_op="sum").long().cpu()
        if not trainer.is_global_zero:
            return
        out_dir = Path(self.output_dir or trainer.log_dir or trainer.default_root_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        write_token_report(out_dir / "selection_tokens.json", kept, dropped, self.tokenizer, self.top_tokens)
        kept_values = torch.cat(self._stored["kept"]) if self._stored["kept"] else torch.zeros(0)
        dropped_values = torch.cat(self._stored["dropped"]) if self._stored["dropped"] else torch.zeros(0)
        label = "gap D(p,q) - D(p,r)" if self.needs_reference else "draft divergence D(p,q)"
        plot_gap_histogram(out_dir / "gap_histogram.png", kept_values, dropped_values, label)
        # W&B gets the same report: the token table and the plot (other loggers keep the files only)
        report = json.loads((out_dir / "selection_tokens.json").read_text())
        tables = {k: v for k, v in report.items() if isinstance(v, list)}
        log_report(trainer.logger, tables, images=[out_dir / "gap_histogram.png"], key="selection")

    def state_dict(self) -> dict[str, Any]:
        if self.kept_counts is None:
            return {}
        return {"kept_counts": self.kept_counts.cpu(), "dropped_counts": self.dropped_counts.cpu()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.kept_counts = state_dict["kept_counts"].clone()
            self.dropped_counts = state_dict["dropped_counts"].clone()


def _token_text(tokenizer: Any | None, token_id: int) -> str | None:
    return None if tokenizer is None else tokenizer.decode([token_id])


def write_token_report(
    path: Path, kept: torch.Tensor, dropped: torch.Tensor, tokenizer: Any | None, top: int
) -> dict[str, Any]:
    """Write the kept/dropped token counts `(V,)` as JSON: totals plus the `top` most dropped and most kept tokens."""
    total = kept + dropped

    def rows(counts: torch.Tensor) -> list[dict[str, Any]]:
        order = torch.sort(counts, descending=True, stable=True).indices[:top]
        return [
            {
                "token_id": int(i),
                "token": _token_text(tokenizer, int(i)),
                "kept": int(kept[i]),
                "dropped": int(dropped[i]),
                "drop_rate": float(dropped[i]) / float(total[i]),
            }
            for i in order
            if counts[i] > 0
        ]

    n_total = int(total.sum())
    report = {
        "answer_tokens": n_total,
        "kept_tokens": int(kept.sum()),
        "kept_fraction": float(kept.sum()) / n_total if n_total else 0.0,
        "most_dropped": rows(dropped),
        "most_kept": rows(kept),
    }
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False))
    return report


def plot_gap_histogram(path: Path, kept: torch.Tensor, dropped: torch.Tensor, label: str) -> None:
    """Save a stacked histogram of the selection score for kept and dropped tokens.

    Uses a bare `Figure` (Agg canvas) rather than pyplot, so no global backend state is touched.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    data = [dropped.numpy(), kept.numpy()]
    ax.hist(data, bins=60, stacked=True, label=["dropped", "kept"], color=["tab:gray", "tab:blue"])
    ax.set_xlabel(label)
    ax.set_ylabel("answer tokens")
    ax.set_title(f"token selection: {kept.numel()} kept, {dropped.numel()} dropped (sampled steps)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)

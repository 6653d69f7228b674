"""`SelectionReport`: the Lightning callback that reports token selection (AdaSPEC & co.); it never drives the loss.

`DistillModule` selects tokens itself (its `selector` and `reference`, docs/METHODS.md section 3) and keeps each
training micro-batch's choice in `last_selection` (a `specdistill.selection.base.SelectionRecord`). This callback
reads that record after every training batch and:

- logs `selection/kept_fraction`, the mean draft divergence of kept and dropped tokens
  (`selection/divergence_kept`, `selection/divergence_dropped`) and, with reference divergences, the mean gap
  (`selection/gap_kept`, `selection/gap_dropped`), per step;
- counts kept and dropped tokens per vocabulary id (saved in checkpoints, so a resumed run keeps counting);
- every `histogram_every_n_steps` optimizer steps, logs a gap histogram to the loggers that support one and keeps a
  sample for the final plot;
- keeps the first `examples` sequences of the latest sampled micro-batch whose tokens were selected;
- at the end of training writes into the run directory `selection_tokens.json` (tokens most often dropped / kept,
  kept and dropped counts per token class with a tokenizer, and the kept examples with their dropped tokens
  marked `[[...]]`), `gap_histogram.png` and `selection_classes.png` (kept share per token class), and sends them
  to W&B.

It only reads tensors the module already detached, so training with or without it gives the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

from specdistill.diagnostics.plots import plot_class_selection
from specdistill.diagnostics.token_classes import class_counts
from specdistill.selection.base import SelectionRecord
from specdistill.utils.wandb_logger import log_report


class SelectionReport(L.Callback):
    """Log, count and plot the token selection of a `DistillModule` (see module doc).

    Args:
        tokenizer: decodes token ids in `selection_tokens.json`; None writes ids only.
        output_dir: where the end-of-training files go; None uses the trainer's log dir (or default_root_dir).
        top_tokens: how many most-dropped / most-kept tokens to list.
        histogram_every_n_steps: log a gap histogram to the logger and keep a sample for the final plot every this
            many optimizer steps (step 0 included).
        max_stored_scores: cap on the stored sample for the final plot (thinned evenly when exceeded).
        examples: how many training sequences to show with their dropped tokens marked (0: none).
    """

    def __init__(
        self,
        tokenizer: Any | None = None,
        output_dir: str | None = None,
        top_tokens: int = 50,
        histogram_every_n_steps: int = 50,
        max_stored_scores: int = 200_000,
        examples: int = 3,
    ) -> None:
        if histogram_every_n_steps < 1 or top_tokens < 1 or max_stored_scores < 1:
            raise ValueError("histogram_every_n_steps, top_tokens and max_stored_scores must be positive")
        if examples < 0:
            raise ValueError(f"examples={examples} must be >= 0 (0 shows none)")
        self.examples = examples
        # the shown sequences: per sequence, its (token ids, kept flags), from the latest sampled selection
        self.example_sequences: list[tuple[list[int], list[bool]]] = []
        self.tokenizer = tokenizer
        self.output_dir = output_dir
        self.top_tokens = top_tokens
        self.histogram_every_n_steps = histogram_every_n_steps
        self.max_stored_scores = max_stored_scores
        self.kept_counts: torch.Tensor | None = None  # (V,) long
        self.dropped_counts: torch.Tensor | None = None  # (V,) long
        self._stored: dict[str, list[torch.Tensor]] = {"kept": [], "dropped": []}
        self._stored_size = 0
        self._last_recorded_step = -1
        self._step_of_batch = 0
        self._has_gap = False
        self._last_record: SelectionRecord | None = None

    # -- per batch --

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # the optimizer step this micro-batch belongs to (global_step has moved on by on_train_batch_end)
        self._step_of_batch = trainer.global_step

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        record = getattr(pl_module, "last_selection", None)
        if record is None or record is self._last_record:
            return
        self._last_record = record
        self._count(record, int(pl_module.vocab_size))
        self._log(pl_module, record)
        step = self._step_of_batch
        if step % self.histogram_every_n_steps == 0 and step != self._last_recorded_step:
            self._last_recorded_step = step
            values = record.gap if record.gap is not None else record.draft_divergence
            self._store(values.detach().float().cpu(), record.keep.cpu())
            self._log_histogram(trainer, values, step)
            if record.scores is not None or record.gap is not None:  # a real selection, not keep-all warm-up
                self._keep_examples(record)

    def _count(self, record: SelectionRecord, vocab_size: int) -> None:
        keep = record.keep
        if self.kept_counts is None:
            self.kept_counts = torch.zeros(vocab_size, dtype=torch.long, device=keep.device)
            self.dropped_counts = torch.zeros(vocab_size, dtype=torch.long, device=keep.device)
        self.kept_counts = self.kept_counts.to(keep.device)
        self.dropped_counts = self.dropped_counts.to(keep.device)
        self.kept_counts += torch.bincount(record.token_ids[keep], minlength=vocab_size)
        self.dropped_counts += torch.bincount(record.token_ids[~keep], minlength=vocab_size)

    def _keep_examples(self, record: SelectionRecord) -> None:
        """Keep the first `examples` sequences of `record` as (token ids, kept flags), one row per answer token."""
        if not self.examples or record.sequence_index is None:
            return
        sequences, tokens, keep = record.sequence_index.cpu(), record.token_ids.cpu(), record.keep.cpu()
        if (
            record.answer_index is not None
        ):  # several rows per answer token: show each token once (its first row)
            first = first_rows(record.answer_index.cpu())
            order = record.answer_index.cpu()[first].argsort()
            sequences, tokens, keep = sequences[first][order], tokens[first][order], keep[first][order]
        shown = []
        for sequence in sequences.unique()[: self.examples].tolist():
            rows = sequences == sequence
            shown.append((tokens[rows].tolist(), keep[rows].tolist()))
        self.example_sequences = shown

    def _log(self, pl_module: L.LightningModule, record: SelectionRecord) -> None:
        keep, draft, gap = record.keep, record.draft_divergence, record.gap
        n_kept = keep.sum().clamp_min(1)
        n_dropped = (~keep).sum().clamp_min(1)
        log = {"selection/kept_fraction": keep.sum() / max(keep.numel(), 1)}
        # masked means; an empty side (e.g. k = 1 has no dropped token) logs 0, never NaN
        log["selection/divergence_kept"] = (draft * keep).sum() / n_kept
        log["selection/divergence_dropped"] = (draft * ~keep).sum() / n_dropped
        if gap is not None:
            self._has_gap = True
            log["selection/gap_kept"] = (gap * keep).sum() / n_kept
            log["selection/gap_dropped"] = (gap * ~keep).sum() / n_dropped
        pl_module.log_dict(log, on_step=True, on_epoch=False)

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
        token_report = write_token_report(out_dir / "selection_tokens.json", kept, dropped, self.tokenizer,
                                          self.top_tokens, self.example_sequences)  # fmt: skip
        images = []
        if token_report.get("by_class"):
            images.append(plot_class_selection(out_dir / "selection_classes.png", token_report["by_class"],
                                               f"token selection by class: {token_report['kept_tokens']} of "
                                               f"{token_report['answer_tokens']} answer tokens kept"))  # fmt: skip
        kept_values = torch.cat(self._stored["kept"]) if self._stored["kept"] else torch.zeros(0)
        dropped_values = torch.cat(self._stored["dropped"]) if self._stored["dropped"] else torch.zeros(0)
        label = "gap D(p,q) - D(p,r)" if self._has_gap else "draft divergence D(p,q)"
        plot_gap_histogram(out_dir / "gap_histogram.png", kept_values, dropped_values, label)
        # W&B gets the same report: the token tables and the plots (other loggers keep the files only)
        report = json.loads((out_dir / "selection_tokens.json").read_text())
        tables = {k: v for k, v in report.items() if isinstance(v, list)}
        if report.get("by_class"):
            tables["by_class"] = [{"class": name, **counts} for name, counts in report["by_class"].items()]
        log_report(trainer.logger, tables, images=[out_dir / "gap_histogram.png", *images], key="selection")

    def state_dict(self) -> dict[str, Any]:
        if self.kept_counts is None:
            return {}
        return {
            "kept_counts": self.kept_counts.cpu(),
            "dropped_counts": self.dropped_counts.cpu(),
            "example_tokens": [tokens for tokens, _ in self.example_sequences],
            "example_kept": [kept for _, kept in self.example_sequences],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self.kept_counts = state_dict["kept_counts"].clone()
            self.dropped_counts = state_dict["dropped_counts"].clone()
            tokens, kept = state_dict.get("example_tokens", []), state_dict.get("example_kept", [])
            self.example_sequences = [(list(t), list(k)) for t, k in zip(tokens, kept, strict=True)]


def first_rows(answer_index: torch.Tensor) -> torch.Tensor:
    """`(M,)` bool: True at the first row of each answer token in `answer_index` `(M,)` long."""
    order = answer_index.argsort(stable=True)
    ordered = answer_index[order]
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    out = torch.zeros_like(first)
    out[order] = first
    return out


def _token_text(tokenizer: Any | None, token_id: int) -> str | None:
    return None if tokenizer is None else tokenizer.decode([token_id])


def write_token_report(
    path: Path,
    kept: torch.Tensor,
    dropped: torch.Tensor,
    tokenizer: Any | None,
    top: int,
    examples: list[tuple[list[int], list[bool]]] = (),
) -> dict[str, Any]:
    """Write the kept/dropped token counts `(V,)` as JSON: totals, the `top` most dropped and most kept tokens and,
    with a tokenizer, the counts per token class (`by_class`, `specdistill.diagnostics.token_classes`) and the
    `examples` (token ids, kept flags) as text with the dropped tokens marked `[[...]]`."""
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
    if tokenizer is not None:
        seen = total.nonzero().squeeze(-1).tolist()
        texts = [_token_text(tokenizer, i) for i in seen]
        report["by_class"] = class_counts(texts, kept[seen].tolist(), dropped[seen].tolist()) if seen else {}
        report["examples"] = [marked_example(tokenizer, ids, flags) for ids, flags in examples]
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False))
    return report


def marked_example(tokenizer: Any, token_ids: list[int], kept: list[bool]) -> dict[str, Any]:
    """One training sequence's answer tokens as text, each dropped token wrapped in `[[...]]`, with its counts."""
    text = "".join(
        piece if flag else f"[[{piece}]]"
        for piece, flag in zip((tokenizer.decode([i]) for i in token_ids), kept, strict=True)
    )
    return {"text": text, "kept": sum(kept), "dropped": len(kept) - sum(kept)}


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

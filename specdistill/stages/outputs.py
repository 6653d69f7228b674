"""What a stage leaves behind: the export of a trained model, its logger and logged metrics, and `result.json` with
the console block that ends the stage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from transformers import PreTrainedTokenizerBase

from specdistill.drafts import DraftKind
from specdistill.export.hf import export_pretrained
from specdistill.export.publish import publish_export
from specdistill.utils.atomic import atomic_write_text
from specdistill.utils.run_dir import is_rank_zero


def export_trained(
    trainer: L.Trainer,
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
    metadata: dict[str, Any],
    kind: DraftKind | None = None,
) -> Path:
    """Write the export of a trained model (gathering ZeRO-3 shards first; rank 0 writes) and, when the logger is
    W&B with `log_model`, upload it as an artifact. A draft exports through its `kind` (`DraftKind.export`, which
    records the kind); other models (sft's target) as Hugging Face models."""

    def write(out: Path) -> object:
        if kind is not None:
            return kind.export(model, tokenizer, out, metadata)
        return export_pretrained(model, tokenizer, out, metadata)

    return publish_export(trainer, model, out_dir, write, metadata)


def stage_logger(cfg: DictConfig, out_dir: Path):
    """The configured logger, for stages without a Trainer (W&B gets the report table and plots)."""
    return instantiate(cfg.logger, save_dir=str(out_dir)) if cfg.get("logger") else None


def logged_metrics(trainer: L.Trainer, names: list[str]) -> dict[str, float]:
    metrics = trainer.callback_metrics
    return {name: float(metrics[name]) for name in names if name in metrics}


def write_result(out_dir: Path, result: dict[str, Any]) -> dict[str, Any]:
    """Write `result.json` and end the stage on the console with `format_result` (rank 0)."""
    atomic_write_text(out_dir / "result.json", json.dumps(result, indent=2, default=str))
    if is_rank_zero():
        print(format_result(out_dir, result), flush=True)
    return result


def format_result(out_dir: Path, result: dict[str, Any]) -> str:
    """A stage's last console block: its folder, then one `name  value` line per metric and output path.

    Numbers print with 4 decimals, a mapping (e.g. `heads: {draft: path}`) one line per entry (`heads/draft`);
    multi-line text (evaluate's table, printed already) and the stage name (the header) are left out.
    """
    rows = []
    for key, value in result.items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, item in items:
            name = f"{key}/{sub}" if sub is not None else key
            if isinstance(item, float):
                rows.append((name, f"{item:.4f}"))
            elif isinstance(item, int | str) and not isinstance(item, bool) and "\n" not in str(item):
                rows.append((name, str(item)))
    rows = [(name, text) for name, text in rows if name != "stage"]
    width = max((len(name) for name, _ in rows), default=0)
    return "\n".join(
        [f"{result.get('stage', 'stage')} finished: {out_dir}", *(f"  {n:<{width}}  {t}" for n, t in rows)]
    )

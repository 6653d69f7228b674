"""Stage `analyse`: token-level diagnostics of every draft against the target on the same validation answers.

For each draft (a pipeline hands it every draft its earlier steps made, as `evaluate` gets them) and the frozen
target, teacher-forced over the answers of `analyse.split`: the draft's signed top-2 logit margin where its argmax
agrees / disagrees with the target's, and the per-token KL(target || draft) (`specdistill.diagnostics`). Writes
`diagnostics.json` (every draft's summary, and how each differs from `analyse.baseline` in the directions the AdaSPEC
paper reports), `margins.png` and `kl.png` (drafts overlaid), and sends them to W&B; `result.json` holds the headline
numbers per draft.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from specdistill.diagnostics.plots import plot_kl, plot_margins
from specdistill.diagnostics.positions import (
    PositionDiagnostics,
    concatenate,
    paper_direction,
    position_diagnostics,
    summarise_positions,
)
from specdistill.drafts.base import LoadedDraft
from specdistill.errors import ConfigError, DataError
from specdistill.losses.answers import answer_mask
from specdistill.models.output_rows import logits_at, project_at
from specdistill.stages.datamodules import build_datamodule
from specdistill.stages.model_loading import load_frozen_target_and_drafts, named_drafts, pick_device
from specdistill.stages.outputs import stage_logger, write_result
from specdistill.stages.seeding import seed_everything
from specdistill.stages.settings import AnalyseSettings, build_settings
from specdistill.utils.wandb_logger import log_report, log_summary


def run(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    settings: AnalyseSettings = build_settings(cfg, "analyse")
    seed_everything(cfg)
    drafts = named_drafts(cfg, settings.drafts)
    if settings.baseline is not None and settings.baseline not in drafts:
        raise ConfigError(
            f"analyse.baseline={settings.baseline!r} is not among the analysed drafts {sorted(drafts)}; name one "
            "of them, or set analyse.baseline=null to report each draft alone"
        )
    device = pick_device(settings.device)
    tokenizer, target, loaded, vocab_size = load_frozen_target_and_drafts(cfg, drafts, device)
    datamodule = build_datamodule(
        cfg, tokenizer, max_length=settings.max_length, eval_batch_size=settings.batch_size
    )
    if not datamodule.task.has_split(settings.split):
        raise DataError(
            f"task {datamodule.task.name!r} has no {settings.split!r} split to analyse; set analyse.split to one "
            "it has (validation, or train)"
        )
    per_draft = diagnose(target, loaded, datamodule.scoring_dataloader(settings.split), vocab_size,
                         settings.max_examples, device)  # fmt: skip
    summaries = {name: summarise_positions(d) for name, d in per_draft.items()}
    directions = {
        name: paper_direction(summary, summaries[settings.baseline])
        for name, summary in summaries.items()
        if settings.baseline is not None and name != settings.baseline
    }
    positions = next(iter(summaries.values()))["positions"]
    title = f"{datamodule.task.name} {settings.split}: {positions} answer tokens"
    out_dir.mkdir(parents=True, exist_ok=True)
    images = [
        plot_margins(out_dir / "margins.png", per_draft, f"Draft logit margins, {title}"),
        plot_kl(out_dir / "kl.png", per_draft, f"Per-token KL to the target, {title}"),
    ]
    report = {
        "task": datamodule.task.name,
        "split": settings.split,
        "baseline": settings.baseline,
        "drafts": summaries,
        "against_baseline": directions,
    }
    (out_dir / "diagnostics.json").write_text(json.dumps(report, indent=2) + "\n")
    headline = headline_numbers(summaries)
    logger = stage_logger(cfg, out_dir)
    log_report(logger, {"drafts": [{"name": name, **headline_row(s)} for name, s in summaries.items()]},
               images=images, key="analyse")  # fmt: skip
    log_summary(logger, {f"analyse/{key}": value for key, value in headline.items()})
    return write_result(
        out_dir, {"stage": "analyse", "diagnostics": str(out_dir / "diagnostics.json"), **headline}
    )


@torch.no_grad()
def diagnose(
    target: torch.nn.Module,
    drafts: dict[str, LoadedDraft],
    batches: Any,
    vocab_size: int,
    max_examples: int | None,
    device: torch.device,
) -> dict[str, PositionDiagnostics]:
    """Every draft's `PositionDiagnostics` at the answer positions of the first `max_examples` examples of
    `batches` (in example order; None: all), teacher-forced like the target on the same positions."""
    parts: dict[str, list[PositionDiagnostics]] = {name: [] for name in drafts}
    for batch in batches:
        keep = answer_mask(batch["labels"])
        if max_examples is not None:
            keep &= (batch["example_id"] < max_examples)[:, None]
        if not bool(keep.any()):
            continue
        batch = {k: v.to(device) for k, v in batch.items()}
        positions = torch.nn.functional.pad(keep, (0, 1)).to(device)  # (B, T): position t predicts t + 1
        target_logits = logits_at(target, batch, positions, vocab_size)
        for name, draft in drafts.items():
            states = draft.kind.teacher_forced(draft.model, target, batch, vocab_size)
            draft_logits = project_at(states.head, states.hidden, positions)
            parts[name].append(position_diagnostics(draft_logits, target_logits))
    if not any(parts.values()):
        raise DataError(
            "analyse found no answer tokens in the examples it read; check analyse.split and analyse.max_examples"
        )
    return {name: concatenate(chunks) for name, chunks in parts.items()}


def headline_row(summary: dict[str, Any]) -> dict[str, float | int | None]:
    """The numbers of one draft's summary that a table row shows (see `headline_numbers`)."""
    margins = summary["margins"] or {}
    return {
        "positions": summary["positions"],
        "agreement": summary["agreement"],
        "positive_margin_fraction": margins.get("positive_fraction"),
        "mean_positive_margin": margins.get("mean_positive_margin"),
        "mean_negative_margin": margins.get("mean_negative_margin"),
        "kl_mean": summary["kl"]["mean"],
        "kl_median": summary["kl"]["median"],
        "expected_acceptance": summary["expected_acceptance"],
    }


def headline_numbers(summaries: dict[str, dict[str, Any]]) -> dict[str, float | int]:
    """`<draft>/<number>` for result.json and the W&B summary (numbers only; a missing one is left out)."""
    return {
        f"{name}/{key}": value
        for name, summary in summaries.items()
        for key, value in headline_row(summary).items()
        if value is not None
    }

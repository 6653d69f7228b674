"""Stage `evaluate`: the autoregressive target against every draft x draft-length policy on the task's prompts.

Loads the models, the prompts and the heads, then `specdistill.evaluation.protocol.evaluate_drafts` chooses the best
fixed K (and the head's h) per draft on the selection split (validation, never test) and decodes the test prompts
with everything, prompt lookup beside the drafts (`evaluate.prompt_lookup`). Writes `report.json`, `outputs.jsonl`,
the plots, `report.txt` (the console table) and prompt lookup's vLLM settings (`specdistill/export/ngram.py`).
"""

from __future__ import annotations

from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig

from specdistill.decoding.proposers import HybridProposer, PromptLookupProposer
from specdistill.decoding.sampling import SamplingConfig
from specdistill.evaluation.protocol import EvalProtocol, evaluate_drafts
from specdistill.evaluation.report import summary_metrics
from specdistill.export.ngram import write_ngram_config
from specdistill.models.acceptance_head import AcceptanceHead
from specdistill.stages.build import (
    build_datamodule,
    load_frozen_target_and_drafts,
    named_drafts,
    pick_device,
    seed_everything,
    stage_logger,
    write_result,
)
from specdistill.stages.settings import EvaluateSettings, build_settings
from specdistill.utils.wandb_logger import log_report, log_summary

LOOKUP_NAME = "prompt_lookup"


def run(cfg: DictConfig, out_dir: Path) -> dict:
    settings = build_settings(cfg, "evaluate")
    seed_everything(cfg)
    drafts = named_drafts(cfg, settings.drafts)
    unknown_heads = set(settings.heads or {}) - set(drafts)
    if unknown_heads:
        raise ValueError(f"evaluate.heads names drafts that are not evaluated: {sorted(unknown_heads)}")
    device = pick_device(settings.device)
    tokenizer, target, loaded, vocab_size = load_frozen_target_and_drafts(cfg, drafts, device)
    # what the engine drafts with
    models = {name: draft.proposer(vocab_size) for name, draft in loaded.items()}
    heads = {
        name: AcceptanceHead.load(path, device=device, draft=loaded[name].model)
        for name, path in (settings.heads or {}).items()
    }
    datamodule = build_datamodule(cfg, tokenizer, max_length=settings.max_length)
    # the reported prompts: the run's task, or `test_task` (K and h are chosen on the run's task either way)
    tested = (
        datamodule
        if settings.test_task is None
        else build_datamodule(cfg, tokenizer, max_length=settings.max_length, task=settings.test_task)
    )
    task = tested.task
    lookup = settings.prompt_lookup
    lookups = {}
    if lookup is not None:
        proposer = PromptLookupProposer(vocab_size, device, lookup.min_ngram, lookup.max_ngram)
        lookups[LOOKUP_NAME] = proposer
        if lookup.hybrid:
            lookups.update(
                {f"{name}+{LOOKUP_NAME}": HybridProposer(proposer, model) for name, model in models.items()}
            )
    result = evaluate_drafts(
        target,
        models,
        heads,
        {
            name: instantiate(node) for name, node in (settings.policies or {}).items() if node is not None
        },  # null: off
        eval_protocol(settings, SamplingConfig(**cfg.sampling), cfg.seed),
        test_prompts=tested.prompts(settings.split)[: settings.num_prompts],
        selection_prompts=datamodule.prompts(settings.selection_split)[: settings.selection_prompts],
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        score_fn=task.score if task.scoring_available else None,
        task_metric_name=task.metric_name,
        lookups=lookups,
    )
    result.report.settings["task"] = task.name  # the plots' titles name it
    result.report.settings["selection_task"] = cfg.task.name
    result.report.save(out_dir)
    if lookup is not None:
        best_k = result.choices[LOOKUP_NAME]["best_k"]
        write_ngram_config(out_dir, lookup.min_ngram, lookup.max_ngram, best_k)
    rows = [
        {"name": e["name"], **e["metrics"], "task_metric": e["task_metric"]}
        for e in result.report.to_dict()["entries"]
    ]
    logger = stage_logger(cfg, out_dir)
    log_report(logger, {"entries": rows}, images=sorted(out_dir.glob("*.png")))
    # the run's summary (a runs table's columns): every entry's metrics, the ratios and the best entry's
    log_summary(logger, summary_metrics(result.report, result.ratios))
    (out_dir / "report.txt").write_text(result.table + "\n")
    print(result.table)
    return write_result(
        out_dir,
        {"stage": "evaluate", "report": str(out_dir / "report.json"), **result.ratios, "table": result.table},
    )


def eval_protocol(settings: EvaluateSettings, sampling: SamplingConfig, seed: int) -> EvalProtocol:
    """The protocol `evaluate_drafts` runs, from the stage's settings (ranges checked there) and the run's decoding."""
    grid = settings.acceptance_head
    score_newest = grid.score_newest
    return EvalProtocol(
        fixed_lengths=list(settings.fixed_lengths),
        head_thresholds=list(grid.thresholds),
        head_score_newest=list(score_newest) if isinstance(score_newest, list) else bool(score_newest),
        head_min_draft_length=grid.min_draft_length,
        max_draft_length=settings.max_draft_length,
        selection_split=settings.selection_split,
        split=settings.split,
        sampling=sampling,
        max_new_tokens=settings.max_new_tokens,
        seed=seed,
        warmup=settings.warmup,
        repeats=settings.repeats,
        acceptance_draft_length=settings.acceptance_draft_length,
    )

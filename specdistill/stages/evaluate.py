"""Stage `evaluate`: the autoregressive target against every draft x draft-length policy on the task's prompts.

Loads the models, the prompts and the heads, then `specdistill.evaluation.protocol.evaluate_drafts` chooses the best
fixed K (and the head's h) per draft on the selection split (validation, never test) and decodes the test prompts
with everything, prompt lookup beside the drafts (`evaluate.prompt_lookup`). Writes `report.json`, `outputs.jsonl`,
the plots, `report.txt` (the console table) and prompt lookup's vLLM settings (`specdistill/drafts/prompt_lookup/export.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from specdistill.decoding.cost import cached_verification_cost
from specdistill.decoding.sampling import SamplingConfig
from specdistill.drafts.base import LoadedDraft
from specdistill.drafts.prompt_lookup.choice import fit_choice, lookup_rows
from specdistill.drafts.prompt_lookup.export import write_ngram_config
from specdistill.drafts.prompt_lookup.hybrid import HybridProposer
from specdistill.drafts.prompt_lookup.proposer import PromptLookupProposer
from specdistill.errors import ConfigError
from specdistill.evaluation.offline import (
    decoded_fixed_lengths,
    decoded_sequences,
    format_cost,
    format_offline,
    hybrid_candidates,
    lookup_blocks,
    offline_table,
)
from specdistill.evaluation.protocol import EvalProtocol, evaluate_drafts
from specdistill.evaluation.report import Report, summary_metrics
from specdistill.models.acceptance_head import AcceptanceHead
from specdistill.stages.datamodules import build_datamodule
from specdistill.stages.model_loading import load_frozen_target_and_drafts, named_drafts, pick_device
from specdistill.stages.outputs import stage_logger, write_result
from specdistill.stages.seeding import seed_everything
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
    lookups, hybrids = {}, {}
    if lookup is not None:
        proposer = PromptLookupProposer(vocab_size, device, lookup.min_ngram, lookup.max_ngram)
        lookups[LOOKUP_NAME] = proposer
        if lookup.hybrid:
            hybrids = {f"{name}+{LOOKUP_NAME}": name for name in models}
            lookups.update(
                {hybrid: HybridProposer(proposer, models[name]) for hybrid, name in hybrids.items()}
            )
    test_prompts = tested.prompts(settings.split)[: settings.num_prompts]
    # the target's verification cost, before decoding when the padded head policies read it (cached across runs)
    cost = target_cost(target, test_prompts, settings, vocab_size) if settings.acceptance_head.pads else None
    sampling = SamplingConfig(**cfg.sampling)
    if settings.offline_only and not sampling.is_greedy:
        raise ConfigError(
            "evaluate.offline_only=true estimates tokens per target call from the target's greedy outputs: run it "
            "with greedy sampling (sampling=greedy), or set evaluate.offline_only=false to decode every draft."
        )
    offline_only = settings.offline_only  # then the target alone is decoded
    policies = {
        name: instantiate(node) for name, node in (settings.policies or {}).items() if node is not None
    }  # null: off
    result = evaluate_drafts(
        target,
        {} if offline_only else models,
        {} if offline_only else heads,
        {} if offline_only else policies,
        eval_protocol(settings, sampling, cfg.seed, padding_cost=cost),
        test_prompts=test_prompts,
        selection_prompts=datamodule.prompts(settings.selection_split)[: settings.selection_prompts],
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        score_fn=task.score if task.scoring_available else None,
        task_metric_name=task.metric_name,
        lookups={} if offline_only else lookups,
        hybrids={} if offline_only else hybrids,
        fit_hybrid=(
            hybrid_choice(datamodule, target, loaded, settings, vocab_size)
            if lookup is not None and lookup.hybrid and lookup.choice == "fitted" and not offline_only
            else None
        ),
    )
    if result.report.settings["sampling"]["greedy"]:
        offline = offline_estimate(
            result.report, test_prompts, target, loaded, {**models, **lookups}, settings, vocab_size,
            {hybrid: result.choices[hybrid] for hybrid in hybrids if hybrid in result.choices},
        )  # fmt: skip
        result.report.settings["offline_tokens_per_target_call"] = offline
        decoded = decoded_fixed_lengths(result.report, list(offline))
        result.table += "\n" + format_offline(offline, decoded)
        result.ratios.update(offline_ratios(offline, decoded))
        cost = cost or target_cost(target, test_prompts, settings, vocab_size)
        shown = {n: c for n, c in cost.items() if n <= max(settings.fixed_lengths) + 1}
        result.report.settings["verification_cost"] = shown
        result.table += "\n" + format_cost(shown, offline)
    result.report.settings["task"] = task.name  # the plots' titles name it
    result.report.settings["selection_task"] = cfg.task.name
    result.report.save(out_dir)
    if LOOKUP_NAME in result.choices:
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


def offline_estimate(
    report: Report,
    prompts: list[dict[str, Any]],
    target: nn.Module,
    loaded: dict[str, LoadedDraft],
    proposers: dict[str, Any],
    settings: EvaluateSettings,
    vocab_size: int,
    hybrid_choices: dict[str, dict[str, Any]],
) -> dict[str, dict[int, float | None]]:
    """Each draft's (and prompt lookup's) tokens per target call at every K of the grid, from teacher-forced passes
    over the target's greedy test outputs (`specdistill.evaluation.offline`); a hybrid's draft rounds capped at its
    choice's `draft_k` and its lookup rounds kept to its `lookup_lengths`, as they were decoded (no choice: uncapped
    and every match, as under `offline_only`, where no K is chosen)."""
    sequences, prompt_lengths = decoded_sequences(report, prompts)
    lengths = sorted(set(settings.fixed_lengths))
    depth = lengths[-1]
    candidates = {
        name: teacher_forced_chain(draft, target, depth, vocab_size) for name, draft in loaded.items()
    }
    lookup = settings.prompt_lookup
    if lookup is not None:
        # one lookup pass per sequence serves lookup's row and every hybrid's
        blocks = per_sequence(
            functools.partial(
                lookup_blocks, min_ngram=lookup.min_ngram, max_ngram=lookup.max_ngram, depth=depth
            )
        )
        candidates[LOOKUP_NAME] = lambda seq: blocks(seq)[0]
        if lookup.hybrid:
            for name in loaded:
                hybrid = f"{name}+{LOOKUP_NAME}"
                choice = hybrid_choices.get(hybrid, {})
                candidates[hybrid] = functools.partial(
                    _hybrid, blocks, candidates[name], choice.get("draft_k"), choice.get("lookup_lengths")
                )
    prefill = {name: bool(getattr(p, "drafts_after_prefill", False)) for name, p in proposers.items()}
    return offline_table(candidates, sequences, prompt_lengths, settings.max_new_tokens, lengths, prefill)


def teacher_forced_chain(
    draft: LoadedDraft, target: nn.Module, depth: int, vocab_size: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`sequence (T,) -> (T, depth)` the draft's greedy chains along it (`DraftKind.chain_candidates`), kept per
    sequence (`per_sequence`): a draft's own row and its hybrid's read the same chain, and the teacher-forced pass
    is the expensive part."""
    device = next(target.parameters()).device

    def candidates(seq: torch.Tensor) -> torch.Tensor:
        batch = {
            "input_ids": seq[None].to(device),
            "attention_mask": torch.ones(1, seq.numel(), device=device),
        }
        return draft.kind.chain_candidates(draft.model, target, batch, depth, vocab_size).cpu()

    return per_sequence(candidates)


def per_sequence(compute: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """`compute` computed once per sequence tensor (the caller's list keeps every sequence alive, so its id is a
    stable key)."""
    kept: dict[int, Any] = {}

    def once(seq: torch.Tensor) -> Any:
        if id(seq) not in kept:
            kept[id(seq)] = compute(seq)
        return kept[id(seq)]

    return once


def _hybrid(
    lookup: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    draft: Callable[[torch.Tensor], torch.Tensor],
    draft_length: int | None,
    lookup_lengths: list[int] | None,
    seq: torch.Tensor,
) -> torch.Tensor:
    blocks, matched = lookup(seq)
    from_lookup = None if lookup_lengths is None else lookup_rows(matched, lookup_lengths)
    return hybrid_candidates(blocks, draft(seq), draft_length, from_lookup)


def hybrid_choice(
    datamodule: Any,
    target: nn.Module,
    loaded: dict[str, LoadedDraft],
    settings: EvaluateSettings,
    vocab_size: int,
) -> Callable[[str, int, int], frozenset[int]]:
    """`evaluate_drafts`' `fit_hybrid` for `evaluate.prompt_lookup.choice=fitted`: each hybrid's matched lengths
    fitted (`specdistill.drafts.prompt_lookup.choice`) on the selection split's sequences (prompt and training
    answer: the target's own answers under `task.answers_from`), at most `prompt_lookup.choice_sequences` of them."""
    lookup = settings.prompt_lookup
    count = lookup.choice_sequences
    rows = datamodule.tokenized(settings.selection_split).select_columns(["input_ids"])
    sequences = [
        torch.tensor(row["input_ids"], dtype=torch.long) for row in rows.select(range(min(count, len(rows))))
    ]
    prompt_lengths = [len(p["prompt_ids"]) for p in datamodule.prompts(settings.selection_split)[:count]]
    if not sequences:
        raise ConfigError(
            f"evaluate.prompt_lookup.choice=fitted fits on the {settings.selection_split!r} split, which has no "
            "examples: give the task that split, or set evaluate.prompt_lookup.choice=match."
        )
    depth = max(settings.fixed_lengths)
    blocks = [lookup_blocks(s, lookup.min_ngram, lookup.max_ngram, depth) for s in sequences]
    chains = {name: teacher_forced_chain(draft, target, depth, vocab_size) for name, draft in loaded.items()}

    def fit(draft: str, k: int, draft_k: int) -> frozenset[int]:
        chain = [chains[draft](s) for s in sequences]
        return fit_choice(sequences, blocks, chain, prompt_lengths, k, draft_k, lookup.max_ngram)[1]

    return fit


def target_cost(
    target: nn.Module, prompts: list[dict[str, Any]], settings: EvaluateSettings, vocab_size: int
) -> dict[int, float]:
    """The target's relative cost of verifying 1 .. max(K) + 1 tokens (`specdistill.decoding.cost`), up to
    `max_draft_length + 1` where padded head policies read it, after a context as long as a typical prompt with half
    the output budget; read from `settings.cost_cache` when this target was measured there before."""
    lengths = sorted(len(p["prompt_ids"]) for p in prompts)
    context = max(1, lengths[len(lengths) // 2] + settings.max_new_tokens // 2)
    longest = settings.max_draft_length if settings.acceptance_head.pads else max(settings.fixed_lengths)
    return cached_verification_cost(
        target, list(range(1, longest + 2)), context, settings.cost_cache, vocab_size=vocab_size
    )


def offline_ratios(
    offline: dict[str, dict[int, float | None]], decoded: dict[str, tuple[int, float]]
) -> dict[str, float]:
    """`<draft>/offline_over_decoded_k<K>`: the offline estimate over the decoded tokens per target call at the K
    the draft was decoded at (1: exact)."""
    out = {}
    for name, (k, value) in decoded.items():
        estimate = offline.get(name, {}).get(k)
        if estimate is not None and value:
            out[f"{name}/offline_over_decoded_k{k}"] = estimate / value
    return out


def eval_protocol(
    settings: EvaluateSettings,
    sampling: SamplingConfig,
    seed: int,
    padding_cost: dict[int, float] | None = None,
) -> EvalProtocol:
    """The protocol `evaluate_drafts` runs, from the stage's settings (ranges checked there), the run's decoding and
    the target's verification cost when padded head policies read it."""
    grid = settings.acceptance_head
    score_newest = grid.score_newest
    return EvalProtocol(
        fixed_lengths=list(settings.fixed_lengths),
        head_thresholds=list(grid.thresholds),
        head_score_newest=list(score_newest) if isinstance(score_newest, list) else bool(score_newest),
        head_min_draft_length=grid.min_draft_length,
        head_stops=list(grid.stops),
        max_draft_length=settings.max_draft_length,
        selection_split=settings.selection_split,
        split=settings.split,
        sampling=sampling,
        max_new_tokens=settings.max_new_tokens,
        seed=seed,
        warmup=settings.warmup,
        repeats=settings.repeats,
        acceptance_draft_length=settings.acceptance_draft_length,
        padding_cost=padding_cost,
    )

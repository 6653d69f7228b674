"""Stage `evaluate`: the autoregressive target against every draft x draft-length policy on the task's prompts.

For each draft (an export path) the best fixed K is chosen on the selection split (validation, never test), then
the target alone, fixed-K, the training-free heuristics, SpecDec++ heads (one policy per threshold h, for drafts
that have a head) and the oracle decode the same test prompts with the same seed and token budget. Writes
`report.json`, `outputs.jsonl`, the plots and `report.txt` (the console table) into the run directory.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig

from specdistill.decoding.head_policy import head_policy_grid
from specdistill.decoding.policies import FixedLength
from specdistill.decoding.sampling import SamplingConfig
from specdistill.evaluation.report import format_table
from specdistill.evaluation.runner import best_fixed_length, evaluate_policies, select_policy
from specdistill.models.acceptance_head import AcceptanceHead
from specdistill.stages.common import (
    build_datamodule,
    load_frozen_target_and_drafts,
    named_drafts,
    pick_device,
    seed_everything,
    stage_dir,
    write_result,
)
from specdistill.utils.wandb_logger import log_report

log = logging.getLogger(__name__)


def head_policies(head_dir: str, settings: DictConfig, device: torch.device) -> dict:
    """`head_policy_grid` for the head in `head_dir` over `settings.head_thresholds` x `head_score_newest`."""
    modes = settings.head_score_newest
    modes = list(modes) if isinstance(modes, (list, ListConfig)) else bool(modes)
    head = AcceptanceHead.load(head_dir, device=device)
    return head_policy_grid(head, list(settings.head_thresholds), modes, settings.head_min_draft_length)


def policy_ratios(report, choices: dict[str, dict]) -> dict[str, float]:
    """tokens/s of each draft's validation-chosen SpecDec++ policy over its best fixed K and over its oracle."""
    speed = {e["name"]: e["metrics"]["tokens_per_second"] for e in report.to_dict()["entries"]}
    ratios = {}
    for draft, choice in choices.items():
        head = speed.get(f"{draft}/{choice.get('best_head')}")
        fixed = speed.get(f"{draft}/fixed_k{choice['best_k']}")
        oracle = speed.get(f"{draft}/oracle")
        if head and fixed:
            ratios[f"{draft}/specdecpp_over_best_fixed_k"] = head / fixed
        if head and oracle:
            ratios[f"{draft}/specdecpp_over_oracle"] = head / oracle
    return ratios


def format_ratios(choices: dict[str, dict], ratios: dict[str, float]) -> str:
    lines = ["chosen on the selection split (tokens/s): " + "; ".join(
        f"{d}: K={c['best_k']}" + (f", {c['best_head']}" if c.get("best_head") else "") for d, c in choices.items()
    )]  # fmt: skip
    lines += [f"{name} = {value:.3f}" for name, value in ratios.items()]
    return "\n".join(lines)


def logger_for(cfg: DictConfig, out_dir: Path):
    """The configured logger, for stages without a Trainer (W&B gets the report table and plots)."""
    return instantiate(cfg.logger, save_dir=str(out_dir)) if cfg.get("logger") else None


def run(cfg: DictConfig) -> dict:
    settings = cfg.evaluate
    out_dir = stage_dir(cfg, "evaluate")
    seed_everything(cfg)
    drafts = named_drafts(cfg, settings.drafts)
    unknown_heads = set(settings.heads or {}) - set(drafts)
    if unknown_heads:
        raise ValueError(f"evaluate.heads names drafts that are not evaluated: {sorted(unknown_heads)}")
    device = pick_device(settings.device)
    tokenizer, target, models, vocab_size = load_frozen_target_and_drafts(cfg, drafts, device)
    datamodule = build_datamodule(cfg, tokenizer, settings)
    task = datamodule.task
    test_prompts = datamodule.prompts(settings.split)[: settings.num_prompts]
    selection_prompts = datamodule.prompts(settings.selection_split)[: settings.selection_prompts]
    sampling = SamplingConfig(**settings.sampling)
    common = dict(sampling=sampling, max_new_tokens=settings.max_new_tokens, seed=settings.seed)

    policies = {name: instantiate(node) for name, node in (settings.policies or {}).items()}
    combinations = [(d, p) for d in models for p in policies]
    selection = dict(
        prompts=selection_prompts,
        split=settings.selection_split,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        **common,
    )
    choices: dict[str, dict] = {}
    for draft_name, draft in models.items():
        best_k, per_k = best_fixed_length(target, draft, list(settings.fixed_lengths), **selection)
        choices[draft_name] = {"best_k": best_k, "tokens_per_second_by_k": per_k}
        name = f"fixed_k{best_k}"
        policies.setdefault(name, FixedLength(best_k))
        combinations.insert(0, (draft_name, name))
        head_dir = (settings.heads or {}).get(draft_name)
        if head_dir:
            candidates = head_policies(head_dir, settings, device)
            best, per_h = select_policy(target, draft, candidates, **selection)
            choices[draft_name].update(best_head=f"{draft_name}_{best}", tokens_per_second_by_head=per_h)
            for name, policy in candidates.items():
                policies[f"{draft_name}_{name}"] = policy
                combinations.append((draft_name, f"{draft_name}_{name}"))
    combinations.sort(key=lambda c: list(models).index(c[0]))

    report = evaluate_policies(
        target, models, policies, test_prompts, task.score if task.scoring_available else None, tokenizer,
        vocab_size=vocab_size, combinations=combinations, warmup=settings.warmup, repeats=settings.repeats,
        task_metric_name=task.metric_name, split=settings.split, **common,
    )  # fmt: skip
    ratios = policy_ratios(report, choices)
    report.settings["selection"] = {"split": settings.selection_split, **choices}
    report.settings["ratios"] = ratios
    report.save(out_dir)
    rows = [
        {"name": e["name"], **e["metrics"], "task_metric": e["task_metric"]}
        for e in report.to_dict()["entries"]
    ]
    log_report(logger_for(cfg, out_dir), {"entries": rows}, images=sorted(Path(out_dir).glob("*.png")))
    table = format_table(report) + "\n" + format_ratios(choices, ratios)
    (Path(out_dir) / "report.txt").write_text(table + "\n")
    print(table)
    return write_result(
        out_dir, {"stage": "evaluate", "report": str(Path(out_dir) / "report.json"), **ratios, "table": table}
    )

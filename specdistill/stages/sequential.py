"""Stage `sequential`: distil on one task, then on the next, and measure forgetting (docs/METHODS.md section 3).

The AdaSPEC paper's sequential multi-task experiment (MBPP, then GSM8K): each phase is a two-step pipeline run in
`<run_dir>/sequential/<i>_<task>/` on that phase's task (`sequential.tasks.<task>`), `distill` (DistillSpec) then
`adaspec` with that phase's DistillSpec draft as its reference, exactly as the default pipeline wires them; with
`sequential.target_answers`, a `target_answers` step first answers the task's prompts with the target, and the
phase trains, and the task is measured, on those answers (a pretrained target's, as the real pair's chain does). Each
method's draft continues from its own draft of the previous phase (`distill.init`, `adaspec.init`). Being a
pipeline, a phase resumes like one: a re-launch reuses finished phases and steps and resumes the unfinished step
from its last checkpoint.

After the last phase, every phase's two drafts are teacher-forced on every task's `sequential.split` answers
against the target (`specdistill.stages.analyse.diagnose`): the expected acceptance sum_v min(p, q) (the chance that
speculative sampling accepts a draft token, at the same prefix) and the greedy agreement. Forgetting of a task is its
acceptance after its own phase minus its acceptance after the last phase. Writes `forgetting.json` (every row and
the forgetting), `forgetting.txt` (the table), W&B tables and `result.json` (`<method>/<task>/after_<phase>/...`,
`<method>/<task>/forgetting`).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from specdistill.diagnostics.positions import summarise_positions
from specdistill.stages import pipeline
from specdistill.stages.analyse import diagnose
from specdistill.stages.datamodules import build_datamodule
from specdistill.stages.model_loading import load_frozen_target_and_drafts, named_drafts, pick_device
from specdistill.stages.outputs import stage_logger, write_result
from specdistill.stages.seeding import seed_everything
from specdistill.stages.settings import SequentialSettings, build_settings
from specdistill.utils.atomic import atomic_write_text
from specdistill.utils.wandb_logger import log_report, log_summary

# method -> the phase pipeline's step that trains it (its `init` continues the method's previous draft)
METHOD_STEPS = {"distillspec": "distill", "adaspec": "adaspec"}
ANSWERS_STEP = "target_answers"  # first step of each phase where sequential.target_answers is true


def run(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    settings: SequentialSettings = build_settings(cfg, "sequential")
    exports: dict[str, str | None] = dict.fromkeys(METHOD_STEPS)
    trained: list[Phase] = []
    for index, name in enumerate(settings.phases, start=1):
        phase = phase_config(cfg, name, exports, settings.epochs, settings.target_answers)
        results = pipeline.run(phase, out_dir / f"{index}_{name}")
        exports = {method: str(results[step]["export"]) for method, step in METHOD_STEPS.items()}
        answers = str(results[ANSWERS_STEP]["answers"]) if settings.target_answers else None
        trained.append(Phase(name, dict(exports), answers))
    rows = measure(cfg, settings, trained)
    forgetting = forgetting_of(rows, settings.phases)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "phases": list(settings.phases),
        "split": settings.split,
        "answers": {phase.task: phase.answers for phase in trained},  # null: the task's own
        "rows": rows,
        "forgetting": forgetting,
    }
    atomic_write_text(out_dir / "forgetting.json", json.dumps(report, indent=2) + "\n")
    table = forgetting_table(rows, forgetting, settings.phases)
    atomic_write_text(out_dir / "forgetting.txt", table + "\n")
    print(table, flush=True)
    headline = headline_numbers(rows, forgetting)
    logger = stage_logger(cfg, out_dir)
    log_report(logger, {"rows": rows, "forgetting": forgetting}, key="sequential")
    log_summary(logger, {f"sequential/{key}": value for key, value in headline.items()})
    final = {method: exports[method] for method in METHOD_STEPS}
    return write_result(out_dir, {"stage": "sequential", "exports": final, **headline})


@dataclass(frozen=True)
class Phase:
    """A finished phase: its task, each method's draft export, and the target's answers it trained on (None: the
    task's own answers)."""

    task: str
    exports: dict[str, str]
    answers: str | None


def with_task(cfg: DictConfig, task: str, answers_from: str | None = None) -> DictConfig:
    """A copy of `cfg` whose `task` is `sequential.tasks[task]`, reading the answers in `answers_from` where given."""
    out = copy.deepcopy(cfg)
    with open_dict(out):
        out.task = out.sequential.tasks[task]
        if answers_from is not None:
            out.task.answers_from = answers_from
    return out


def phase_config(
    cfg: DictConfig,
    task: str,
    exports: dict[str, str | None],
    epochs: int | None = None,
    target_answers: bool = False,
) -> DictConfig:
    """The pipeline of one phase: `cfg` with `task` as its task, `distill` then `adaspec` (after `target_answers`,
    whose answers they train on, where `target_answers`), each method's draft continuing from `exports[method]`
    (None: the pair's draft), `epochs` (None: the steps' own) and the keys the earlier steps fill left empty."""
    phase = with_task(cfg, task)
    with open_dict(phase):
        phase.pipeline.steps = [*([ANSWERS_STEP] if target_answers else []), *METHOD_STEPS.values()]
        if target_answers:
            phase.task.answers_from = None  # the phase's target_answers step fills it
        for method, step in METHOD_STEPS.items():
            phase[step].init = exports[method]
            if epochs is not None:
                phase[step].trainer.max_epochs = epochs
            # each phase's cache in its own distill folder: another task's
            phase[step].target_cache_dir = None
        phase.adaspec.reference = None  # the distill step of the same phase fills it
    return phase


def measure(cfg: DictConfig, settings: SequentialSettings, trained: list[Phase]) -> list[dict[str, Any]]:
    """One row per (method, phase after which, task measured): expected acceptance, agreement and mean KL of that
    draft against the target on the task's answers (the target's, from the task's own phase, where it trained on
    them)."""
    seed_everything(cfg)
    paths = {f"{method}@{phase.task}": path for phase in trained for method, path in phase.exports.items()}
    answers = {phase.task: phase.answers for phase in trained}
    device = pick_device(settings.device)
    tokenizer, target, loaded, vocab_size = load_frozen_target_and_drafts(
        cfg, named_drafts(cfg, paths), device
    )
    rows = []
    for task in settings.phases:
        task_cfg = with_task(cfg, task, answers[task])
        datamodule = build_datamodule(
            task_cfg, tokenizer, max_length=settings.max_length, eval_batch_size=settings.batch_size
        )
        per_draft = diagnose(target, loaded, datamodule.scoring_dataloader(settings.split), vocab_size,
                             settings.max_examples, device)  # fmt: skip
        for name, diagnostics in per_draft.items():
            method, _, after = name.partition("@")
            summary = summarise_positions(diagnostics)
            rows.append({
                "method": method, "after": after, "task": task, "positions": summary["positions"],
                "expected_acceptance": summary["expected_acceptance"], "agreement": summary["agreement"],
                "kl_mean": summary["kl"]["mean"],
            })  # fmt: skip
    return rows


def forgetting_of(rows: list[dict[str, Any]], phases: list[str]) -> list[dict[str, Any]]:
    """Per method and every task but the last: its expected acceptance after its own phase, after the last phase,
    and the drop between them (`forgetting`, positive when the later phases made the draft worse on it)."""
    acceptance = {(r["method"], r["after"], r["task"]): r["expected_acceptance"] for r in rows}
    methods = list(dict.fromkeys(r["method"] for r in rows))
    last = phases[-1]
    out = []
    for method in methods:
        for task in phases[:-1]:
            own, final = acceptance[method, task, task], acceptance[method, last, task]
            out.append({"method": method, "task": task, "after_own_phase": own, "after_last_phase": final,
                        "forgetting": own - final})  # fmt: skip
    return out


def forgetting_table(rows: list[dict[str, Any]], forgetting: list[dict[str, Any]], phases: list[str]) -> str:
    """Expected acceptance per method and phase (rows) on each task (columns), then each task's forgetting."""
    acceptance = {(r["method"], r["after"], r["task"]): r["expected_acceptance"] for r in rows}
    methods = list(dict.fromkeys(r["method"] for r in rows))
    header = ["method", "after phase", *(f"acceptance on {task}" for task in phases)]
    body = [
        [method, f"{index} ({after})", *(f"{acceptance[method, after, task]:.4f}" for task in phases)]
        for method in methods
        for index, after in enumerate(phases, start=1)
    ]
    body += [
        [f["method"], "forgetting", *(f"{f['forgetting']:+.4f}" if f["task"] == t else "" for t in phases)]
        for f in forgetting
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in [header, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def headline_numbers(rows: list[dict[str, Any]], forgetting: list[dict[str, Any]]) -> dict[str, float]:
    """`<method>/<task>/after_<phase>/expected_acceptance` and `<method>/<task>/forgetting`, for result.json."""
    numbers = {
        f"{r['method']}/{r['task']}/after_{r['after']}/expected_acceptance": r["expected_acceptance"]
        for r in rows
    }
    numbers.update({f"{f['method']}/{f['task']}/forgetting": f["forgetting"] for f in forgetting})
    return numbers

"""Stage `target_answers`: the target's own greedy answers to the task's prompts, the text the drafts then learn from.

DistillSpec and EAGLE train drafts on what the target writes, not on the dataset's answers: a draft is accepted when
it predicts the target's next token on the target's own text, and a dataset's answers can look nothing like it (an
instruction-tuned target answers a code prompt with prose where the dataset has a function body). This step answers
the first `max_prompts` prompts of each split in `target_answers.splits` greedily (at most `max_new_tokens` tokens,
batches sorted by prompt length) and writes them as `<out_dir>/answers/<split>.jsonl` (`specdistill.tasks.answers`);
in a pipeline its `answers` output fills `task.answers_from`, so every later step trains and validates on them
(scores still compare with the dataset's answers). Greedy, because the drafts are evaluated under greedy decoding
first; the losses match whole distributions at every answer position, so a sampled evaluation learns from it too.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from specdistill.evaluation.generation import greedy_texts
from specdistill.stages.build import (
    build_datamodule,
    load_frozen_target_and_drafts,
    pick_device,
    seed_everything,
    write_result,
)
from specdistill.stages.settings import TargetAnswersSettings, build_settings
from specdistill.tasks.answers import prompt_key, write_answers
from specdistill.tasks.base import Task

log = logging.getLogger(__name__)


def run(cfg: DictConfig, out_dir: Path) -> dict:
    settings: TargetAnswersSettings = build_settings(cfg, "target_answers")
    seed_everything(cfg)
    tokenizer, target, _, _ = load_frozen_target_and_drafts(cfg, {}, pick_device(settings.device))
    datamodule = build_datamodule(cfg, tokenizer, max_length=settings.max_length)
    folder = out_dir / "answers"
    result: dict = {"stage": "target_answers", "answers": str(folder)}
    for split in settings.splits:
        prompts = unique_prompts(datamodule.task, datamodule.prompts(split)[: settings.max_prompts])
        order = sorted(prompts, key=lambda key: len(prompts[key]))
        texts = greedy_texts(
            target, tokenizer, [prompts[key] for key in order], settings.max_new_tokens,
            batch_size=settings.batch_size, desc=f"target answers ({split})",
        )  # fmt: skip
        write_answers(folder, split, sorted(zip(order, texts, strict=True)))
        result[f"{split}/answers"] = len(texts)
        result[f"{split}/empty_answers"] = sum(not text.strip() for text in texts)
        log.info("target answers: %d for %s (%d empty)", len(texts), split, result[f"{split}/empty_answers"])
    return write_result(out_dir, result)


def unique_prompts(task: Task, prompts: list[dict]) -> dict[str, list[int]]:
    """`{prompt key: prompt ids}`, one per distinct prompt (two records can share one: the standard library defines
    some functions twice with the same signature and docstring), in split order."""
    unique: dict[str, list[int]] = {}
    for prompt in prompts:
        unique.setdefault(prompt_key(task.prompt(prompt["record"])), list(prompt["prompt_ids"]))
    return unique

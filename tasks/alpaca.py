"""Alpaca (tatsu-lab/alpaca): instruction following with the Stanford Alpaca prompt; metric ROUGE-L."""

from __future__ import annotations

from specdistill.tasks.base import Record
from specdistill.tasks.rouge_task import RougeTask

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


class Alpaca(RougeTask):
    """Stanford Alpaca's template (with or without the input block); answer: `output`.

    The hub dataset has only a train split: validation and test are held out from its end (200 and 500).
    """

    name = "alpaca"
    required_columns = ("instruction", "input", "output")
    default_path = "tatsu-lab/alpaca"
    default_config_name = None
    default_splits = {"train": "train", "validation": None, "test": None}
    default_holdout = {"validation": 200, "test": 500}

    def prompt(self, record: Record) -> str:
        template = PROMPT_WITH_INPUT if (record.get("input") or "").strip() else PROMPT_NO_INPUT
        return template.format(instruction=record["instruction"], input=record.get("input") or "")

    def answer(self, record: Record) -> str:
        return record["output"]

"""HumanEval (openai/openai_humaneval): complete a function from its signature and docstring; evaluation only."""

from __future__ import annotations

from functools import cached_property

import datasets

from specdistill.tasks.base import SPLITS, Record, TaskDataError, hash_split
from specdistill.tasks.code_task import CodeTask, strip_code_fence
from specdistill.tasks.specdecpp_prompts import humaneval_prompt

# the Codex paper's stop sequences: a completion ends where top-level code would start again
STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


class HumanEval(CodeTask):
    """Prompt: the function's signature and docstring; answer: the canonical body; metric pass@1 (opt-in execution).

    HumanEval has only a test split (164 problems), so `train_available` is False.
    """

    name = "humaneval"
    required_columns = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
    default_path = "openai/openai_humaneval"
    default_config_name = None
    default_splits = {"train": None, "validation": None, "test": "test"}
    prompt_styles = ("default", "specdecpp")

    def prompt(self, record: Record) -> str:
        if self.prompt_style == "specdecpp":
            return humaneval_prompt(record["prompt"])
        return record["prompt"]

    def answer(self, record: Record) -> str:
        return record["canonical_solution"]

    def extract_answer(self, text: str) -> str | None:
        """The function body: cut at the first stop sequence (code fences removed first)."""
        text = strip_code_fence(text)
        cut = min((i for i in (text.find(s) for s in STOP_SEQUENCES) if i >= 0), default=len(text))
        return text[:cut].rstrip()

    def program(self, completion: str, record: Record) -> str:
        return f"{record['prompt']}{completion}\n\n{record['test']}\n\ncheck({record['entry_point']})\n"


class HumanEvalSplits(HumanEval):
    """HumanEval as a task to train on, with the problems an evaluation decodes held out: the first `evaluated`
    problems (HumanEval/0 to HumanEval/<evaluated - 1>, in file order: what an evaluation of the first `evaluated`
    prompts of task=humaneval decodes) are the test split; the others go to validation (`validation_fraction` of
    them, by a hash of the task id, so a problem keeps its split) or train.

    Args:
        evaluated: problems set aside as the test split (0 to 163).
        validation_fraction: share of the remaining problems in validation (0 < f < 1).
        **kwargs: as `HumanEval`; `data_files` is one file of the 164 problems (or None: the hub's test split).
    """

    name = "humaneval_splits"

    def __init__(self, evaluated: int = 10, validation_fraction: float = 0.2, **kwargs) -> None:
        super().__init__(**kwargs)
        if isinstance(evaluated, bool) or not isinstance(evaluated, int) or evaluated < 0:
            raise ValueError(f"evaluated={evaluated!r}: give the number of problems held out as test (>= 0).")
        if not 0.0 < float(validation_fraction) < 1.0:
            raise ValueError(
                f"validation_fraction={validation_fraction!r}: give a share strictly between 0 and 1."
            )
        if isinstance(self.data_files, dict):
            raise ValueError(
                f"data_files={self.data_files}: {self.name} splits one file of HumanEval's problems itself; give "
                "that file (task.data_files=<HumanEval.jsonl.gz>), not a mapping of splits."
            )
        self.evaluated = evaluated
        self.validation_fraction = float(validation_fraction)

    def _source_has(self, split: str) -> bool:
        return split in SPLITS

    @cached_property
    def problems(self) -> datasets.Dataset:
        """Every problem of the source, in file order (the hub's or the file's single split)."""
        problems = super()._load_source("test")
        if self.evaluated >= len(problems):
            raise TaskDataError(
                f"{self.name}: evaluated={self.evaluated} holds out every one of the {len(problems)} problems "
                f"({self._describe_source('test')}); lower task.evaluated so that some are left to train on."
            )
        return problems

    def _load_source(self, split: str) -> datasets.Dataset:
        problems = self.problems
        if split == "test":
            return problems.select(range(self.evaluated))
        fractions = {"validation": self.validation_fraction}
        ids = problems["task_id"]
        rows = [
            i
            for i in range(self.evaluated, len(problems))
            if hash_split(f"humaneval/{ids[i]}", fractions) == split
        ]
        return problems.select(rows)

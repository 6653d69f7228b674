"""HumanEval (openai/openai_humaneval): complete a function from its signature and docstring; evaluation only."""

from __future__ import annotations

from specdistill.tasks.base import Record
from specdistill.tasks.code_task import CodeTask, strip_code_fence

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

    def prompt(self, record: Record) -> str:
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

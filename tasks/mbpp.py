"""MBPP (google-research-datasets/mbpp, config `full`): Python problems with assert tests; metric pass@1."""

from __future__ import annotations

from specdistill.tasks.base import Record
from specdistill.tasks.code_task import CodeTask, strip_code_fence


class MBPP(CodeTask):
    """Prompt: the MBPP paper's instruction with the problem text and its tests; answer: the reference code.

    CRLF line endings of the reference code (common in MBPP) are normalised to LF.
    """

    name = "mbpp"
    required_columns = ("task_id", "text", "code", "test_list")
    default_path = "google-research-datasets/mbpp"
    default_config_name = "full"
    default_splits = {"train": "train", "validation": "validation", "test": "test"}

    def prompt(self, record: Record) -> str:
        tests = "\n".join(record["test_list"])
        return (
            f"You are an expert Python programmer, and here is your task: {record['text']} "
            f"Your code should pass these tests:\n\n{tests}\n"
        )

    def answer(self, record: Record) -> str:
        return record["code"].replace("\r\n", "\n")

    def extract_answer(self, text: str) -> str | None:
        return strip_code_fence(text).rstrip()

    def program(self, completion: str, record: Record) -> str:
        setup = record.get("test_setup_code") or ""
        return f"{setup}\n{completion}\n\n" + "\n".join(record["test_list"]) + "\n"

"""GSM8K (openai/gsm8k, config `main`) with AdaSPEC's prompt and answer format (docs/METHODS.md section 1)."""

from __future__ import annotations

import re

from specdistill.tasks import specdecpp_prompts
from specdistill.tasks.base import Record, Task
from specdistill.tasks.metrics import NUMBER, normalise_number

QUESTION_SUFFIX = "\nAnswer the above question. First think step by step and then answer the final number.\n"
ANSWER_MARKER = "The final answer is: "
# markers that introduce the final number in generated text: AdaSPEC's, then GSM8K's own
_MARKERS = (re.compile(r"the final answer is:", re.IGNORECASE), re.compile(re.escape("####")))


def gsm8k_prompt(question: str) -> str:
    """AdaSPEC's prompt: the question, then the instruction to think step by step."""
    return f"{question}{QUESTION_SUFFIX}"


def gsm8k_answer(answer: str) -> str:
    """GSM8K's worked solution with "####" replaced by "The final answer is: ", exactly as AdaSPEC does.

    The replacement keeps GSM8K's space after "####", so the final line reads "The final answer is:  72"
    (two spaces); we keep AdaSPEC's text byte for byte so that results stay comparable.
    """
    return answer.replace("####", ANSWER_MARKER)


def extract_final_number(text: str) -> str | None:
    """The final number of a solution, normalised ("1,200.0" -> "1200").

    The first number after the first "The final answer is:" (or "####") marker; without a marker, the last number
    in the text (the usual "flexible" GSM8K extraction). None when the text holds no number.
    """
    for marker in _MARKERS:
        found = marker.search(text)
        if found:
            number = NUMBER.search(text, found.end())
            return normalise_number(number.group()) if number else None
    numbers = NUMBER.findall(text)
    return normalise_number(numbers[-1]) if numbers else None


class GSM8K(Task):
    """Grade-school maths word problems; metric: exact match of the final number.

    GSM8K has no validation split: by default the last 200 train problems are held out for it (`holdout`).
    """

    name = "gsm8k"
    metric_name = "accuracy"
    required_columns = ("question", "answer")
    default_path = "openai/gsm8k"
    default_config_name = "main"
    default_splits = {"train": "train", "validation": None, "test": "test"}
    default_holdout = {"validation": 200}
    prompt_styles = ("default", "specdecpp")

    def prompt(self, record: Record) -> str:
        if self.prompt_style == "specdecpp":
            return specdecpp_prompts.gsm8k_prompt(record["question"])
        return gsm8k_prompt(record["question"])

    def answer(self, record: Record) -> str:
        return gsm8k_answer(record["answer"])

    def extract_answer(self, text: str) -> str | None:
        return extract_final_number(text)

    def record_problem(self, record: Record) -> str | None:
        """A record must hold both fields and an answer ending in "#### <number>" (what scoring compares)."""
        problem = super().record_problem(record)
        if problem:
            return problem
        if "####" not in record["answer"]:
            return f"the answer has no '#### <number>' line: {record['answer'][-80:]!r}"
        if normalise_number(record["answer"].rsplit("####", 1)[1]) is None:
            return f"the answer's '####' line is not a number: {record['answer'][-80:]!r}"
        return None

    def reference_number(self, record: Record) -> str:
        """The gold final number of a record (after GSM8K's "####")."""
        if "####" not in record["answer"]:
            raise ValueError(f"GSM8K answer has no '#### <number>' line: {record['answer']!r}")
        gold = normalise_number(record["answer"].rsplit("####", 1)[1])
        if gold is None:
            raise ValueError(f"GSM8K answer's final line is not a number: {record['answer']!r}")
        return gold

    def score(self, generated_text: str, record: Record) -> float:
        predicted = self.extract_answer(generated_text)
        return float(predicted is not None and predicted == self.reference_number(record))

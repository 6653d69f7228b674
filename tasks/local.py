"""Your own data: local JSON/JSONL/CSV/Parquet files with any field names, a prompt template and a metric of your choice.

    python train.py task=local task.data_files='{train:qa_train.jsonl,test:qa_test.jsonl}' \
        task.fields.prompt=q task.fields.answer=a task.prompt_template='Q: {prompt}\nA:' task.metric=number

The prompt template is formatted with `prompt` (the prompt field's value) and every column of the record, so a
template may combine several columns (`'{prompt}\nContext: {context}\n'`); the answer template likewise with
`answer`; `\\n` and `\\t` in a template are a newline and a tab. `task.chat_template=true` renders the
prompt as one user message with the tokenizer's chat template.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

from specdistill.errors import ConfigError
from specdistill.tasks.base import Record, Task
from specdistill.tasks.metrics import NUMBER, normalise_number, rouge_l_f

METRICS = {"exact_match": "exact_match", "number": "accuracy", "rougeL": "rougeL"}


def _unescape(template: str) -> str:
    return template.replace("\\n", "\n").replace("\\t", "\t")


def _template_fields(template: str) -> set[str]:
    return {name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(template) if name}


class LocalTask(Task):
    """A task read from local files with a field mapping.

    Args:
        fields: `{prompt: <column>, answer: <column>}`, the columns holding the prompt and the answer.
        prompt_template / answer_template: `str.format` templates (see the module docstring).
        metric: `exact_match` (the generation's first line equals the answer's, ignoring case and surrounding
            spaces), `number` (the last number of the generation's first line equals the answer's number) or
            `rougeL` (ROUGE-L F of the whole generation).
        **kwargs: `Task`'s arguments; `data_files` is required.
    """

    name = "local"
    default_splits = {"train": "train", "validation": "validation", "test": "test"}

    def __init__(
        self,
        fields: Mapping[str, str] | None = None,
        prompt_template: str = "{prompt}\n",
        answer_template: str = "{answer}",
        metric: str = "exact_match",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if self.data_files is None:
            raise ConfigError(
                "task=local reads your files: set task.data_files=<file> or "
                "task.data_files='{train:train.jsonl,test:test.jsonl}' (JSON, JSONL, CSV or Parquet)."
            )
        fields = dict(fields or {"prompt": "prompt", "answer": "answer"})
        unknown = set(fields) - {"prompt", "answer"}
        if unknown or not {"prompt", "answer"} <= set(fields):
            raise ConfigError(
                f"task.fields={fields}: give exactly the columns of the prompt and the answer, e.g. "
                "task.fields.prompt=question task.fields.answer=solution"
            )
        if metric not in METRICS:
            raise ConfigError(f"task.metric={metric!r} is not a metric; use one of {sorted(METRICS)}")
        self.fields = fields
        # "\n" typed on a command line arrives as backslash + n: a template means a newline by it
        self.prompt_template = _unescape(prompt_template)
        self.answer_template = _unescape(answer_template)
        self.metric = metric
        self.metric_name = METRICS[metric]
        template_columns = (_template_fields(prompt_template) | _template_fields(answer_template)) - {
            "prompt",
            "answer",
        }
        self.required_columns = tuple(dict.fromkeys([fields["prompt"], fields["answer"], *template_columns]))

    def _values(self, record: Record) -> dict[str, Any]:
        return {**record, "prompt": record[self.fields["prompt"]], "answer": record[self.fields["answer"]]}

    def prompt(self, record: Record) -> str:
        return self.prompt_template.format(**self._values(record))

    def answer(self, record: Record) -> str:
        return self.answer_template.format(**self._values(record))

    def record_problem(self, record: Record) -> str | None:
        problem = super().record_problem(record)
        if problem is None and self.metric == "number" and self._reference_number(record) is None:
            return f"task.metric=number but the answer {str(record[self.fields['answer']])[-80:]!r} holds no number"
        return problem

    def _reference_number(self, record: Record) -> str | None:
        numbers = NUMBER.findall(str(record[self.fields["answer"]]))
        return normalise_number(numbers[-1]) if numbers else None

    def extract_answer(self, text: str) -> str | None:
        if self.metric == "rougeL":
            return text.strip()
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        if not lines:
            return None
        if self.metric == "number":
            numbers = NUMBER.findall(lines[0])
            return normalise_number(numbers[-1]) if numbers else None
        return lines[0]

    def score(self, generated_text: str, record: Record) -> float:
        found = self.extract_answer(generated_text)
        if self.metric == "rougeL":
            return rouge_l_f(found or "", str(record[self.fields["answer"]]))
        if found is None:
            return 0.0
        if self.metric == "number":
            return float(found == self._reference_number(record))
        return float(found.casefold() == str(record[self.fields["answer"]]).strip().casefold())

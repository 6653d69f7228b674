"""Shared base of text-generation tasks scored by ROUGE-L F (Alpaca, XSum, CNN/DailyMail, ShareGPT)."""

from __future__ import annotations

from specdistill.tasks.base import Record, Task
from specdistill.tasks.metrics import rouge_l_f


class RougeTask(Task):
    """Metric: ROUGE-L F-measure of the generated text against the reference answer (no stemming)."""

    metric_name = "rougeL"

    def extract_answer(self, text: str) -> str | None:
        return text.strip()

    def score(self, generated_text: str, record: Record) -> float:
        return rouge_l_f(self.extract_answer(generated_text) or "", self.answer(record))

"""XSum (EdinburghNLP/xsum): one-sentence summaries of BBC articles; metric ROUGE-L."""

from __future__ import annotations

from specdistill.tasks.base import Record
from specdistill.tasks.rouge_task import RougeTask


class XSum(RougeTask):
    """Prompt: the article, then the instruction (so that left truncation of long articles keeps it)."""

    name = "xsum"
    required_columns = ("document", "summary", "id")
    default_path = "EdinburghNLP/xsum"
    default_config_name = None

    def prompt(self, record: Record) -> str:
        return f"{record['document']}\n\nSummarize the above article in one sentence.\n"

    def answer(self, record: Record) -> str:
        return record["summary"]

"""CNN/DailyMail (abisee/cnn_dailymail, config 3.0.0): news highlights; metric ROUGE-L."""

from __future__ import annotations

from specdistill.tasks.base import Record
from specdistill.tasks.rouge_task import RougeTask


class CNNDailyMail(RougeTask):
    """Prompt: the article, then the instruction (so that left truncation of long articles keeps it)."""

    name = "cnn_dailymail"
    required_columns = ("article", "highlights", "id")
    default_path = "abisee/cnn_dailymail"
    default_config_name = "3.0.0"

    def prompt(self, record: Record) -> str:
        return f"{record['article']}\n\nWrite the highlights of the above article.\n"

    def answer(self, record: Record) -> str:
        return record["highlights"]

"""Tasks: where records come from and how they become prompts, answers and scores (one module per task)."""

from specdistill.tasks.base import SPLITS, Task, TaskDataError

__all__ = ["SPLITS", "Task", "TaskDataError"]

"""Shared base of code tasks (MBPP, HumanEval): pass@1 by running the program with its tests, only on opt-in."""

from __future__ import annotations

import re

from specdistill.tasks.base import Record, Task
from specdistill.tasks.code_execution import SANDBOX_MODES, CodeExecutionDisabledError, run_python

_FENCE = re.compile(r"```[^\n]*\n(.*?)(?:```|$)", re.DOTALL)


def strip_code_fence(text: str) -> str:
    """The body of the first Markdown code block, or the text itself when it has none."""
    found = _FENCE.search(text)
    return found.group(1) if found else text


class CodeTask(Task):
    """A task scored by running generated code against the record's tests (greedy pass@1: 1.0 or 0.0 each).

    Generated code runs only when the user opts in with `execute_code=true`, in the sandbox `sandbox` names (see
    `specdistill.tasks.code_execution`: own namespaces and file system, no network, resource limits). Without it `scoring_available` is False, so evaluation
    reports the metric as unavailable, and `score` raises `CodeExecutionDisabledError` rather than inventing a value.

    Args:
        execute_code: allow running generated code to compute pass@1.
        timeout_s: wall-clock limit per program.
        memory_limit_mb: address-space limit per program (None: no limit).
        sandbox: "namespaces" (isolated; refused where the machine does not allow it) or "process" (only rlimits
            and a timeout: the explicit weaker mode).
        **kwargs: `Task` arguments.
    """

    metric_name = "pass@1"

    def __init__(
        self,
        execute_code: bool = False,
        timeout_s: float = 10.0,
        memory_limit_mb: int | None = 2048,
        sandbox: str = "namespaces",
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be positive.")
        self.execute_code = bool(execute_code)
        self.timeout_s = float(timeout_s)
        self.memory_limit_mb = memory_limit_mb
        if sandbox not in SANDBOX_MODES:
            raise ValueError(f"sandbox={sandbox!r}; use one of {list(SANDBOX_MODES)}.")
        self.sandbox = sandbox

    @property
    def scoring_available(self) -> bool:
        return self.execute_code

    def program(self, completion: str, record: Record) -> str:
        """The full program (solution + tests) that must exit with status 0 for the completion to pass."""
        raise NotImplementedError

    def score(self, generated_text: str, record: Record) -> float:
        if not self.execute_code:
            raise CodeExecutionDisabledError(
                f"Scoring {self.name} runs model-generated code, which is off by default. Set "
                f"task.execute_code=true to run it in a sandbox (own namespaces and file system, no network, a "
                f"{self.timeout_s:g}s timeout), or skip the task metric (task.scoring_available is False)."
            )
        program = self.program(self.extract_answer(generated_text) or "", record)
        return float(run_python(program, self.timeout_s, self.memory_limit_mb, sandbox=self.sandbox).passed)

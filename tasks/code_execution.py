"""Running generated Python in a subprocess with a timeout (MBPP / HumanEval pass@1).

This is isolation against accidents (infinite loops, crashes, runaway memory, stray files in the working
directory), not a security sandbox: only execute model output you are willing to run on this machine. That is why
code tasks execute nothing unless the user sets `task.execute_code=true`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# applied inside the child before the program runs: cap its address space (Linux/macOS only)
_PREAMBLE = """\
try:
    import resource as _r

    _r.setrlimit(_r.RLIMIT_AS, ({limit}, {limit}))
    del _r
except (ImportError, ValueError, OSError):
    pass
"""


class CodeExecutionDisabledError(RuntimeError):
    """A code task was asked to score (run) generated code without the user's opt-in."""


@dataclass(frozen=True)
class ExecutionResult:
    """Outcome of one program: passed means exit status 0 within the time limit."""

    passed: bool
    timed_out: bool
    returncode: int | None
    stderr_tail: str


def run_python(program: str, timeout_s: float = 10.0, memory_limit_mb: int | None = 2048) -> ExecutionResult:
    """Run `program` with this Python interpreter in a fresh temporary directory and process group.

    The child runs isolated (`python -I`: no user site, no PYTHON* variables), with a minimal environment, stdout
    discarded and the tail of stderr kept; on timeout the whole process group is killed.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be positive.")
    preamble = _PREAMBLE.format(limit=memory_limit_mb * 2**20) if memory_limit_mb else ""
    env = {
        "PATH": os.environ.get("PATH", ""),
        "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": "1",
        "LC_ALL": "C.UTF-8",
    }
    with tempfile.TemporaryDirectory(prefix="specdistill-exec-") as tmp:
        script = Path(tmp) / "program.py"
        script.write_text(preamble + program)
        with open(Path(tmp) / "stderr.txt", "w+b") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", str(script)],
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,  # own process group, so a timeout kills its children too
            )
            try:
                returncode: int | None = proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                returncode, timed_out = None, True
            stderr.seek(0, os.SEEK_END)
            size = stderr.tell()
            stderr.seek(max(0, size - 2000))
            tail = stderr.read().decode(errors="replace")
    return ExecutionResult(passed=returncode == 0 and not timed_out, timed_out=timed_out, returncode=returncode,
                           stderr_tail=tail)  # fmt: skip

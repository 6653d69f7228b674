"""Running generated Python (MBPP / HumanEval pass@1) in a sandbox, only when the user opts in.

`sandbox="namespaces"` (the default) runs each program under `unshare` in its own user, pid, mount and network
namespaces:

- an empty environment, and a fresh `/proc` that shows only the program's own processes (not the parent's
  `environ`, tokens included);
- its own file system, in the way bubblewrap or nsjail build one: a new read-only root holding only what Python needs
  (`read_only_paths()`: the Python installation, the system libraries, `/dev/null` and the random devices) and, at
  `/sandbox`, the program's own temporary folder, the one writable place. Nothing else of the machine is there:
  `/etc/passwd`, the user's home, runs, checkpoints and credentials can be neither read nor written (the machine's
  other top-level folders show as empty folders nobody may enter). All capabilities are dropped before the program
  starts (it cannot remount anything or leave its root), no new user namespaces, `no_new_privs`;
- no network (a new network namespace holds only a down loopback);
- resource limits: processes (`RLIMIT_NPROC`, and the namespace's own `pid_max`: 300 at most), file size, address
  space, CPU time, open files, no core files;
- the namespace's init is the program: when it ends, pass or fail, or is killed on timeout, the kernel kills every
  process left in the namespace (background or `setsid()` children included).

Where the machine does not allow this (user namespaces disabled, or neither process limit applies), scoring is
refused (`SandboxUnavailableError`) unless the user names the weaker mode: `sandbox="process"` runs the program as
an ordinary child with the same rlimits, an empty environment and a process-group kill, but it can read and write
what the user can, use the network, read other processes' `/proc` entries, and a child that calls `setsid()`
escapes the kill.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specdistill.errors import ConfigError, UserError

SANDBOX_MODES = ("namespaces", "process")
SANDBOX_FAILED = 125  # the bootstrap could not build the sandbox; the program did not run
SANDBOX_FOLDER = "/sandbox"  # where the program's own folder (its working directory) is, inside the sandbox
_BOOTSTRAP = Path(__file__).with_name("sandbox_bootstrap.py")
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


class CodeExecutionDisabledError(RuntimeError):
    """A code task was asked to score (run) generated code without the user's opt-in."""


class SandboxUnavailableError(UserError, RuntimeError):
    """The sandbox the user asked for cannot be built on this machine."""


@dataclass(frozen=True)
class Limits:
    """Per-program resource limits (setrlimit) and the wall-clock timeout."""

    timeout_s: float = 10.0
    memory_mb: int | None = 2048  # address space
    cpu_time_s: int | None = None  # None: the timeout, rounded up
    file_size_mb: int = 16
    max_processes: int = 64
    open_files: int = 256

    def rlimits(self) -> dict[str, int]:
        cpu = self.cpu_time_s if self.cpu_time_s is not None else int(self.timeout_s) + 1
        limits = {
            "RLIMIT_CPU": cpu,
            "RLIMIT_FSIZE": self.file_size_mb * 2**20,
            "RLIMIT_NPROC": self.max_processes,
            "RLIMIT_NOFILE": self.open_files,
            "RLIMIT_CORE": 0,
        }
        if self.memory_mb:
            limits["RLIMIT_AS"] = self.memory_mb * 2**20
        return limits


@dataclass(frozen=True)
class ExecutionResult:
    """Outcome of one program: passed means exit status 0 within the time limit."""

    passed: bool
    timed_out: bool
    returncode: int | None
    stderr_tail: str


def check_sandbox(mode: str) -> None:
    """Raise unless programs can run in `mode` here (ConfigError for an unknown mode)."""
    if mode not in SANDBOX_MODES:
        raise ConfigError(f"task.sandbox={mode!r}; use one of {list(SANDBOX_MODES)}.")
    if mode == "namespaces":
        reason = namespaces_unavailable()
        if reason:
            raise SandboxUnavailableError(
                f"cannot isolate generated code on this machine ({reason}), so it is not run. Run where user "
                "namespaces are allowed (unshare --user works), or set task.sandbox=process to run it with only "
                "rlimits and a timeout: it could then read and write your files, use the network and outlive the "
                "timeout."
            )


def read_only_paths() -> list[str]:
    """The machine's paths a sandboxed program sees (read-only, at the same place): what this Python needs to run.

    The system folders (`/usr`, `/lib*`, `/bin`, the dynamic loader's cache), this interpreter's installation
    (`sys.prefix` and, for a virtual environment, the one it was made from: the standard library and site-packages)
    and a few device nodes. Nothing of `/etc` but `ld.so.cache`, nothing of `/home`, `/root` or `/tmp` but the
    Python installation itself when it lives there (pyenv, a virtual environment).
    """
    python = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    python.add(os.path.dirname(os.path.realpath(sys.executable)))
    return [*_SYSTEM_PATHS, *sorted(python), *_DEVICES]


@functools.cache
def namespaces_unavailable() -> str | None:
    """Why the namespace sandbox cannot run here (None: it can); probed once by running an empty program in it."""
    if shutil.which("unshare") is None:
        return "the unshare command (util-linux) is not installed"
    try:
        result = run_python("pass", 30.0, sandbox="namespaces", _probe=True)
    except OSError as error:
        return f"unshare failed to start: {error}"
    if result.passed:
        return None
    return result.stderr_tail.strip().splitlines()[-1] if result.stderr_tail.strip() else "unshare failed"


def run_python(
    program: str,
    timeout_s: float = 10.0,
    memory_limit_mb: int | None = 2048,
    sandbox: str = "namespaces",
    limits: Limits | None = None,
    _probe: bool = False,
) -> ExecutionResult:
    """Run `program` with this Python interpreter in a fresh temporary folder, in the sandbox `sandbox` names.

    Args:
        program: the Python source (solution and tests).
        timeout_s: wall-clock limit (also the CPU-time limit, rounded up).
        memory_limit_mb: address-space limit (None: none).
        sandbox: "namespaces" (isolated; refused where unavailable) or "process" (the explicit weaker mode).
        limits: every limit at once (replaces `timeout_s` and `memory_limit_mb`).

    Raises:
        SandboxUnavailableError: `sandbox="namespaces"` cannot be built here.
    """
    limits = limits or Limits(timeout_s=float(timeout_s), memory_mb=memory_limit_mb)
    if limits.timeout_s <= 0:
        raise ValueError(f"timeout_s={limits.timeout_s} must be positive.")
    if sandbox not in SANDBOX_MODES:
        raise ConfigError(f"sandbox={sandbox!r}; use one of {list(SANDBOX_MODES)}.")
    if sandbox == "namespaces" and not _probe:
        check_sandbox(sandbox)
    with tempfile.TemporaryDirectory(prefix="specdistill-exec-") as tmp:
        work = Path(tmp) / "work"  # the program's only writable folder; stderr is kept outside it
        work.mkdir()
        root = Path(tmp) / "root"  # where the bootstrap mounts the program's root file system
        root.mkdir()
        script = work / "program.py"
        script.write_text(program)
        with open(Path(tmp) / "stderr.txt", "w+b") as stderr:
            if sandbox == "namespaces":
                command = [
                    shutil.which("unshare") or "unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount",
                    "--net", "--mount-proc", "--kill-child=SIGKILL", "--", sys.executable, "-I", "-B",
                    str(_BOOTSTRAP), json.dumps({"work": str(work), "root": str(root), "inside": SANDBOX_FOLDER,
                                                 "read_only": read_only_paths(), "outer_uid": os.getuid(),
                                                 "python": sys.executable, "rlimits": limits.rlimits()}),
                ]  # fmt: skip
                preexec = None
            else:
                command = [sys.executable, "-I", "-B", str(script)]
                preexec = functools.partial(_apply_rlimits, limits.rlimits())
            proc = subprocess.Popen(
                command,
                cwd=work,
                env={},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,  # own process group: the kill below reaches everything outside a namespace
                preexec_fn=preexec,
            )
            try:
                returncode: int | None = proc.wait(timeout=limits.timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                returncode, timed_out = None, True
            # pass or fail, nothing the program started may outlive it (in a namespace the kernel sees to it)
            _kill_group(proc.pid)
            proc.wait()
            stderr.seek(0, os.SEEK_END)
            size = stderr.tell()
            stderr.seek(max(0, size - 2000))
            tail = stderr.read().decode(errors="replace")
    if returncode == SANDBOX_FAILED and "specdistill-sandbox:" in tail:
        if _probe:
            return ExecutionResult(False, False, returncode, tail)
        raise SandboxUnavailableError(f"the sandbox could not be built: {tail.strip().splitlines()[-1]}")
    return ExecutionResult(passed=returncode == 0 and not timed_out, timed_out=timed_out, returncode=returncode,
                           stderr_tail=tail)  # fmt: skip


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _apply_rlimits(limits: dict[str, int]) -> None:
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an over-large write fails with EFBIG instead of killing

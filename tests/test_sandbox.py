"""Generated code in the sandbox (tasks/code_execution.py): each hostile behaviour a model's program could have."""

from __future__ import annotations

import os
import socket
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from specdistill.errors import ConfigError
from specdistill.tasks import code_execution
from specdistill.tasks.code_execution import (
    Limits,
    SandboxUnavailableError,
    check_sandbox,
    namespaces_unavailable,
    run_python,
)

isolated = pytest.mark.skipif(
    namespaces_unavailable() is not None, reason=f"no namespace sandbox here: {namespaces_unavailable()}"
)


def program(source: str) -> str:
    return textwrap.dedent(source)


def processes_with(marker: str) -> list[int]:
    """Pids (seen from here) whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def sleeper(marker: str) -> str:
    """Python source that replaces the current process with a 60 s sleep carrying `marker` on its command line."""
    return f"os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])"


@isolated
def test_sandbox_child_cannot_read_the_parents_environment(monkeypatch):
    secret = f"hf_{uuid.uuid4().hex}"
    monkeypatch.setenv("HF_TOKEN", secret)
    result = run_python(
        program(f"""
        import os, sys
        assert set(os.environ) <= {{'LC_CTYPE'}}, dict(os.environ)  # Python's own C-locale coercion (PEP 538)
        for pid in [os.getppid(), *[p for p in os.listdir('/proc') if p.isdigit()]]:
            try:
                data = open(f'/proc/{{pid}}/environ', 'rb').read()
            except OSError:
                continue
            assert {secret!r}.encode() not in data, pid
        # the parent is not even visible: the program is pid 1 of its own namespace
        assert os.getpid() == 1 and sorted(p for p in os.listdir('/proc') if p.isdigit()) == ['1']
    """)
    )
    assert result.passed, result.stderr_tail


@isolated
def test_sandbox_background_process_of_a_passing_program_is_killed():
    marker = f"specdistill-bg-{uuid.uuid4().hex}"
    result = run_python(
        program(f"""
        import os, sys
        if os.fork() == 0:
            {sleeper(marker)}
    """)
    )
    assert result.passed, result.stderr_tail
    time.sleep(0.2)
    assert processes_with(marker) == []


@isolated
def test_sandbox_setsid_child_does_not_survive_the_timeout():
    marker = f"specdistill-setsid-{uuid.uuid4().hex}"
    result = run_python(
        program(f"""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()
            {sleeper(marker)}
        while True:
            time.sleep(1)
    """),
        timeout_s=2,
    )
    assert result.timed_out and not result.passed
    time.sleep(0.2)
    assert processes_with(marker) == []


@isolated
def test_sandbox_fork_bomb_hits_the_process_limit():
    # passes only if fork fails before 400 processes exist; the children sleep, so they all coexist
    result = run_python(
        program("""
        import os, sys, time
        for n in range(400):
            try:
                pid = os.fork()
            except OSError:
                sys.exit(0)
            if pid == 0:
                time.sleep(30)
                os._exit(0)
        sys.exit(1)
    """),
        limits=Limits(timeout_s=20, max_processes=32),
    )
    assert result.passed, result.stderr_tail


def write_attempts(target: Path, new: Path, escaped: Path) -> str:
    """A program that exits 0 only if every write outside its folder fails, as the sandbox makes it fail: on the
    read-only view (EROFS, or EACCES/EPERM) or because the path is not shown at all (ENOENT: e.g. under a Python
    installed in /tmp, such as a virtual environment, /tmp holds only that installation). An ENOENT counts only when
    the folder the write needs is not visible either, so a file that is there cannot pass as missing."""
    return program(f"""
        import errno, os
        for path, attempt in [({str(target)!r}, lambda path: open(path, 'wb')), ({str(new)!r}, lambda path: open(path, 'w')),
                              ({str(target)!r}, os.remove), ({str(escaped)!r}, lambda path: open(path, 'w'))]:
            try:
                attempt(path)
            except OSError as error:
                if error.errno == errno.ENOENT:
                    assert not os.path.exists(os.path.dirname(path)), (path, error)
                else:
                    assert error.errno in (errno.EROFS, errno.EACCES, errno.EPERM), (path, error)
            else:
                raise SystemExit(f'wrote outside its folder: {{path}}')
        open('inside.txt', 'w').write('ok')  # its own folder stays writable
        assert open('inside.txt').read() == 'ok'
    """)


@isolated
def test_sandbox_cannot_write_outside_its_folder(tmp_path):
    runs = {}
    for mode in ("namespaces", "process"):
        folder = tmp_path / mode
        target = folder / "export" / "model.safetensors"
        target.parent.mkdir(parents=True)
        target.write_bytes(b"weights")
        os.chmod(folder, 0o777)
        os.chmod(target.parent, 0o777)
        os.chmod(target, 0o666)  # the permissions allow it: only the sandbox's view of the files stops it
        escaped = Path("/tmp") / f"specdistill-escaped-{uuid.uuid4().hex}"
        runs[mode] = run_python(write_attempts(target, folder / "new.txt", escaped), sandbox=mode)
        if mode == "namespaces":
            assert runs[mode].passed, runs[mode].stderr_tail
            assert target.read_bytes() == b"weights" and os.listdir(target.parent) == ["model.safetensors"]
            assert os.listdir(folder) == ["export"] and not escaped.exists()
    # the same program without the namespace sandbox writes: only the sandbox made the writes fail
    assert not runs["process"].passed and "wrote outside its folder" in runs["process"].stderr_tail
    assert (tmp_path / "process" / "export" / "model.safetensors").read_bytes() == b""


@isolated
def test_sandbox_cannot_remount_the_file_system_writable(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("intact")
    os.chmod(victim, 0o666)
    result = run_python(
        program(f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        MS_REMOUNT, MS_BIND = 32, 4096
        for point in ['/', {str(tmp_path)!r}]:
            assert libc.mount(None, point.encode(), None, ctypes.c_ulong(MS_REMOUNT | MS_BIND), None) != 0
        status = open('/proc/self/status').read()
        assert 'CapEff:\\t0000000000000000' in status, status
        try:
            open({str(victim)!r}, 'w').write('overwritten')
        except OSError:
            pass
    """)
    )
    assert result.passed, result.stderr_tail
    assert victim.read_text() == "intact"


@isolated
def test_sandbox_big_file_hits_the_file_size_limit():
    result = run_python(
        program("""
        import errno
        try:
            with open('big.bin', 'wb') as f:
                for _ in range(64):
                    f.write(b'x' * 2**20)
        except OSError as error:
            assert error.errno == errno.EFBIG, error
        else:
            raise SystemExit('wrote 64 MiB')
    """),
        limits=Limits(timeout_s=20, file_size_mb=4),
    )
    assert result.passed, result.stderr_tail


@isolated
def test_sandbox_has_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        result = run_python(
            program(f"""
            import socket
            try:
                socket.create_connection(('127.0.0.1', {port}), timeout=2)
            except OSError:
                pass
            else:
                raise SystemExit('reached the host network')
        """),
            timeout_s=10,
        )
        assert result.passed, result.stderr_tail
        server.settimeout(0.1)
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


@isolated
def test_sandbox_memory_and_cpu_time_are_limited():
    memory = run_python("x = bytearray(1 << 30)", limits=Limits(timeout_s=20, memory_mb=256))
    assert not memory.passed and "MemoryError" in memory.stderr_tail
    started = time.monotonic()
    spin = run_python("while True:\n    pass", limits=Limits(timeout_s=30, cpu_time_s=1))
    assert not spin.passed and not spin.timed_out and time.monotonic() - started < 15


def test_sandbox_refused_where_no_isolation_is_available(monkeypatch):
    monkeypatch.setattr(code_execution, "namespaces_unavailable", lambda: "user namespaces are disabled")
    with pytest.raises(SandboxUnavailableError, match=r"user namespaces are disabled.*task\.sandbox=process"):
        run_python("pass")
    with pytest.raises(SandboxUnavailableError):
        check_sandbox("namespaces")
    check_sandbox("process")  # the weaker mode is the user's explicit choice
    assert run_python("import os; assert set(os.environ) <= {'LC_CTYPE'}", sandbox="process").passed
    with pytest.raises(ConfigError, match="sandbox='docker'"):
        check_sandbox("docker")


def read_attempts(paths: list[Path | str]) -> str:
    """A program that exits 0 only if reading every path in `paths` fails."""
    return program(f"""
        for path in {[str(p) for p in paths]!r}:
            try:
                open(path, 'rb').read()
            except OSError:
                continue
            raise SystemExit(f'could read {{path}}')
    """)


@isolated
def test_sandbox_cannot_read_the_machines_or_the_users_files(tmp_path, monkeypatch):
    run_dir = (
        tmp_path / "runs" / "sft"
    )  # a run folder of the user evaluating, outside the program's own folder
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.json").write_text('{"secret": 1}')
    home = tmp_path / "home"
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text("hf_secret")
    monkeypatch.setenv("HOME", str(home))
    assert Path("/etc/passwd").is_file()
    targets = ["/etc/passwd", run_dir / "metrics.json", Path.home() / ".cache" / "huggingface" / "token"]
    result = run_python(read_attempts(targets))
    assert result.passed, result.stderr_tail
    # the same program in the weaker mode reads them all: only the namespace sandbox hides them
    assert not run_python(read_attempts(targets), sandbox="process").passed


@isolated
def test_sandbox_sees_only_what_python_needs():
    result = run_python(
        program(f"""
        import hashlib, json, math, os, random, re, sys
        assert os.getcwd() == {code_execution.SANDBOX_FOLDER!r} and os.listdir('.') == ['program.py']
        assert sorted(os.listdir('/etc')) == ['ld.so.cache'], os.listdir('/etc')
        assert os.path.realpath(sys.executable).startswith(tuple({code_execution.read_only_paths()!r}))
        open('/dev/null', 'w').write('discarded')
        assert len(os.urandom(8)) == 8 and hashlib.sha256(b'x').hexdigest()
    """)
    )
    assert result.passed, result.stderr_tail


@isolated
def test_canonical_solutions_still_pass_in_the_sandbox():
    from tests.test_tasks import compose_task, data_files_override

    mbpp = compose_task("mbpp", data_files_override("mbpp"), "execute_code=true", "timeout_s=10")
    records = [r for split in ("train", "validation", "test") for r in mbpp.load_split(split)]
    assert records and [mbpp.score(mbpp.answer(r), r) for r in records] == [1.0] * len(records)
    humaneval = compose_task("humaneval", data_files_override("humaneval"), "execute_code=true")
    records = humaneval.load_split("test")
    assert records and [humaneval.score(humaneval.answer(r), r) for r in records] == [1.0] * len(records)
    # a correct solution that also reads the user's files fails: the read raises
    record = humaneval.load_split("test")[1]
    snooping = "    open('/etc/passwd').read()\n" + humaneval.answer(record)
    assert humaneval.score(snooping, record) == 0.0

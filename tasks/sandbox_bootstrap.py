"""Runs inside the new namespaces (see `tasks/code_execution.py`), as their init: seal the view, then exec the program.

Standard library only (started with `python -I`). On any failure to build the sandbox it prints
`specdistill-sandbox: <reason>` and exits with 125 before the program runs: fail closed, never run half-isolated.
"""

import ctypes
import json
import os
import resource
import signal
import sys

SANDBOX_FAILED = 125
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC = 32, 4096, 16384
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
ST_RELATIME = 4096  # statvfs reports relatime with another bit than mount takes
KEEP = MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_SET_SECUREBITS = 38, 24, 28
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
# SECBIT_NOROOT (+locked), SECBIT_NO_SETUID_FIXUP (+locked), SECBIT_KEEP_CAPS_LOCKED, SECBIT_NO_CAP_AMBIENT_RAISE (+locked)
SECUREBITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80

libc = ctypes.CDLL(None, use_errno=True)


def fail(reason):
    print(f"specdistill-sandbox: {reason}", file=sys.stderr, flush=True)
    os._exit(SANDBOX_FAILED)


def mount(source, target, flags):
    if libc.mount(source, target.encode(), None, ctypes.c_ulong(flags), None) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), target)


def mountpoints():
    points = []
    with open("/proc/self/mountinfo") as info:
        for line in info:
            field = line.split()[4]
            points.append(field.encode().decode("unicode_escape"))  # mountinfo escapes spaces as \040
    return points


def set_sysctl(path, value):
    try:
        with open(path, "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


def main():
    spec = json.loads(sys.argv[1])
    work = spec["work"]
    # at most 300 processes in this pid namespace (kernels >= 6.14); no nested user namespaces
    pid_max = set_sysctl("/proc/sys/kernel/pid_max", "301")
    set_sysctl("/proc/sys/user/max_user_namespaces", "0")
    if not pid_max and spec["outer_uid"] == 0:
        fail(
            "no process limit applies: RLIMIT_NPROC does not bind root and this kernel has no per-namespace pid_max"
        )
    try:
        mount(work.encode(), work, MS_BIND | MS_REC)  # the one writable mount
        for point in mountpoints():
            if point == work or point.startswith(work + "/"):
                continue
            try:
                current = os.statvfs(point).f_flag
            except OSError:
                continue  # shadowed or gone: not reachable by path
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY | (current & KEEP)
            flags |= MS_RELATIME if current & ST_RELATIME else 0
            try:
                mount(None, point, flags)
            except OSError as error:
                if not os.statvfs(point).f_flag & MS_RDONLY:
                    raise error
    except OSError as error:
        fail(f"cannot make the file system read-only ({error})")
    for name, value in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an over-large write fails with EFBIG instead of killing
    # drop every capability for good: the program runs as uid 0 of this namespace and must not regain them on exec
    if (
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
        or libc.prctl(PR_SET_SECUREBITS, SECUREBITS, 0, 0, 0) != 0
    ):
        fail(f"cannot drop privileges ({os.strerror(ctypes.get_errno())})")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    os.chdir(work)
    os.execve(spec["python"], [spec["python"], "-I", "-B", os.path.join(work, "program.py")], {})


if __name__ == "__main__":
    main()

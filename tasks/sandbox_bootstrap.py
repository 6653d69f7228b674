"""Runs inside the new namespaces (see `tasks/code_execution.py`), as their init: build the view, then exec the program.

The program's file system is a new read-only root (a tmpfs, entered with `pivot_root`, the old root detached) that
holds only the paths the parent lists read-only (the Python installation, system libraries, a few device nodes) and
the program's own folder, writable, at `inside`. Every other top-level folder of the machine shows as an empty folder
nobody may enter, so `/etc/passwd`, the user's home, runs and credentials are neither readable nor writable.

Standard library only (started with `python -I`). On any failure to build the sandbox it prints
`specdistill-sandbox: <reason>` and exits with 125 before the program runs: fail closed, never run half-isolated.
"""

import ctypes
import json
import os
import platform
import resource
import signal
import sys

SANDBOX_FAILED = 125
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = {
    "x86_64": 155,
    "aarch64": 41,
    "riscv64": 41,
    "ppc64le": 203,
    "s390x": 217,
}  # glibc has no wrapper
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


def mount(source, target, flags, fstype=None, data=None):
    if libc.mount(source, target.encode(), fstype, ctypes.c_ulong(flags), data) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), target)


def resolve(root, path):
    """Copy the host symlinks on the way to `path` under `root` (creating the folders between) and follow them.

    Returns:
        The real path to bind-mount at the same path under `root`.
    """
    parts = path.strip("/").split("/")
    current = ""
    for index, part in enumerate(parts):
        current += "/" + part
        inside = root + current
        if os.path.islink(current):
            if not os.path.lexists(inside):
                os.symlink(os.readlink(current), inside)
            rest = "/".join(parts[index + 1 :])
            return resolve(root, os.path.join(os.path.realpath(current), rest).rstrip("/"))
        if index < len(parts) - 1 and not os.path.lexists(inside):
            os.mkdir(inside, 0o755)
    return current


def bind(root, path):
    """Bind-mount host `path` (a folder, or a file such as a device node) at the same path under `root`."""
    inside = root + path
    if os.path.isdir(path):
        os.makedirs(inside, 0o755, exist_ok=True)
    elif not os.path.lexists(inside):
        open(inside, "wb").close()  # a mount point for a file
    mount(path.encode(), inside, MS_BIND | MS_REC)


def build_root(spec):
    """Mount the program's root at `spec["root"]`: a tmpfs with the read-only paths, its folder and /proc."""
    root = spec["root"]
    mount(b"none", "/", MS_REC | MS_PRIVATE)  # nothing mounted here propagates back to the machine
    mount(b"tmpfs", root, MS_NOSUID | MS_NODEV, b"tmpfs", b"mode=0755,size=1m,nr_inodes=4096")
    real = {resolve(root, path) for path in spec["read_only"] if os.path.lexists(path)}
    bound = []
    for path in sorted(real):  # a folder before what lies inside it, which its mount already shows
        if not any(path == done or path.startswith(done + "/") for done in bound):
            bind(root, path)
            bound.append(path)
    inside = root + spec["inside"]
    os.makedirs(inside, 0o755, exist_ok=True)
    mount(spec["work"].encode(), inside, MS_BIND | MS_REC)
    os.makedirs(root + "/proc", 0o555, exist_ok=True)
    mount(b"/proc", root + "/proc", MS_BIND | MS_REC)  # this pid namespace's own /proc (unshare --mount-proc)
    # the machine's other top-level folders: present but closed (mode 000), so a path into them fails with EACCES
    for name in os.listdir("/"):
        if (
            os.path.isdir("/" + name)
            and not os.path.islink("/" + name)
            and not os.path.lexists(f"{root}/{name}")
        ):
            os.mkdir(f"{root}/{name}", 0)
            os.chmod(f"{root}/{name}", 0)


def enter_root(root):
    """pivot_root into `root` and detach the old root: nothing of the machine stays reachable by path."""
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(0, f"pivot_root's system call number is unknown on {platform.machine()}", root)
    os.chdir(root)
    if libc.syscall(ctypes.c_long(number), b".", b".") != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), "pivot_root")
    if libc.umount2(b".", MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), "umount of the old root")
    os.chdir("/")


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
    # at most 300 processes in this pid namespace (kernels >= 6.14); no nested user namespaces
    pid_max = set_sysctl("/proc/sys/kernel/pid_max", "301")
    set_sysctl("/proc/sys/user/max_user_namespaces", "0")
    if not pid_max and spec["outer_uid"] == 0:
        fail(
            "no process limit applies: RLIMIT_NPROC does not bind root and this kernel has no per-namespace pid_max"
        )
    try:
        build_root(spec)
        enter_root(spec["root"])
    except OSError as error:
        fail(f"cannot build the program's file system ({error})")
    work = spec["inside"]
    try:
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

"""Outputs a later step reads appear whole or not at all: written into a temporary sibling, synced, renamed into place.

A job killed mid-write (`kill -9`, preemption, an out-of-memory kill) or a disk that fills up leaves at most a
temporary sibling (`<name>.tmp-<host>-<pid>`), never a half-written `<name>`: a reader sees the previous version or the new
one, complete.

- `atomic_file(path)` yields `<name>.tmp-<host>-<pid>` to write into (any writer that takes a path: `torch.save`,
  safetensors, matplotlib); on success its data is synced to disk and it is renamed over `path` (`os.replace`, atomic:
  a reader opening `path` gets the old file or the new one). `atomic_write_text` / `atomic_write_bytes` use it.
- `atomic_directory(path)` yields an empty `<name>.tmp-<host>-<pid>` folder to fill (an export, a `datasets` table, a rollout
  shard); on success every file in it is synced and it takes the place of `path`. On Linux the two folders are swapped
  in one step (`renameat2(RENAME_EXCHANGE)`), so `path` always exists and holds the old or the new version; where the
  file system cannot exchange (e.g. some network file systems) the old folder is first renamed to
  `<name>.old-<host>-<pid>`, leaving a window of two renames in which `path` does not exist (never one with a mix of both).
  A writer killed in that window leaves the old folder beside it: the next `atomic_directory(path)` puts it back
  before writing.
- A write that fails because the disk is full (or a quota or file-size limit is hit) removes its temporary sibling and
  raises `DiskFullError` naming the path and the fix; the previous version stays in place, so relaunching after
  freeing space resumes.

A folder has one writer at a time (rank 0, or the rank owning a rollout shard), so `atomic_directory` first removes
the temporary siblings that an earlier, killed writer left behind (`recover`); a file may have several (every rank
writes `result.json`), so `atomic_file` leaves that to its caller (`AtomicCheckpointIO` does it for checkpoints).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from specdistill.errors import DiskFullError

# ENOSPC: the disk is full; EDQUOT: the user's quota is; EFBIG: a file-size limit (ulimit -f, RLIMIT_FSIZE)
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
TMP_MARK = ".tmp-"
OLD_MARK = ".old-"

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def sibling(path: Path, mark: str) -> Path:
    """`<name><mark><host>-<pid>` beside `path`: this process's own (ranks on several nodes may share a pid)."""
    return path.with_name(f"{path.name}{mark}{socket.gethostname()}-{os.getpid()}")


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a folder's entries, to disk (so a rename never publishes data still in memory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """`fsync_path` every file and folder under `root`, and `root` itself."""
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_path(Path(folder) / name)
        fsync_path(Path(folder))


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write; once the block ends it is synced and renamed over `path`.

    Raises:
        DiskFullError: the disk (or a quota, or a file-size limit) was full; `path` is unchanged.
    """
    path = Path(path)
    with _staged(path) as tmp:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """`Path(path).write_text(text)`, atomically (see `atomic_file`); returns the path."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """`Path(path).write_bytes(data)`, atomically (see `atomic_file`); returns the path."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


@contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield an empty temporary folder beside `path` to fill; once the block ends it replaces `path` whole.

    What a reader of `path` sees at each instant is in the module docstring: the old folder or the new one; a full
    disk raises `DiskFullError` as `atomic_file` does.
    """
    path = Path(path)
    with _staged(path) as tmp:
        recover(path)
        tmp.mkdir()
        yield tmp
        fsync_tree(tmp)
        swap_into_place(tmp, path)


@contextmanager
def _staged(path: Path) -> Iterator[Path]:
    """This process's temporary sibling of `path` (its folder created); removed when the block fails, which raises
    `DiskFullError` for `path` on a full disk."""
    tmp = sibling(path, TMP_MARK)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
    except BaseException as error:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise_if_disk_full(error, path)
        raise


def recover(path: Path) -> None:
    """Clean up after a writer of `path` that was killed: put back the old folder it had moved aside (when `path` is
    missing), then remove its temporary siblings."""
    olds = sorted(path.parent.glob(f"{path.name}{OLD_MARK}*"), key=lambda p: p.stat().st_mtime)
    if olds and not path.exists():
        os.rename(olds.pop(), path)
    for leftover in [*olds, *path.parent.glob(f"{path.name}{TMP_MARK}*")]:
        if leftover.is_dir():
            shutil.rmtree(leftover)
        else:
            leftover.unlink()


def swap_into_place(tmp: Path, path: Path) -> None:
    """Make the complete folder `tmp` be `path`, then remove the version it replaced."""
    if not path.exists():
        os.replace(tmp, path)
    elif _exchange(tmp, path):
        shutil.rmtree(tmp)  # now the old version
    else:
        old = sibling(path, OLD_MARK)
        os.rename(path, old)
        os.rename(tmp, path)  # between these two renames `path` does not exist
        shutil.rmtree(old)
    fsync_path(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux `renameat2(RENAME_EXCHANGE)`); False where that is not available."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # a kernel or file system without the flag
        return False
    raise OSError(code, os.strerror(code), str(b))


def is_disk_full(error: BaseException, path: Path) -> bool:
    """Whether `error` (or an error it was raised from) says the disk, a quota or a file-size limit is full.

    Writers in Rust (safetensors) or C++ (torch's archive writer, Arrow) raise their own exception types carrying the
    system's message, so the message is matched too; a writer whose message drops the cause ("file write failed") is
    recognised by the disk's free space.
    """
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in DISK_FULL_ERRNOS:
            return True
        if any(os.strerror(code) in str(seen) for code in DISK_FULL_ERRNOS):
            return True
        seen = seen.__cause__ or seen.__context__
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return os.statvfs(folder).f_bavail == 0
    except OSError:
        return False


def raise_if_disk_full(error: BaseException, path: Path) -> None:
    """Raise `DiskFullError` for `path` from `error` when it is a full disk (see `is_disk_full`)."""
    if isinstance(error, Exception) and not isinstance(error, DiskFullError) and is_disk_full(error, path):
        detail = (str(error).splitlines() or [type(error).__name__])[0]
        raise DiskFullError(
            f"{path} could not be written: the disk is full ({detail}); the previous version, if any, is intact. "
            "Free space on that disk (or raise the quota / `ulimit -f`) and relaunch the same command: it resumes."
        ) from error

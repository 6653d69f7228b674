"""Errors a user can act on: a wrong setting, a missing or unreadable file, bad data, a run folder that is taken.

`train.py` prints such an error as one or two lines (what is wrong, which key or file, how to fix it) and exits with
the error's `exit_code`; `HYDRA_FULL_ERROR=1` shows the full traceback instead. Anything else is a bug or a library
failure and keeps its traceback. Each class also derives from the built-in exception a caller would expect
(`ValueError`, `FileNotFoundError`), so `except ValueError` keeps working.
"""

from __future__ import annotations

# sysexits.h codes, distinct from 1 (a crash) and from PREEMPTED_EXIT_CODE (75, "requeue me")
EX_USAGE = 64  # a setting is wrong
EX_DATAERR = 65  # the data is malformed
EX_NOINPUT = 66  # a file or model is missing or unreadable
EX_CANTCREAT = 73  # the run folder holds another run
EX_IOERR = 74  # an output could not be written (the disk is full)


class UserError(Exception):
    """Something the user can fix; the message names the problem, the key or file, and the fix."""

    exit_code = EX_USAGE


class ConfigError(UserError, ValueError):
    """A setting (a Hydra key) is invalid or read by nothing."""

    exit_code = EX_USAGE


class DataError(UserError, ValueError):
    """A data file or one of its rows is malformed; the message names the file and the row."""

    exit_code = EX_DATAERR


class InputFileError(UserError, FileNotFoundError):
    """A model, checkpoint or data file is missing, incomplete or unreadable."""

    exit_code = EX_NOINPUT


class RunDirConflictError(UserError, ValueError):
    """The run folder holds another run (or another stage's results); nothing was written."""

    exit_code = EX_CANTCREAT


class DiskFullError(UserError, OSError):
    """An output could not be written because the disk, a quota or a file-size limit is full; the previous version
    of that output is intact (`specdistill.utils.atomic`), so relaunching after freeing space resumes."""

    exit_code = EX_IOERR

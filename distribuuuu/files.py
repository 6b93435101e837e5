"""Writing files so that a crash or a reader never sees half of one.

A whole file: a temporary ``<path>.tmp.<pid>`` in the same folder,
flushed and fsync'ed, then renamed over the target (rename is atomic
within a filesystem). A kill can leave the temporary behind: the run
folder's debris, removed by the next run that holds the folder's lock
(run_folder/lock.py). A line added to a log-like file: one write() of
the whole line (O_APPEND), never a partial one. A write that fails for a
cause the user must fix (space, quota, size limit, permissions, a
read-only or vanished folder) raises WriteFailed: one line naming the
file and the cause, exit 2 (``writing``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from typing import BinaryIO

from distribuuuu.errors import UserError

# The causes of a failed write that the user must fix, and what to do
# about each.
_REMEDIES = {
    errno.ENOSPC: "free space there",
    errno.EDQUOT: "free space within your quota",
    errno.EFBIG: "raise the file-size limit (ulimit -f)",
    errno.EACCES: "make its folder writable for this user",
    errno.EPERM: "make its folder writable for this user",
    errno.EROFS: "remount the file system read-write",
    errno.ENOENT: "its folder was removed during the run: leave OUT_DIR in place",
}


class WriteFailed(UserError, OSError):
    """A file could not be written for a cause the user must fix
    (files.writing): one line, exit 2."""


def write_failure(path: str, error: BaseException | None, kept: str = "") -> WriteFailed | None:
    """The OSError of a failed write (error, or the one under it:
    torch's zip writer wraps it) as a WriteFailed naming path, the cause
    and the way out (kept: what the run can go on from); None for any
    other error, and for a stop signal that cut the write short (a stop,
    not a failed write)."""
    while error is not None and not isinstance(error, (OSError, KeyboardInterrupt)):
        error = error.__cause__ or error.__context__
    if not isinstance(error, OSError) or error.errno not in _REMEDIES:
        return None
    failure = WriteFailed(
        f"cannot write {path}: {os.strerror(error.errno)} ({errno.errorcode[error.errno]}); "
        f"{kept + '; ' if kept else ''}{_REMEDIES[error.errno]}, or give another OUT_DIR, and run "
        "the same command again"
    )
    failure.errno = (
        error.errno
    )  # an outer writer (RunFolder.save) may say more about the same failure
    return failure


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """The one place a failed write becomes a WriteFailed (a UserError);
    any other error propagates."""
    try:
        yield
    except Exception as e:
        failure = write_failure(path, e)
        if failure is None:
            raise
        raise failure from e


def atomic_write(path: str, write: Callable[[BinaryIO], object]) -> None:
    """Call write(f) on a temporary file, fsync it, then rename it over
    path: path holds either its old content or all of the new one.
    Whatever write raises propagates (a failed write as WriteFailed),
    and the temporary is gone."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with writing(path):
            with open(tmp, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    finally:  # none made, or a folder that takes no change now: the failed write is what to report
        with contextlib.suppress(OSError):
            os.remove(tmp)


def atomic_link(src: str, dst: str) -> None:
    """Make dst the same content as src atomically: a hard link when the
    filesystem allows, else a copy."""
    tmp = f"{dst}.tmp.{os.getpid()}"
    try:
        with writing(dst):
            try:
                os.link(src, tmp)
            except OSError:
                shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
    finally:  # none made, or a folder that takes no change now: the failed write is what to report
        with contextlib.suppress(OSError):
            os.remove(tmp)


def append(path: str, text: str) -> None:
    """Add text (whole lines) at the end of path, made if needed, in one
    write(): a reader or a kill sees all of it or none of it, never part
    of a line."""
    with writing(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)


def _nearest_existing(path: str) -> str:
    """path, or the nearest of its parents that exists (where a new
    folder would be made)."""
    path = os.path.abspath(path)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def output_problem(path: str, folder: bool) -> str | None:
    """Why path cannot take a tool's output (folder: a folder made if
    needed; else a file whose folder must exist), or None. Checked
    before any work, so that a long export or plot does not end in a
    traceback at its first write."""
    what = "a folder" if folder else "a file"
    if folder and os.path.exists(path) and not os.path.isdir(path):
        return f"{path} is a file, not a folder; give a folder path"
    if not folder and os.path.isdir(path):
        return f"{path} is a folder; give a file path"
    base = _nearest_existing(path if folder else os.path.dirname(os.path.abspath(path)))
    if not os.path.isdir(base):
        return f"{path} cannot be {what}: {base} is a file, not a folder"
    if not folder and base != os.path.dirname(os.path.abspath(path)):
        parent = os.path.dirname(os.path.abspath(path))
        return f"{path}: its folder {parent} does not exist; create it first"
    if not os.access(base, os.W_OK | os.X_OK) or (
        os.path.exists(path) and not os.access(path, os.W_OK)
    ):
        why = f"{base} is read-only for this user"
        return f"{path} is not writable ({why}); give a path you can write to"
    return None

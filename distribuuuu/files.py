"""Writing files so that a crash or a reader never sees half of one.

A whole file: a temporary ``<path>.tmp.<pid>`` in the same folder, flushed and fsync'ed, then renamed
over the target (rename is atomic within a filesystem). A kill can leave the temporary behind: the
run folder's debris, removed by the next run that holds the folder's lock (run_folder/lock.py).
A line added to a log-like file: one write() of the whole line (O_APPEND), never a partial one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from typing import BinaryIO


def atomic_write(path: str, write: Callable[[BinaryIO], object]) -> None:
    """Call write(f) on a temporary file, fsync it, then rename it over path: path holds either its
    old content or all of the new one. Whatever write raises propagates, and the temporary is gone."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def atomic_link(src: str, dst: str) -> None:
    """Make dst the same content as src atomically: a hard link when the filesystem allows, else a copy."""
    tmp = f"{dst}.tmp.{os.getpid()}"
    try:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def append(path: str, text: str) -> None:
    """Add text (whole lines) at the end of path, made if needed, in one write(): a reader or a kill
    sees all of it or none of it, never part of a line."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _nearest_existing(path: str) -> str:
    """path, or the nearest of its parents that exists (where a new folder would be made)."""
    path = os.path.abspath(path)
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def output_problem(path: str, folder: bool) -> str | None:
    """Why path cannot take a tool's output (folder: a folder made if needed; else a file whose
    folder must exist), or None. Checked before any work, so that a long export or plot does not
    end in a traceback at its first write."""
    what = "a folder" if folder else "a file"
    if folder and os.path.exists(path) and not os.path.isdir(path):
        return f"{path} is a file, not a folder; give a folder path"
    if not folder and os.path.isdir(path):
        return f"{path} is a folder; give a file path"
    base = _nearest_existing(path if folder else os.path.dirname(os.path.abspath(path)))
    if not os.path.isdir(base):
        return f"{path} cannot be {what}: {base} is a file, not a folder"
    if not folder and base != os.path.dirname(os.path.abspath(path)):
        return f"{path}: its folder {os.path.dirname(os.path.abspath(path))} does not exist; create it first"
    if not os.access(base, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{path} is not writable ({base} is read-only for this user); give a path you can write to"
    return None

"""The run folder's ownership: one training run per OUT_DIR, and nothing of an earlier run lost.

``distribuuuu train`` owns OUT_DIR while it runs:

- **The lock**, ``OUT_DIR/run.lock`` (lock.py): rank 0 holds it from the process group's start
  to the run's end; a provably stale one is taken over, a live holder refused with exit status 2.
- **Before any process group** (``preflight``, in the spawner parent and in every rank) the
  read-only checks that every rank decides alike: OUT_DIR is a folder, OUT_DIR and
  OUT_DIR/checkpoints accept a new file (probed by really writing one: os.access lies for root
  and on network filesystems), no live holder, and with TRAIN.AUTO_RESUME False no earlier run.
- **Once the lock is held** (``owned``), which proves no other writer is live in the folder:
  temporaries of killed checkpoint writes (``*.pth.tmp.<pid>``) are removed, and records of an
  earlier run that left no checkpoint are moved aside (``set_aside_records``) instead of being
  appended to.

``eval`` takes no lock (it only reads checkpoints); it gets the folder checks only.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from typing import Any

from distribuuuu.errors import UserError
from distribuuuu.run_folder.checkpoint import peek
from distribuuuu.run_folder.layout import BEST, LAST, METRICS, METRICS_FILES, checkpoint_dir
from distribuuuu.run_folder.lock import check_not_busy

log = logging.getLogger("distribuuuu")

# Temporaries of files.atomic_write / atomic_link (and of the lock itself): <name>.tmp.<pid>
_DEBRIS = re.compile(r"\.tmp\.\d+$")
_LOCK_DEBRIS = re.compile(r"^run\.lock\.(tmp|stale)\.\d+$")


# ---------------------------------------------------------------------------------------------
# What the folder holds
# ---------------------------------------------------------------------------------------------
def _count_records(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def _checkpoint_summary(ckpt_dir: str) -> list[str]:
    """Short descriptions of the checkpoints in ckpt_dir: "last.pth at epoch 5 (step 40)", "3 epoch_*.pth"."""
    try:
        names = sorted(os.listdir(ckpt_dir))
    except OSError:
        return []
    saved = [n for n in names if (n.endswith(".pth") or n.endswith(".dcp")) and not _DEBRIS.search(n)]
    parts = []
    if LAST in saved:
        parts.append(LAST + _progress_of(os.path.join(ckpt_dir, LAST)))
    if BEST in saved:
        parts.append(BEST)
    for kind in ("epoch", "step"):
        count = sum(1 for n in saved if n.startswith(f"{kind}_") and n.endswith(".pth"))
        if count:
            parts.append(f"{count} {kind}_*.pth")
    numbered = re.compile(r"(epoch|step)_\d+\.(pth|dcp)$")
    parts += [n for n in saved if n not in (LAST, BEST) and not numbered.match(n)][:3]
    return parts


def _progress_of(path: str) -> str:
    """" at epoch E (step S)" from the checkpoint's counters, or "" when it cannot be read."""
    try:
        ckpt = peek(path)
        return f" at epoch {ckpt['epoch']} (step {ckpt['global_step']})"
    except Exception:  # noqa: BLE001 - a description only: an unreadable file is still a run's file
        return " (unreadable)"


def existing_run(out_dir: str) -> str | None:
    """What an earlier run left in OUT_DIR (checkpoints, metrics records), or None if nothing."""
    parts = _checkpoint_summary(checkpoint_dir(out_dir))
    records = _count_records(os.path.join(out_dir, METRICS))
    if records:
        parts.append(f"{records} metrics record{'s' if records != 1 else ''}")
    return ", ".join(parts) if parts else None


def refuse_existing_run(out_dir: str) -> None:
    """TRAIN.AUTO_RESUME False must never overwrite an earlier run's checkpoints or records."""
    found = existing_run(out_dir)
    if found:
        raise UserError(f"OUT_DIR {out_dir} already holds a run ({found}) and TRAIN.AUTO_RESUME False would "
                        "overwrite it. To continue that run, use TRAIN.AUTO_RESUME True; to start a fresh "
                        f"one, give another OUT_DIR (or delete {out_dir})")


def set_aside_records(out_dir: str) -> str | None:
    """Move metrics.jsonl / metrics.csv / tb of an earlier run that left no checkpoint to
    ``<name>.<n>`` (the first n free for all three), so that this run's records start clean.
    Returns the log line, or None when there were no records."""
    records = _count_records(os.path.join(out_dir, METRICS))
    if not records:
        return None
    n = 1
    while any(os.path.lexists(os.path.join(out_dir, f"{name}.{n}")) for name in METRICS_FILES):
        n += 1
    moved = []
    for name in METRICS_FILES:
        src = os.path.join(out_dir, name)
        if os.path.lexists(src):
            os.rename(src, f"{src}.{n}")
            moved.append(f"{name} -> {name}.{n}")
    return (f"{out_dir} held {records} metrics record{'s' if records != 1 else ''} of an earlier run that "
            f"left no checkpoint; this run starts from scratch, so they were moved aside: {', '.join(moved)}")


def remove_debris(out_dir: str) -> str | None:
    """Remove temporaries of killed checkpoint writes (checkpoints/*.tmp.<pid>) and of lock
    writes (run.lock.tmp/stale.<pid>). Call only while holding the lock: it proves that no other
    run writes here, so every such file is debris. Returns the log line, or None."""
    found: list[tuple[str, int]] = []
    ckpt_dir = checkpoint_dir(out_dir)
    for folder, pattern in ((ckpt_dir, _DEBRIS), (out_dir, _LOCK_DEBRIS)):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in sorted(names):
            path = os.path.join(folder, name)
            if pattern.search(name) and os.path.isfile(path) and not os.path.islink(path):
                size = os.path.getsize(path)
                os.remove(path)
                found.append((os.path.relpath(path, out_dir), size))
    if not found:
        return None
    total = sum(size for _, size in found)
    names = ", ".join(name for name, _ in found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
    return (f"removed {len(found)} temporary file{'s' if len(found) != 1 else ''} left by a killed write "
            f"({total / 1e6:.1f} MB): {names}")


# ---------------------------------------------------------------------------------------------
# Folder checks before any process group, and the ownership of a training run
# ---------------------------------------------------------------------------------------------
def probe_writable(folder: str, what: str) -> None:
    """Really create and remove a small file in folder; UserError if that fails."""
    probe = os.path.join(folder, f".distribuuuu-probe.{socket.gethostname()}.{os.getpid()}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise UserError(f"{what} {folder} is not writable ({e.strerror}): a file cannot be created in it. "
                        f"Make it writable (chmod u+w {folder}) or give another OUT_DIR") from None


def ensure_folder(out_dir: str) -> None:
    """OUT_DIR exists (created if needed), is a folder, and accepts new files."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"OUT_DIR {out_dir} is a file, not a folder; give a folder path (OUT_DIR runs/NAME)")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UserError(f"OUT_DIR {out_dir} cannot be created: part of its path is a file; "
                        "give a folder path (OUT_DIR runs/NAME)") from None
    except OSError as e:
        raise UserError(f"OUT_DIR {out_dir} cannot be created ({e.strerror}); give a folder you can "
                        "write to (OUT_DIR runs/NAME)") from None
    probe_writable(out_dir, "OUT_DIR")


def remove_if_empty(folder: str) -> None:
    """The folder a refused command made (preflight), if nothing was written into it: a refused
    command makes no folder. A folder with anything in it stays."""
    try:
        os.rmdir(folder)
    except OSError:
        pass


def preflight(cfg: Any, command: str, all_ranks_here: bool) -> None:
    """The run folder's checks that need no process group (see the module docstring)."""
    out_dir = cfg.OUT_DIR
    ensure_folder(out_dir)
    if command != "train":
        return
    ckpt_dir = checkpoint_dir(out_dir)
    if os.path.lexists(ckpt_dir):
        if not os.path.isdir(ckpt_dir):
            raise UserError(f"{ckpt_dir} is a file, not a folder; move it away or give another OUT_DIR")
        probe_writable(ckpt_dir, "the checkpoints folder")
    check_not_busy(out_dir, all_ranks_here)
    if not cfg.TRAIN.AUTO_RESUME:
        refuse_existing_run(out_dir)


def log_notes(notes: list[str]) -> None:
    for line in notes:
        log.warning(line)

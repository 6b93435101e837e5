"""One training run per folder, and nothing of an earlier run lost:
OUT_DIR/run.lock, and what an earlier run left in the folder.

- **The lock** (``owned``): rank 0 creates ``OUT_DIR/run.lock`` once the
  process group is up and removes it when the run ends in any way Python
  sees. It is JSON naming the holder (host, boot id, pid, the pid's
  start time in clock ticks from /proc/<pid>/stat, so that a reused pid
  is not mistaken for the holder, the start time as text, the command
  line, the Slurm/torchelastic job), created atomically: a fully written
  temporary hard-linked to the name, which fails when the name exists. A
  lock whose holder is provably gone (same host and boot, pid gone or
  reused; or an earlier attempt of the same Slurm job / torchelastic
  run) is taken over with a warning; a live holder, or one on another
  host that cannot be checked, is refused with exit status 2, before any
  process group when every rank can check it (``check_not_busy``, from
  run_folder.check_folder).
- **Once the lock is held**, which proves that no other run writes in
  the folder: TRAIN.AUTO_RESUME False is refused again if an earlier run
  is there (``refuse_existing_run``), the temporaries of killed writes
  (``*.tmp.<pid>``, files.py) are removed, and (RunFolder.metrics) the
  records of an earlier run that left no checkpoint are moved aside
  (``set_aside_records``) instead of appended to.

``eval`` takes no lock (it only reads checkpoints).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import re
import shlex
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from distribuuuu import files
from distribuuuu.errors import UserError
from distribuuuu.launch import comm, launcher
from distribuuuu.run_folder.metrics_files import METRICS, METRICS_FILES
from distribuuuu.weights import peek_checkpoint

log = logging.getLogger("distribuuuu")

LOCK = "run.lock"
CHECKPOINTS = (
    "checkpoints"  # what makes a folder hold a run: its checkpoints (run_folder/__init__.py)
)
LAST = "last.pth"  # a hard link to the newest checkpoint
BEST = "best.pth"  # a hard link to the checkpoint TRAIN.BEST_METRIC chose
_DEBRIS = re.compile(
    r"\.(tmp|stale)\.\d+$"
)  # temporaries of files.atomic_write / atomic_link and of the lock
_NO_HARD_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK)


# ---------------------------------------------------------------------------------------------
# Who holds the folder
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Holder:
    """The process that owns a run folder, as written in run.lock."""

    host: str
    pid: int
    pid_start: int | None  # clock ticks after boot (/proc/<pid>/stat field 22); None off Linux
    started: str  # local time, for people
    command: str
    boot_id: str = ""  # /proc/sys/kernel/random/boot_id: tells a rebooted host from the same boot
    job: str = ""  # "slurm:<job id>" or "torchelastic:<run id>", or ""
    attempt: int = 0  # SLURM_RESTART_COUNT / TORCHELASTIC_RESTART_COUNT of that job

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started} ({self.command})"


def _read(path: str) -> str:
    """A small file's text; "" when it cannot be read (or does not
    exist)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def process_start(pid: int) -> int | None:
    """The start time of process pid in clock ticks after boot, or None
    if there is no such process (or no /proc to ask)."""
    stat = _read(f"/proc/{pid}/stat")
    # The command name (field 2) may hold spaces and parentheses: count
    # fields after the last ')'.
    return int(stat[stat.rindex(")") + 2 :].split()[19]) if stat else None  # field 22, starttime


def this_process() -> Holder:
    """A Holder describing the calling process."""
    pid, (job, attempt) = os.getpid(), launcher.job_and_attempt()
    return Holder(
        socket.gethostname(),
        pid,
        process_start(pid),
        datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z"),
        shlex.join([sys.executable, *sys.argv]),
        _read("/proc/sys/kernel/random/boot_id").strip(),
        job,
        attempt,
    )


def holder_state(holder: Holder, me: Holder) -> str:
    """'alive', 'dead' (provably gone: its lock may be taken over) or
    'unknown' (another host)."""
    if holder.job and holder.job == me.job and holder.attempt != me.attempt:
        # Slurm and torchelastic start a job's next attempt only after
        # the last one ended
        return "dead"
    if holder.host != me.host:
        return "unknown"
    if holder.boot_id and me.boot_id and holder.boot_id != me.boot_id:
        return "dead"  # the host restarted since the lock was written
    start = process_start(holder.pid)
    if start is None and me.pid_start is not None:
        return "dead"  # no such process (we can see /proc, so its absence means something)
    if start is None and not _pid_exists(holder.pid):
        return "dead"  # no /proc here (not Linux): ask the kernel the plain way
    if start is not None and holder.pid_start is not None and start != holder.pid_start:
        return "dead"  # the pid was reused by a process started later
    return "alive"


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


# ---------------------------------------------------------------------------------------------
# run.lock
# ---------------------------------------------------------------------------------------------
def _parse(text: str) -> Holder:
    """The Holder in a lock file's text; ValueError when it is not a
    lock's JSON."""
    try:
        raw = json.loads(text)
        return Holder(**{k: v for k, v in raw.items() if k in Holder.__dataclass_fields__})
    except (ValueError, TypeError, AttributeError) as e:  # not JSON, or not a lock's JSON
        raise ValueError(f"{type(e).__name__}: {e}") from None


def _holder_in(path: str) -> Holder | None:
    """The holder in a lock-format file at any path (None if missing or
    unreadable)."""
    try:
        return _parse(_read(path))
    except ValueError:
        return None


def read_lock(out_dir: str) -> Holder | None:
    """The holder named in OUT_DIR/run.lock, or None when there is no
    lock; UserError when it cannot be read or parsed (after retries: a
    lock written without hard links is briefly empty)."""
    path = os.path.join(out_dir, LOCK)
    for attempt in range(3):
        try:
            with open(path) as f:
                return _parse(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            if isinstance(e, OSError) or attempt == 2:
                why = e.strerror if isinstance(e, OSError) else e
                raise UserError(
                    f"cannot read the run lock {path} ({why}); if no run is using {out_dir}, "
                    f"delete {path}"
                ) from None
            time.sleep(0.2)
    return None


def _busy_message(out_dir: str, holder: Holder, state: str) -> str:
    if state == "alive":
        return (
            f"OUT_DIR {out_dir} is in use by another training run: {holder.describe()}. Wait for "
            f"it to end or stop it (kill {holder.pid}), or give this run another OUT_DIR"
        )
    return (
        f"OUT_DIR {out_dir} is locked by a training run on another host: {holder.describe()}. If "
        f"that run is no longer running, delete {os.path.join(out_dir, LOCK)}; otherwise give this "
        "run another OUT_DIR"
    )


def check_not_busy(out_dir: str, all_ranks_here: bool) -> None:
    """Refuse a folder whose lock holder is alive; read-only. A holder
    on another host is refused only when all ranks run on this host
    (else rank 0 decides after the process group is up, so that no rank
    refuses alone and leaves the others waiting)."""
    holder = read_lock(out_dir) if os.path.lexists(os.path.join(out_dir, LOCK)) else None
    if holder is None:
        return
    state = holder_state(holder, this_process())
    if state == "alive" or (state == "unknown" and all_ranks_here):
        raise UserError(_busy_message(out_dir, holder, state))


def _create(path: str, me: Holder) -> None:
    """Create path holding me, atomically: FileExistsError if it exists.
    The content is complete before the name appears (a hard link of a
    written file), except on filesystems without hard links."""
    text, tmp = json.dumps(asdict(me), indent=1) + "\n", f"{path}.tmp.{me.pid}"
    try:
        files.atomic_write(
            tmp, lambda f: f.write(text.encode())
        )  # whole and on disk before it is linked
        try:
            os.link(tmp, path)
        except OSError as e:  # FileExistsError goes up
            if e.errno not in _NO_HARD_LINKS:
                raise
            _create_exclusive(path, text)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def _create_exclusive(path: str, text: str) -> None:
    """A filesystem without hard links: O_EXCL creates the name (empty
    for a moment: read_lock retries)."""
    with os.fdopen(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644), "w") as f:
        f.write(text)


def _take_over(out_dir: str, me: Holder) -> list[str]:
    """The lock exists: remove it if its holder is provably gone
    (returns the warning), refuse it (UserError) if not; [] when it went
    away meanwhile."""
    holder, path = read_lock(out_dir), os.path.join(out_dir, LOCK)
    if holder is None:
        return []  # released between our two looks
    state = holder_state(holder, me)
    if state != "dead":
        raise UserError(_busy_message(out_dir, holder, state))
    aside = f"{path}.stale.{me.pid}"
    try:
        os.rename(path, aside)  # atomic: from here on no other taker can see or remove this file
    except FileNotFoundError:
        return []  # someone else removed it: just try to create ours
    if _holder_in(aside) != holder:  # a fresh lock of another run: put it back
        with contextlib.suppress(OSError):
            os.link(aside, path)
        os.remove(aside)
        return []
    os.remove(aside)
    return [f"took over {path}, left by a run that is no longer running: {holder.describe()}"]


def acquire(out_dir: str, me: Holder | None = None) -> list[str]:
    """Create OUT_DIR/run.lock for this process, taking over a provably
    stale one. Returns the warnings to log; raises UserError when a live
    (or unverifiable) run holds the folder."""
    me, path, notes = me or this_process(), os.path.join(out_dir, LOCK), []
    for _ in range(5):  # another run may create it between our looks
        try:
            _create(path, me)
            return notes
        except FileExistsError:
            notes += _take_over(out_dir, me)
    raise UserError(
        f"could not take the run lock {path}: other runs keep creating it; give this run another "
        "OUT_DIR"
    )


def release(out_dir: str, me: Holder) -> None:
    """Remove OUT_DIR/run.lock if it is still ours (a user may have
    deleted it and another run taken it)."""
    path = os.path.join(out_dir, LOCK)
    holder = _holder_in(path)
    if holder is not None and (holder.host, holder.pid, holder.pid_start) == (
        me.host,
        me.pid,
        me.pid_start,
    ):
        try:
            os.remove(path)
        except OSError as e:
            log.warning(
                "could not remove the run lock %s (%s); delete it before the next run", path, e
            )


def _take(cfg: Any, me: Holder) -> list[str]:
    """Rank 0: acquire the lock, re-check under it what check_folder
    saw, remove debris. Returns log lines."""
    notes = acquire(cfg.OUT_DIR, me)
    try:
        if not cfg.TRAIN.AUTO_RESUME:
            refuse_existing_run(cfg.OUT_DIR)
        return notes + remove_debris(cfg.OUT_DIR)
    except BaseException:
        release(cfg.OUT_DIR, me)
        raise


@contextlib.contextmanager
def owned(cfg: Any, ctx: Any, lock: bool = True) -> Iterator[list[str]]:
    """``with owned(cfg, ctx) as notes:`` rank 0 holds OUT_DIR/run.lock
    for the body.

    Collective: rank 0 decides and broadcasts the outcome, so every rank
    raises the same UserError when the folder is taken (none is left
    waiting). ``notes``: rank 0's lines to log once logging is set up.
    lock=False (eval): yields [] and does nothing.
    """
    if not lock:
        yield []
        return
    me, notes, failure = this_process(), [], None
    if ctx.is_main:
        try:
            notes = _take(cfg, me)
        except Exception as e:  # noqa: BLE001 - shared first, so that no rank waits; raised below
            failure = e
    # every rank raises alike: rank 0 its own error, the others the
    # UserError (or a crash) it sends
    try:
        sent = (
            failure
            if isinstance(failure, (UserError, type(None)))
            else RuntimeError(
                f"rank 0 could not take the run lock {os.path.join(cfg.OUT_DIR, LOCK)}: "
                f"{type(failure).__name__}: {failure}"
            )
        )
        sent = comm.broadcast_object(sent)
        if failure or sent:
            raise failure or sent
        yield notes
    finally:
        if (
            ctx.is_main and failure is None
        ):  # held: also when the broadcast itself failed (another rank died)
            release(cfg.OUT_DIR, me)


# ---------------------------------------------------------------------------------------------
# What an earlier run left
# ---------------------------------------------------------------------------------------------
def count_records(out_dir: str) -> int:
    """The records in OUT_DIR/metrics.jsonl (0 when there is none)."""
    try:
        with open(os.path.join(out_dir, METRICS), "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def _plural(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def _checkpoint_summary(ckpt_dir: str) -> list[str]:
    """Short descriptions of the checkpoints in ckpt_dir: "last.pth at
    epoch 5 (step 40)", "3 epoch_*.pth"."""
    saved = sorted(
        n
        for n in (os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else [])
        if n.endswith((".pth", ".dcp")) and not _DEBRIS.search(n)
    )
    parts = []
    if LAST in saved:
        try:
            ckpt = peek_checkpoint(os.path.join(ckpt_dir, LAST))
            parts.append(f"{LAST} at epoch {ckpt['epoch']} (step {ckpt['global_step']})")
        except Exception:  # noqa: BLE001 - a description only: an unreadable file is still a run's file
            parts.append(f"{LAST} (unreadable)")
    parts += [BEST] if BEST in saved else []
    numbered = re.compile(r"(epoch|step)_\d+\.(pth|dcp)$")
    for kind in ("epoch", "step"):
        count = sum(1 for n in saved if n.startswith(f"{kind}_") and n.endswith(".pth"))
        parts += [f"{count} {kind}_*.pth"] if count else []
    return parts + [n for n in saved if n not in (LAST, BEST) and not numbered.match(n)][:3]


def refuse_existing_run(out_dir: str) -> None:
    """TRAIN.AUTO_RESUME False must never overwrite an earlier run's
    checkpoints or records."""
    records = count_records(out_dir)
    found = _checkpoint_summary(os.path.join(out_dir, CHECKPOINTS)) + (
        [_plural(records, "metrics record")] if records else []
    )
    if found:
        raise UserError(
            f"OUT_DIR {out_dir} already holds a run ({', '.join(found)}) and TRAIN.AUTO_RESUME "
            "False would overwrite it. To continue that run, use TRAIN.AUTO_RESUME True; to start "
            f"a fresh one, give another OUT_DIR (or delete {out_dir})"
        )


def set_aside_records(out_dir: str, records: int) -> str:
    """Move metrics.jsonl / metrics.csv / tb of an earlier run that left
    no checkpoint (``records`` lines) to ``<name>.<n>`` (the first n
    free for all three), so that this run's records start clean. Returns
    the log line."""
    n = 1
    while any(os.path.lexists(os.path.join(out_dir, f"{name}.{n}")) for name in METRICS_FILES):
        n += 1
    moved = []
    for name in METRICS_FILES:
        src = os.path.join(out_dir, name)
        if os.path.lexists(src):
            os.rename(src, f"{src}.{n}")
            moved.append(f"{name} -> {name}.{n}")
    return (
        f"{out_dir} held {_plural(records, 'metrics record')} of an earlier run that left no "
        f"checkpoint; this run starts from scratch, so they were moved aside: {', '.join(moved)}"
    )


def remove_debris(out_dir: str) -> list[str]:
    """Remove the temporaries of killed writes (``<name>.tmp.<pid>``,
    ``run.lock.stale.<pid>``) in OUT_DIR and OUT_DIR/checkpoints. Call
    only while holding the lock: it proves that no other run writes
    here, so every such file is debris. Returns the log line, if any."""
    found = []
    for folder in (out_dir, os.path.join(out_dir, CHECKPOINTS)):
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            path = os.path.join(folder, name)
            if _DEBRIS.search(name) and os.path.isfile(path) and not os.path.islink(path):
                found.append((os.path.relpath(path, out_dir), os.path.getsize(path)))
                os.remove(path)
    return [_debris_note(found)] if found else []


def _debris_note(found: list[tuple[str, int]]) -> str:
    names = ", ".join(name for name, _ in found[:5]) + (
        f" and {len(found) - 5} more" if len(found) > 5 else ""
    )
    return (
        f"removed {_plural(len(found), 'temporary file')} left by a killed write "
        f"({sum(size for _, size in found) / 1e6:.1f} MB): {names}"
    )

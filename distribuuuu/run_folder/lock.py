"""The run lock, ``OUT_DIR/run.lock``: one training run per folder.

The lock is JSON naming the holder (host, boot id, pid, the pid's start time in clock ticks from
/proc/<pid>/stat, so a reused pid is not mistaken for the holder, the start time as text, the
command line, the Slurm/torchelastic job). Rank 0 creates it atomically (a fully written temporary
file hard-linked to the name, which fails when the name exists) once the process group is up, and
removes it when the run ends in any way Python sees. A lock whose holder is provably gone (same
host and boot, pid gone or reused; or an earlier attempt of the same Slurm job / torchelastic run)
is taken over with a warning; a live holder, or one on another host that cannot be checked, is
refused with exit status 2. What the folder holds, and the ownership of a run, are in ownership.py and __init__.py (owned).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import shlex
import socket
import sys
import time
from dataclasses import asdict, dataclass

from distribuuuu.errors import UserError
from distribuuuu.launch import launcher
from distribuuuu.run_folder.layout import LOCK

log = logging.getLogger("distribuuuu")


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


def process_start(pid: int) -> int | None:
    """The start time of process pid in clock ticks after boot, or None if there is no such process
    (or no /proc to ask)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count fields after the last ')'.
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[19])  # field 22, starttime


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def this_process() -> Holder:
    """A Holder describing the calling process."""
    pid = os.getpid()
    job, attempt = launcher.job_and_attempt()
    return Holder(host=socket.gethostname(), pid=pid, pid_start=process_start(pid),
                  started=datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z"),
                  command=shlex.join([sys.executable, *sys.argv]), boot_id=_boot_id(), job=job, attempt=attempt)


def holder_state(holder: Holder, me: Holder) -> str:
    """'alive', 'dead' (provably gone: its lock may be taken over) or 'unknown' (another host)."""
    if holder.job and holder.job == me.job and holder.attempt != me.attempt:
        return "dead"  # Slurm and torchelastic start a job's next attempt only after the last one ended
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


def lock_path(out_dir: str) -> str:
    return os.path.join(out_dir, LOCK)


def parse_lock(text: str) -> Holder:
    """The Holder in a lock file's text; ValueError when it is not a lock's JSON."""
    try:
        raw = json.loads(text)
        return Holder(**{k: v for k, v in raw.items() if k in Holder.__dataclass_fields__})
    except (ValueError, TypeError, AttributeError) as e:  # not JSON, or not a lock's JSON
        raise ValueError(f"{type(e).__name__}: {e}") from None


def read_lock_file(path: str) -> Holder | None:
    """The holder in a lock-format file at any path (None if missing or unreadable)."""
    try:
        with open(path) as f:
            return parse_lock(f.read())
    except (OSError, ValueError):
        return None


def read_lock(out_dir: str) -> Holder | None:
    """The holder named in OUT_DIR/run.lock, or None when there is no lock; UserError when it
    cannot be read or parsed (after retries: a lock being written without hard links is briefly empty)."""
    path = lock_path(out_dir)
    for attempt in range(3):
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise UserError(f"cannot read the run lock {path} ({e.strerror}); if no run is using "
                            f"{out_dir}, delete {path}") from None
        try:
            return parse_lock(text)
        except ValueError as e:
            if attempt == 2:
                raise UserError(f"the run lock {path} cannot be read ({e}); if no run is using "
                                f"{out_dir}, delete {path}") from None
            time.sleep(0.2)
    return None


def _busy_message(out_dir: str, holder: Holder, state: str) -> str:
    if state == "alive":
        return (f"OUT_DIR {out_dir} is in use by another training run: {holder.describe()}. Wait for it "
                f"to end or stop it (kill {holder.pid}), or give this run another OUT_DIR")
    return (f"OUT_DIR {out_dir} is locked by a training run on another host: {holder.describe()}. If that "
            f"run is no longer running, delete {lock_path(out_dir)}; otherwise give this run another OUT_DIR")


def check_not_busy(out_dir: str, all_ranks_here: bool) -> None:
    """Refuse a folder whose lock holder is alive; read-only. A holder on another host is refused
    only when all ranks run on this host (else rank 0 decides after the process group is up, so
    that no rank refuses alone and leaves the others waiting)."""
    holder = read_lock(out_dir)
    if holder is None:
        return
    state = holder_state(holder, this_process())
    if state == "alive" or (state == "unknown" and all_ranks_here):
        raise UserError(_busy_message(out_dir, holder, state))


def _create_lock(path: str, me: Holder) -> None:
    """Create path holding me, atomically: FileExistsError if it exists. The content is complete
    before the name appears (hard link of a written file), except on filesystems without hard links."""
    text = json.dumps(asdict(me), indent=1) + "\n"
    tmp = f"{path}.tmp.{me.pid}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
            return
        except FileExistsError:
            raise
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def _remove_stale(path: str, stale: Holder, me: Holder) -> bool:
    """Remove the lock at path if it still names ``stale``; False if another run replaced it."""
    aside = f"{path}.stale.{me.pid}"
    try:
        os.rename(path, aside)  # atomic: from here on no other taker can see or remove this file
    except FileNotFoundError:
        return True  # someone else removed it: just try to create ours
    moved = read_lock_file(aside)
    if moved == stale:
        os.remove(aside)
        return True
    with contextlib.suppress(OSError):  # a fresh lock of another run: put it back
        os.link(aside, path)
    os.remove(aside)
    return False


def acquire(out_dir: str, me: Holder | None = None) -> list[str]:
    """Create OUT_DIR/run.lock for this process, taking over a provably stale one. Returns the
    warnings to log; raises UserError when a live (or unverifiable) run holds the folder."""
    me = me or this_process()
    path = lock_path(out_dir)
    notes: list[str] = []
    for _ in range(5):
        try:
            _create_lock(path, me)
            return notes
        except FileExistsError:
            pass
        holder = read_lock(out_dir)
        if holder is None:
            continue  # released between our two looks
        state = holder_state(holder, me)
        if state != "dead":
            raise UserError(_busy_message(out_dir, holder, state))
        if _remove_stale(path, holder, me):
            notes.append(f"took over {path}, left by a run that is no longer running: {holder.describe()}")
    raise UserError(f"could not take the run lock {path}: other runs keep creating it; give this run "
                    "another OUT_DIR")


def release(out_dir: str, me: Holder) -> None:
    """Remove OUT_DIR/run.lock if it is still ours (a user may have deleted it and another run taken it)."""
    path = lock_path(out_dir)
    holder = read_lock_file(path)
    if holder is not None and (holder.host, holder.pid, holder.pid_start) == (me.host, me.pid, me.pid_start):
        try:
            os.remove(path)
        except OSError as e:
            log.warning("could not remove the run lock %s (%s); delete it before the next run", path, e)

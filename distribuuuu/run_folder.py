"""The run folder's ownership: one training run per OUT_DIR, and nothing of an earlier run lost.

``distribuuuu train`` owns OUT_DIR while it runs:

- **The lock**, ``OUT_DIR/run.lock``: JSON naming the holder (host, boot id, pid, the pid's start
  time in clock ticks from /proc/<pid>/stat, so a reused pid is not mistaken for the holder, the
  start time as text, the command line, the Slurm/torchelastic job). Rank 0 creates it atomically
  (a fully written temporary file hard-linked to the name, which fails when the name exists) once
  the process group is up, and removes it when the run ends in any way Python sees. A lock whose
  holder is provably gone (same host and boot, pid gone or reused; or an earlier attempt of the
  same Slurm job / torchelastic run) is taken over with a warning; a live holder, or one on
  another host that cannot be checked, is refused with exit status 2.
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
from dataclasses import asdict, dataclass
from typing import Any, Iterator

from distribuuuu.errors import UserError

log = logging.getLogger("distribuuuu")

LOCK_NAME = "run.lock"
METRICS_FILES = ("metrics.jsonl", "metrics.csv", "tb")  # what a run appends to: set aside together
# Temporaries of checkpoint._atomic_save / _atomic_link (and of the lock itself): <name>.tmp.<pid>
_DEBRIS = re.compile(r"\.tmp\.\d+$")
_LOCK_DEBRIS = re.compile(r"^run\.lock\.(tmp|stale)\.\d+$")


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


def _job(environ: Any = None) -> tuple[str, int]:
    """The launcher's job that this process belongs to, and its restart count."""
    env = os.environ if environ is None else environ
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}", int(env.get("SLURM_RESTART_COUNT") or 0)
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":  # "none" is torchrun's default, shared by unrelated jobs
        return f"torchelastic:{run_id}", int(env.get("TORCHELASTIC_RESTART_COUNT") or 0)
    return "", 0


def this_process() -> Holder:
    """A Holder describing the calling process."""
    pid = os.getpid()
    job, attempt = _job()
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
    return os.path.join(out_dir, LOCK_NAME)


def read_lock(out_dir: str) -> Holder | None:
    """The holder named in OUT_DIR/run.lock, or None when there is no lock."""
    path = lock_path(out_dir)
    for attempt in range(3):  # a lock being written without hard links is briefly empty
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise UserError(f"cannot read the run lock {path} ({e.strerror}); if no run is using "
                            f"{out_dir}, delete {path}") from None
        try:
            raw = json.loads(text)
            fields = set(Holder.__dataclass_fields__)
            return Holder(**{k: v for k, v in raw.items() if k in fields})
        except (ValueError, TypeError, AttributeError) as e:  # not JSON, or not a lock's JSON
            if attempt == 2:
                raise UserError(f"the run lock {path} cannot be read ({type(e).__name__}: {e}); if no run "
                                f"is using {out_dir}, delete {path}") from None
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


def read_lock_file(path: str) -> Holder | None:
    """The holder in a lock-format file at any path (None if unreadable)."""
    try:
        with open(path) as f:
            raw = json.load(f)
        return Holder(**{k: v for k, v in raw.items() if k in Holder.__dataclass_fields__})
    except (OSError, ValueError, TypeError, AttributeError):
        return None


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
    if "last.pth" in saved:
        parts.append("last.pth" + _progress_of(os.path.join(ckpt_dir, "last.pth")))
    if "best.pth" in saved:
        parts.append("best.pth")
    for kind in ("epoch", "step"):
        count = sum(1 for n in saved if n.startswith(f"{kind}_") and n.endswith(".pth"))
        if count:
            parts.append(f"{count} {kind}_*.pth")
    numbered = re.compile(r"(epoch|step)_\d+\.(pth|dcp)$")
    parts += [n for n in saved if n not in ("last.pth", "best.pth") and not numbered.match(n)][:3]
    return parts


def _progress_of(path: str) -> str:
    """" at epoch E (step S)" from the checkpoint's counters, or "" when it cannot be read."""
    try:
        import torch

        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return f" at epoch {ckpt['epoch']} (step {ckpt['global_step']})"
    except Exception:  # noqa: BLE001 - a description only: an unreadable file is still a run's file
        return " (unreadable)"


def existing_run(out_dir: str) -> str | None:
    """What an earlier run left in OUT_DIR (checkpoints, metrics records), or None if nothing."""
    parts = _checkpoint_summary(os.path.join(out_dir, "checkpoints"))
    records = _count_records(os.path.join(out_dir, "metrics.jsonl"))
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
    records = _count_records(os.path.join(out_dir, "metrics.jsonl"))
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
    ckpt_dir = os.path.join(out_dir, "checkpoints")
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


def preflight(cfg: Any, command: str, all_ranks_here: bool) -> None:
    """The run folder's checks that need no process group (see the module docstring)."""
    out_dir = cfg.OUT_DIR
    ensure_folder(out_dir)
    if command != "train":
        return
    ckpt_dir = os.path.join(out_dir, "checkpoints")
    if os.path.lexists(ckpt_dir):
        if not os.path.isdir(ckpt_dir):
            raise UserError(f"{ckpt_dir} is a file, not a folder; move it away or give another OUT_DIR")
        probe_writable(ckpt_dir, "the checkpoints folder")
    check_not_busy(out_dir, all_ranks_here)
    if not cfg.TRAIN.AUTO_RESUME:
        refuse_existing_run(out_dir)


def take(cfg: Any, me: Holder) -> list[str]:
    """Rank 0: acquire the lock, re-check under it what preflight saw, clear debris. Returns log lines."""
    notes = acquire(cfg.OUT_DIR, me)
    try:
        if not cfg.TRAIN.AUTO_RESUME:
            refuse_existing_run(cfg.OUT_DIR)
        debris = remove_debris(cfg.OUT_DIR)
    except BaseException:
        release(cfg.OUT_DIR, me)
        raise
    return notes + ([debris] if debris else [])


@contextlib.contextmanager
def owned(cfg: Any, ctx: Any, lock: bool = True) -> Iterator[list[str]]:
    """``with owned(cfg, ctx) as notes:`` rank 0 holds OUT_DIR/run.lock for the body.

    Collective: rank 0 decides and broadcasts the outcome, so every rank raises the same
    UserError when the folder is taken (none is left waiting). ``notes``: rank 0's lines to log
    once logging is set up. lock=False (eval): yields [] and does nothing.
    """
    from distribuuuu import distributed

    if not lock:
        yield []
        return
    me, outcome, failure = this_process(), ("ok", []), None
    if ctx.is_main:
        try:
            outcome = ("ok", take(cfg, me))
        except UserError as e:
            outcome = ("user", str(e))
        except Exception as e:  # noqa: BLE001 - shared first, so no rank waits; re-raised below
            outcome, failure = ("crash", f"{type(e).__name__}: {e}"), e
    held = ctx.is_main and outcome[0] == "ok"
    try:
        kind, detail = distributed.broadcast_object(outcome)
        if kind == "user":
            raise UserError(detail)
        if kind == "crash":
            if failure is not None:
                raise failure
            raise RuntimeError(f"rank 0 could not take the run lock {lock_path(cfg.OUT_DIR)}: {detail}")
        yield detail if ctx.is_main else []
    finally:
        if held:  # also when the broadcast itself failed (another rank died)
            release(cfg.OUT_DIR, me)


def log_notes(notes: list[str]) -> None:
    for line in notes:
        log.warning(line)

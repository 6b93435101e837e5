"""Helpers for tests that use a real Slurm cluster (scripts/local_slurm.sh starts a one-host one).

    from tests.slurm_utils import require_slurm
    require_slurm()            # skips the calling test (or module) when no controller answers

The skip reason is also written straight to the terminal: pytest's default report does not
show skip reasons, and a silently skipped Slurm test looks like a passing one.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

START_HINT = "start a local cluster with `scripts/local_slurm.sh` (root, Debian), as .ci/run does"
# Node states in which a node takes new work (with OverSubscribe, also while busy).
USABLE_STATES = ("idle", "mixed", "allocated", "completing")


def _out(args: list[str], timeout: float = 15) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


@functools.lru_cache(maxsize=None)
def slurm_available() -> tuple[bool, str]:
    """(True, "") when srun exists, the controller answers and a node can take jobs; else (False, why)."""
    missing = [c for c in ("srun", "sbatch", "scontrol", "sinfo", "squeue", "scancel") if not shutil.which(c)]
    if missing:
        return False, f"Slurm commands not found: {', '.join(missing)}; {START_HINT}"
    try:
        ping = _out(["scontrol", "ping"])
        if ping.returncode != 0 or " is UP" not in ping.stdout:
            text = (ping.stdout + ping.stderr).strip().split("\n")[0]
            return False, f"no Slurm controller answers (`scontrol ping`: {text}); {START_HINT}"
        nodes = _out(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.split("\n")
    except subprocess.TimeoutExpired as e:
        return False, f"`{' '.join(e.cmd)}` did not answer within {e.timeout:.0f} s; {START_HINT}"
    states = [line.split() for line in nodes if line.strip()]
    if not any(s[1] in USABLE_STATES for s in states if len(s) == 2):
        return False, f"the Slurm controller answers but no node takes jobs (sinfo: {states}); {START_HINT}"
    return True, ""


_announced: set[str] = set()


def require_slurm() -> None:
    """Skip the calling test with a printed reason unless a Slurm cluster takes jobs."""
    ok, reason = slurm_available()
    if ok:
        return
    if reason not in _announced:
        _announced.add(reason)
        print(f"\nSKIP (Slurm): {reason}", file=sys.__stderr__, flush=True)
    pytest.skip(reason)


def hostnames(nodelist: str) -> list[str]:
    """Slurm's own expansion of a hostlist (independent of distributed.parse_hostlist)."""
    return _out(["scontrol", "show", "hostnames", nodelist]).stdout.split()


def job_of(name: str) -> dict[str, str]:
    """The newest job named `name`, finished or not: {"id", "state", "nodes", "exit"} ({} if none).

    Finished jobs stay visible for MinJobAge seconds (600 in local_slurm.sh's config).
    """
    out = _out(["squeue", "-h", "-t", "all", "-n", name, "-o", "%i|%T|%N"]).stdout.split("\n")
    rows = [line.split("|") for line in out if line.strip()]
    if not rows:
        return {}
    job_id, state, nodes = max(rows, key=lambda r: int(r[0]))
    return {"id": job_id, "state": state, "nodes": nodes}


FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE")


def job_info(job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, ExitCode, NodeList, StdOut, ...); {} if unknown."""
    out = _out(["scontrol", "show", "job", "-o", job_id]).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def wait_job(job_id: str, timeout: float) -> dict[str, str]:
    """Poll until the job has finished; its scontrol record ({} fields if it never finished)."""
    deadline = time.monotonic() + timeout
    while True:
        info = job_info(job_id)
        if info.get("JobState") in FINISHED or time.monotonic() > deadline:
            return info
        time.sleep(0.5)


def cancel(name: str) -> None:
    """scancel every job named `name` (cleanup after a failed or timed-out test)."""
    subprocess.run(["scancel", "-n", name], capture_output=True, timeout=30)


def alive(pid: int) -> bool:
    """True while pid runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def cmdline(pid: int) -> str:
    """The command line of pid, arguments joined by spaces ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def pids_matching(pattern: str) -> list[int]:
    """Pids whose command line matches the regex pattern (like `pgrep -f`, without procps)."""
    regex = re.compile(pattern)
    pids = [int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) != os.getpid()]
    return [p for p in pids if alive(p) and regex.search(cmdline(p))]


def describe(pids: list[int]) -> str:
    """One "pid: command line" line per pid that still runs, for failure messages."""
    return "\n".join(f"{p}: {cmdline(p)}" for p in pids if alive(p)) or "(none running)"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of pids runs; return those still running after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)

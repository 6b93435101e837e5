"""Shared helpers for tests that run the real command line in subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "config", "synthetic_tiny.yaml")


def env() -> dict[str, str]:
    """One intra-op thread per process (the machine has 2 cores), unbuffered output."""
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
                "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_STEP_ID", "DISTRIBUUUU_LAUNCHER"):
        e.pop(var, None)
    return e


def run(args: list[str], timeout: float = 240, **kw) -> subprocess.CompletedProcess:
    """Run a command from the repo root, capturing text output."""
    return subprocess.run(args, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout, **kw)


def distribuuuu(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "distribuuuu", *args], timeout=timeout)


def torchrun(nproc: int, script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={nproc}", script, *args], timeout=timeout)


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def check(proc: subprocess.CompletedProcess, status: int = 0) -> subprocess.CompletedProcess:
    assert proc.returncode == status, (
        f"exit {proc.returncode} (wanted {status})\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


# ---------------------------------------------------------------------------------------------
# A launcher's whole process tree, read from /proc (no psutil): for the signal tests
# ---------------------------------------------------------------------------------------------
def _proc_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, start time) of every process."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        table[int(name)] = (int(fields[1]), fields[0], fields[19])  # ppid, state, starttime
    return table


def process_tree(root: int) -> dict[int, str]:
    """root and all its descendants: pid -> start time (tells a reused pid apart)."""
    table, tree, todo = _proc_table(), {}, [root]
    while todo:
        pid = todo.pop()
        if pid in table and pid not in tree:
            tree[pid] = table[pid][2]
            todo.extend(p for p, (ppid, _, _) in table.items() if ppid == pid)
    return tree


def alive(tree: dict[int, str]) -> list[int]:
    """The processes of tree that still run (a zombie has exited; it only waits for its parent)."""
    table = _proc_table()
    return [pid for pid, start in tree.items()
            if pid in table and table[pid][2] == start and table[pid][1] not in ("Z", "X")]


def wait_gone(tree: dict[int, str], seconds: float) -> list[int]:
    """Wait up to seconds for every process of tree to end; the ones still running."""
    end = time.monotonic() + seconds
    while alive(tree) and time.monotonic() < end:
        time.sleep(0.1)
    return alive(tree)


def kill_tree(proc: subprocess.Popen, tree: dict[int, str]) -> None:
    """Clean-up after a test: SIGKILL whatever of the tree still runs, and reap the launcher."""
    for pid in alive(tree):
        os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
        proc.wait()

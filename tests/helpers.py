"""Shared helpers for tests that run the real command line in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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

"""Decisions from the machine: the loader workers (TRAIN.WORKERS -1) and
the intra-op threads (NUM_THREADS 0) of each process, from its cores,
the processes on the node and how busy the machine is."""

from __future__ import annotations

import os

from yacs.config import CfgNode

from distribuuuu.inferred.decision import Decision
from distribuuuu.launch import launcher

MAX_AUTO_WORKERS = 8


def cores_per_process(local_world_size: int) -> int:
    """The CPU cores this process may use (its affinity), shared by the
    processes of this node."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))


def workers(cfg: CfgNode, local_world_size: int) -> Decision:
    """TRAIN.WORKERS: -1 decided from the cores (one left to the process
    itself, at most MAX_AUTO_WORKERS); a value set is kept up to this
    process's cores or MAX_AUTO_WORKERS, else clamped: each loader would
    start that many processes (1,000 took 100 times as long)."""
    asked, cores = cfg.TRAIN.WORKERS, cores_per_process(1)
    if asked > max(cores, MAX_AUTO_WORKERS):
        cfg.TRAIN.WORKERS = max(cores, MAX_AUTO_WORKERS)
        why = f"clamped from {asked}: at most this process's {cores} cores, or {MAX_AUTO_WORKERS}"
        return Decision("TRAIN.WORKERS", cfg.TRAIN.WORKERS, why, warn=True)
    if asked >= 0:
        return Decision("TRAIN.WORKERS", asked, "config")
    cores = cores_per_process(local_world_size)
    cfg.TRAIN.WORKERS = min(MAX_AUTO_WORKERS, cores - 1)
    why = (
        f"from the cores: {cores} per process for {local_world_size} process(es) here, "
        "one left to the process itself"
    )
    return Decision("TRAIN.WORKERS", cfg.TRAIN.WORKERS, why)


def threads(cfg: CfgNode, local_world_size: int) -> list[Decision]:
    """NUM_THREADS 0: OMP_NUM_THREADS, else free_threads; a value above
    this process's cores is clamped to them."""
    asked, cores = cfg.NUM_THREADS, cores_per_process(1)
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if 0 < asked <= cores:
        return []
    if asked:
        cfg.NUM_THREADS, why = cores, f"clamped from {asked}: this process may use {cores} cores"
    elif omp.isdigit() and int(omp) > 0:
        cfg.NUM_THREADS = min(int(omp), cores)
        why = "OMP_NUM_THREADS (torchrun sets 1 for several processes)"
    else:
        cfg.NUM_THREADS, why = free_threads(cores, local_world_size)
    return [Decision("NUM_THREADS", cfg.NUM_THREADS, why, warn=bool(asked))]


def free_threads(cores: int, local_world_size: int) -> tuple[int, str]:
    """The threads of each process, and why: its share of the cores it
    may use (Slurm's --cpus-per-task is each task's own). Processes that
    share the node also leave their share of the load average (scaled
    to these cores): threads on a busy core wait for each other at every
    operation (2 processes x 2 threads on a busy 2-core machine ran 5-6x
    slower than x 1). A process alone takes its cores, as torch does:
    its threads compete only with the other work (docs/performance.md,
    section 4)."""
    slurm = launcher.slurm_cpus_per_task() if launcher.detect().launcher == "slurm" else None
    procs = 1 if slurm else local_world_size
    share = max(1, min(cores, slurm) if slurm else cores // procs)
    load = (
        os.getloadavg()[0] * cores / (os.cpu_count() or cores) if hasattr(os, "getloadavg") else 0.0
    )
    if procs == 1:
        why = f"from the cores: all {share} of this process's, alone here, as torch's default"
        if share > 1 and load >= share / 2:
            why += f"; {load:.1f} busy by the load average: where other jobs keep these cores "
            why += "busy, NUM_THREADS 1 trains faster (docs/performance.md, section 4)"
        return share, why
    n = max(1, min(share, round(cores - load) // procs))
    why = f"from the cores: {share} of {cores} per process for {procs} processes here, "
    return n, why + f"{load:.1f} busy by the load average"

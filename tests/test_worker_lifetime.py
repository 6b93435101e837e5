"""No loader worker outlives the process it works for.

A main process killed outright (kill -9, the OOM killer) runs no clean-up: its DataLoader workers
must end by themselves. Linux's parent-death signal does it (data.batches._die_with_parent, in every
worker's init). Before: torch's watchdog looks for the parent every 5 s, and a worker blocked
elsewhere never; after kill -9, workers were still alive seconds, one minutes, later.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest

from tests.conftest import TINY, kill_tree, logged, start_until, wait_gone

pytestmark = pytest.mark.e2e  # every test here starts processes

COMMAND = os.path.join(os.path.dirname(sys.executable), "distribuuuu")  # the console script
# Two epochs: in the second, the training loader's workers work and the validation loader's
# (persistent, started by epoch 1's evaluation) wait for the next evaluation.
WITH_WORKERS = ["--cfg", TINY, "OPTIM.MAX_EPOCH", "2", "TRAIN.SYNTHETIC_SAMPLES", "2048", "TEST.SYNTHETIC_SAMPLES",
                "64", "TRAIN.WORKERS", "2"]


def test_loader_workers_die_with_a_main_process_killed_outright(tmp_path):
    """kill -9 of a training process with 2 workers per loader: every worker is gone within 3 s."""
    out = tmp_path / "run"
    proc, job, _ = start_until([COMMAND, "train", "OUT_DIR", str(out), *WITH_WORKERS], out,
                               logged("[train] epoch 2/2 iter"))
    try:
        assert len(job) >= 5, job  # the main process, 2 training and 2 validation workers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        left = wait_gone(job, 3)
    finally:
        kill_tree(proc, job)
    assert not left, f"{len(left)} of {len(job) - 1} workers still running 3 s after kill -9 of their process"


def test_a_spawner_killed_outright_leaves_no_rank_and_no_worker(tmp_path):
    """kill -9 of the spawner: its ranks get SIGINT from the kernel (torch sets their parent-death
    signal) and end, and their loader workers end with them: nothing is left within 15 s."""
    out = tmp_path / "run"
    proc, job, console = start_until([COMMAND, "train", "--nproc-per-node", "2", "OUT_DIR", str(out),
                                         *WITH_WORKERS, "TRAIN.WORKERS", "1"], out, logged("[train] epoch 2/2 iter"))
    try:
        assert len(job) >= 7, job  # the spawner, 2 ranks, and a training and a validation worker each
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        left = wait_gone(job, 15)
    finally:
        kill_tree(proc, job)
    assert not left, f"still running 15 s after kill -9 of the spawner: {left}\n{console.read_text()[-3000:]}"

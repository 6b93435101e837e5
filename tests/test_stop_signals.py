"""Stop signals reach a training job however they are sent: to the launcher's pid (`kill PID`, what a
supervisor does), to its whole process group (a terminal's Ctrl-C, Slurm, systemd, Kubernetes), to one
rank, or twice.

A preemption signal (TRAIN.PREEMPT_SIGNALS: SIGTERM, SIGUSR1 by default) makes every rank write one step
checkpoint that the same command resumes; SIGINT stops as Ctrl-C does. Each rank ends with one line
and no traceback, the launcher exits with 128 + the signal, and no process is left. Real processes
and real signals, under the built-in spawner, plain python, train_net.py and torchrun
(docs/launching.md, docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from tests.conftest import (
    TINY,
    check,
    cmdline,
    kill_tree,
    read_metrics,
    read_text_or_empty,
    run,
    start_until_training,
    wait_gone,
)

pytestmark = pytest.mark.e2e  # every test here starts processes

PY = sys.executable
# 1024 samples / (2 ranks x 16) = 32 steps in the one epoch (64 in one process): long enough that a
# signal sent once the first progress line is logged lands mid-epoch, where a step checkpoint is due.
LONG_EPOCH = ["OPTIM.MAX_EPOCH", "1", "TRAIN.SYNTHETIC_SAMPLES", "1024", "TEST.SYNTHETIC_SAMPLES", "16",
              "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8"]
LOADER_WORKERS = ["TRAIN.DATA_PIPELINE", "loader", "TRAIN.WORKERS", "2"]  # 2 DataLoader workers per rank
LAUNCH = {
    "spawn": [PY, "-m", "distribuuuu", "train", "--nproc-per-node", "2"],
    "plain": [PY, "-m", "distribuuuu", "train"],
    "torchrun": [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "distribuuuu",
                 "train"],
    "train_net-spawn": [PY, "train_net.py", "--nproc-per-node", "2"],
    "train_net-plain": [PY, "train_net.py"],
}


def _start(out, launcher: str, *opts: str) -> tuple[subprocess.Popen, dict[int, str], object]:
    """LAUNCH[launcher] training LONG_EPOCH (and opts) into out, returned at its first training step."""
    return start_until_training([*LAUNCH[launcher], "--cfg", TINY, "OUT_DIR", str(out), *LONG_EPOCH, *opts], out)


def _stop_while_training(out, launcher: str, sig: int, *opts: str, to_group: bool = False) -> tuple[int, str, dict]:
    """Start the launcher, send sig to its pid (or its process group) at the first training step.

    Returns (exit status, console output, the job's processes as recorded while it ran), having
    asserted that none of them is left; kills whatever is, so that a failing test leaves nothing either.
    """
    proc, job, console = _start(out, launcher, *opts)
    try:
        (os.killpg if to_group else os.kill)(proc.pid, sig)
        status = proc.wait(timeout=60)
        left = wait_gone(job, 15)
    finally:
        kill_tree(proc, job)
    text = console.read_text()
    assert not left, f"left behind: {left}\n{text[-4000:]}"
    return status, text, job


def _assert_step_checkpoint(out) -> dict:
    """The stop wrote a mid-epoch step checkpoint, whole (it loads); returns it."""
    ckpt = torch.load(out / "checkpoints" / "last.pth", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == 0 and 0 < ckpt["samples_in_epoch"] < 1024, {k: ckpt[k] for k in ("epoch", "samples_in_epoch")}
    assert list((out / "checkpoints").glob("step_*.pth")), sorted(os.listdir(out / "checkpoints"))
    return ckpt


def _assert_rerun_resumes(out, launcher: str, ckpt: dict, *opts: str) -> None:
    """The same command again continues from the step checkpoint and completes the epoch."""
    check(run([*LAUNCH[launcher], "--cfg", TINY, "OUT_DIR", str(out), *LONG_EPOCH, *opts], timeout=180))
    said = f"{ckpt['samples_in_epoch']} samples into epoch 1, step {ckpt['global_step']}"
    assert said in read_text_or_empty(out / "log.txt"), read_text_or_empty(out / "log.txt")[-3000:]
    train = [m for m in read_metrics(str(out)) if m["split"] == "train"]
    assert [m["n"] for m in train] == [1024]  # the whole epoch, before and after the stop


# ---------------------------------------------------------------------------------------------
# To the launcher's pid
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("launcher", ["spawn", "train_net-spawn", "train_net-plain"])
def test_sigterm_to_the_launcher_pid_checkpoints_and_the_rerun_resumes(tmp_path, launcher):
    """`kill PID`: 143 like SIGTERM to the group, a step checkpoint, no process left, resumable.

    train_net.py --nproc-per-node takes the spawner's code path: its re-run is left out (time)."""
    out = tmp_path / "run"
    status, console, job = _stop_while_training(out, launcher, signal.SIGTERM)
    assert status == 128 + signal.SIGTERM, f"exit {status}\n{console[-4000:]}"
    assert "Traceback" not in console, console[-6000:]
    if "--nproc-per-node" in LAUNCH[launcher]:
        assert len(job) >= 3, job  # the spawner and its 2 ranks were seen, and are gone
        assert "[spawn] stopped by SIGTERM; all processes stopped" in console.splitlines()
    ckpt = _assert_step_checkpoint(out)
    if launcher != "train_net-spawn":
        _assert_rerun_resumes(out, launcher, ckpt)


def test_a_preemption_signal_to_the_spawner_pid_is_relayed_to_the_ranks(tmp_path):
    """`kill -USR1 PID` of the spawner (sbatch --signal=B:USR1, or a user): SIGUSR1, a default
    TRAIN.PREEMPT_SIGNALS signal, is passed on to the ranks, which write their step checkpoint and
    exit 138; the spawner waits for them and exits 138 too, and the same command resumes. Before, the
    signal's default action ended the spawner at once and its ranks with it (SIGINT, no checkpoint)."""
    out = tmp_path / "run"
    status, console, job = _stop_while_training(out, "spawn", signal.SIGUSR1)
    assert status == 128 + signal.SIGUSR1, f"exit {status}\n{console[-4000:]}"
    assert "Traceback" not in console and "stopped by SIGINT" not in console, console[-6000:]
    assert len(job) >= 3, job  # the spawner and its 2 ranks were seen, and are gone
    assert "[spawn] stopped by SIGUSR1, relayed to every process" in console.splitlines(), console[-4000:]
    _assert_rerun_resumes(out, "spawn", _assert_step_checkpoint(out))


@pytest.mark.parametrize("launcher", ["spawn", "train_net-plain"])
def test_sigint_to_the_launcher_pid_is_ctrl_c(tmp_path, launcher):
    """`kill -INT PID`: every rank stops as after Ctrl-C (SIGINT is not a preemption signal):
    one `stopped by SIGINT` line per rank, status 130, nothing left, no step checkpoint."""
    out = tmp_path / "run"
    status, console, _ = _stop_while_training(out, launcher, signal.SIGINT)
    assert status == 130, f"exit {status}\n{console[-4000:]}"
    assert "Traceback" not in console, console[-6000:]
    lines = console.splitlines()
    assert "stopped by SIGINT" in lines, console[-4000:]
    if launcher == "spawn":
        # The spawner relayed SIGINT itself (it used to send SIGTERM, so the ranks preempted).
        assert "stopped by SIGINT (rank 1)" in lines and "[spawn] stopped by SIGINT; all processes stopped" in lines
    assert not list((out / "checkpoints").glob("step_*.pth"))


def test_sigterm_not_a_preemption_signal_unwinds_every_rank_like_ctrl_c(tmp_path):
    """With SIGTERM not a preemption signal, each rank raises Terminated at once: one line, status 143.

    The spawner passes the SIGTERM on to both ranks; each prints `stopped by SIGTERM` (rank 1
    with its rank), leaves its process group and exits 143, which the spawner returns.
    """
    status, console, _ = _stop_while_training(tmp_path / "run", "spawn", signal.SIGTERM,
                                              "TRAIN.PREEMPT_SIGNALS", "['SIGUSR1']")
    assert status == 143, f"exit {status}\n{console[-4000:]}"
    assert "Traceback" not in console, console[-6000:]
    lines = console.splitlines()
    assert "stopped by SIGTERM" in lines and "stopped by SIGTERM (rank 1)" in lines, console[-4000:]
    assert "[spawn] stopped by SIGTERM; all processes stopped" in lines
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*.pth"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_to_torchrun_leaves_no_process_and_no_rank_traceback(tmp_path, sig):
    """torchrun's agent reports the signal its own way (exit 1, its own traceback): our ranks stop
    without one; SIGTERM, a preemption signal, still leaves a whole step checkpoint."""
    out = tmp_path / "run"
    status, console, job = _stop_while_training(out, "torchrun", sig)
    assert status != 0 and not re.search(r"\[rank\d\]: Traceback", console), console[-6000:]
    assert len(job) >= 3, job  # the agent and its 2 ranks were seen, and are gone
    if sig == signal.SIGTERM:
        _assert_step_checkpoint(out)


def test_sigkill_to_the_spawner_takes_the_children_along(tmp_path):
    """A spawner killed outright (OOM killer, kill -9) cannot clean up: the kernel stops its children."""
    status, _, job = _stop_while_training(tmp_path / "run", "spawn", signal.SIGKILL)
    assert status == -signal.SIGKILL and len(job) >= 3, job


# ---------------------------------------------------------------------------------------------
# To the whole process group
# ---------------------------------------------------------------------------------------------
def test_sigterm_to_the_spawners_group_reaches_each_rank_once(tmp_path):
    """`kill -TERM -PGID` (a terminal, some supervisors): the same as `kill PID`.

    The ranks run in sessions of their own, so only the spawner gets the group's SIGTERM and
    relays it once. Before, each rank got it twice (from the group and from the spawner); the
    second escalated on some ranks only: no step checkpoint and a peer's traceback.
    """
    out = tmp_path / "run"
    status, console, _ = _stop_while_training(out, "spawn", signal.SIGTERM, to_group=True)
    assert status == 143, f"exit {status}\n{console[-4000:]}"
    assert "Traceback" not in console, console[-6000:]
    assert "[spawn] stopped by SIGTERM; all processes stopped" in console.splitlines()
    _assert_step_checkpoint(out)  # on every rank: the ranks agreed on it, none was cut short


@pytest.mark.parametrize("launcher", ["plain", "torchrun"])
def test_whole_group_sigterm_with_loader_workers_checkpoints_and_resumes(tmp_path, launcher):
    """The workers get the group's SIGTERM too: they ignore it, the main process writes its step
    checkpoint, ends its workers, exits 143; nothing is left and the same command finishes the epoch.
    Before: the workers died first, the checkpoint failed on 'DataLoader worker ... killed', exit 1."""
    out = tmp_path / "run"
    status, console, job = _stop_while_training(out, launcher, signal.SIGTERM, *LOADER_WORKERS, to_group=True)
    assert "killed by signal" not in console and "distribuuuu/" not in console, console[-6000:]
    if launcher == "torchrun":  # its agent reports the group's SIGTERM its own way (SignalException, exit 1)
        assert status != 0 and not re.search(r"\[rank\d\]: Traceback", console), console[-6000:]
    else:
        assert status == 143 and "Traceback" not in console, f"exit {status}\n{console[-6000:]}"
    assert len(job) >= (3 if launcher == "plain" else 7), job  # the ranks' workers were seen, and are gone
    _assert_rerun_resumes(out, launcher, _assert_step_checkpoint(out), *LOADER_WORKERS)


# ---------------------------------------------------------------------------------------------
# To one rank: one line per rank, and no peer traceback. Before: the stopped rank said `stopped by
# SIGINT (rank 1)` but its peer, whose next gloo collective failed ("Connection closed by peer"),
# printed `rank 0 failed: RuntimeError` and a full traceback, as if it had crashed.
# ---------------------------------------------------------------------------------------------
def _rank_pids(out, job: dict[int, str], launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the two ranks: rank 0's pid is in run.lock; the other rank is the other
    process that runs distribuuuu's training (not the launcher, not multiprocessing's helper)."""
    rank0 = json.loads((out / "run.lock").read_text())["pid"]
    others = [pid for pid in job if pid not in (launcher_pid, rank0) and cmdline(pid)
              and "resource_tracker" not in cmdline(pid)]
    assert len(others) == 1, (rank0, others, job)
    return {0: rank0, 1: others[0]}


def _assert_one_line_per_rank(text: str, name: str) -> None:
    """Each rank ends with one `stopped by NAME` line; no rank prints a traceback or gloo's error."""
    ranks = text.split("[dist] rank 0/2", 1)[-1]
    # torchrun's agent prints its own report (ChildFailedError, with a traceback of the agent):
    # that is torchrun's, so look only at what the ranks wrote (before the agent's first line).
    ranks = ranks.split("torch/distributed/elastic/multiprocessing/api.py", 1)[0]
    assert "Traceback" not in ranks and "Connection closed by peer" not in ranks and "failed:" not in ranks, text
    stops = [ln for ln in text.splitlines() if ln.startswith(f"stopped by {name}")]
    assert len(stops) == 2, text[-4000:]
    assert any("got it, and this process ended with it" in ln for ln in stops), stops


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_sigint_to_one_worker_rank_ends_every_rank_with_one_line(tmp_path, launcher):
    out = tmp_path / "run"
    proc, job, console = _start(out, launcher)
    try:
        os.kill(_rank_pids(out, job, proc.pid)[1], signal.SIGINT)
        status = proc.wait(timeout=90)
        left = wait_gone(job, 15)
    finally:
        kill_tree(proc, job)
    text = console.read_text()
    assert not left, f"left behind: {left}\n{text[-4000:]}"
    _assert_one_line_per_rank(text, "SIGINT")
    if launcher == "spawn":
        assert status == 130, text[-4000:]  # docs/launching.md: stopped by SIGINT
    else:
        assert status != 0, text[-4000:]  # torchrun's agent reports a failed worker its own way (exit 1)
    assert "stopped by SIGINT (rank 1)" in text

"""Issue 14 item 9: a stop signal reaches the job however it is sent.

`kill PID` (what a supervisor does) to the built-in spawner or to a plain `python train_net.py`
must do what Ctrl-C / SIGTERM to the whole process group does: every rank gets the signal once,
SIGTERM (a TRAIN.PREEMPT_SIGNALS signal) writes a step checkpoint that the next run resumes, the
launcher exits with 128 + the signal, and no process is left. Real processes and real signals.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tests.conftest import ROOT, TINY, alive, check, cmdline, env, kill_tree, process_tree, read_metrics, wait_gone

pytestmark = pytest.mark.e2e  # every test here starts processes

PY = sys.executable
# 1024 samples / (2 ranks x 16) = 32 steps in the one epoch (64 in one process): long enough that a
# signal sent once the first progress line is logged lands mid-epoch, where a step checkpoint is due.
LONG_EPOCH = ["OPTIM.MAX_EPOCH", "1", "TRAIN.SYNTHETIC_SAMPLES", "1024", "TEST.SYNTHETIC_SAMPLES", "16",
              "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8"]
LAUNCH = {
    "spawn": [PY, "-m", "distribuuuu", "train", "--nproc-per-node", "2"],
    "train_net-spawn": [PY, "train_net.py", "--nproc-per-node", "2"],
    "train_net-plain": [PY, "train_net.py"],
}


# ---------------------------------------------------------------------------------------------
# Stop a training run with a real signal
# ---------------------------------------------------------------------------------------------


def _stop_while_training(out, cmd: list[str], sig: int, to_group: bool = False) -> tuple[int, str, dict]:
    """Start cmd, wait until log.txt shows training steps, send sig to cmd's pid (or its group).

    Returns (exit status, console output, the job's processes as recorded while it ran); kills
    whatever is left at the end so that a failing test leaves nothing behind either.
    """
    console = out.parent / f"{out.name}.console.txt"
    with open(console, "w") as log:
        proc = subprocess.Popen([*cmd, "--cfg", TINY, "OUT_DIR", str(out), *LONG_EPOCH], cwd=ROOT, env=env(),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    job: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 120
        while "[train] epoch 1/1 iter" not in _read(out / "log.txt"):
            assert proc.poll() is None, f"exited {proc.returncode} early:\n{console.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no training step after 120 s\n{console.read_text()[-4000:]}"
            job.update(process_tree(proc.pid))
            time.sleep(0.1)
        job.update(process_tree(proc.pid))
        (os.killpg if to_group else os.kill)(proc.pid, sig)
        status = proc.wait(timeout=45)
        left = wait_gone(job, 10)
    finally:
        kill_tree(proc, job)
    text = console.read_text()
    assert not left, f"left behind: {left}\n{text[-4000:]}"
    return status, text, job


def _read(path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def _assert_step_checkpoint(out) -> dict:
    """The stop wrote a mid-epoch step checkpoint, whole (it loads); returns it."""
    ckpt = torch.load(out / "checkpoints" / "last.pth", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == 0 and 0 < ckpt["samples_in_epoch"] < 1024, {k: ckpt[k] for k in ("epoch", "samples_in_epoch")}
    assert list((out / "checkpoints").glob("step_*.pth")), sorted(os.listdir(out / "checkpoints"))
    return ckpt


def _assert_rerun_resumes(out, cmd: list[str], ckpt: dict) -> None:
    """The same command again continues from the step checkpoint and completes the epoch."""
    again = subprocess.run([*cmd, "--cfg", TINY, "OUT_DIR", str(out), *LONG_EPOCH], cwd=ROOT, env=env(),
                           capture_output=True, text=True, timeout=180)
    check(again)
    said = f"{ckpt['samples_in_epoch']} samples into epoch 1, step {ckpt['global_step']}"
    assert said in _read(out / "log.txt"), _read(out / "log.txt")[-3000:]
    train = [m for m in read_metrics(str(out)) if m["split"] == "train"]
    assert [m["n"] for m in train] == [1024]  # the whole epoch, before and after the stop


@pytest.mark.parametrize("launcher", list(LAUNCH))
def test_sigterm_to_the_launcher_pid_checkpoints_and_the_rerun_resumes(tmp_path, launcher):
    """`kill PID`: 143 like SIGTERM to the group, a step checkpoint, no process left, resumable.

    train_net.py --nproc-per-node takes the spawner's code path: its re-run is left out (time)."""
    out = tmp_path / "run"
    status, console, job = _stop_while_training(out, LAUNCH[launcher], signal.SIGTERM)
    assert status == 128 + signal.SIGTERM, f"exit {status}\n{console[-4000:]}"
    assert "Traceback" not in console, console[-6000:]
    if "--nproc-per-node" in LAUNCH[launcher]:
        assert len(job) >= 3, job  # the spawner and its 2 ranks were seen, and are gone
        assert "[spawn] stopped by SIGTERM; all processes stopped" in console.splitlines()
    ckpt = _assert_step_checkpoint(out)
    if launcher != "train_net-spawn":
        _assert_rerun_resumes(out, LAUNCH[launcher], ckpt)


def test_a_preemption_signal_to_the_spawner_pid_is_relayed_to_the_ranks(tmp_path):
    """`kill -USR1 PID` of the spawner (sbatch --signal=B:USR1, or a user): SIGUSR1, a default
    TRAIN.PREEMPT_SIGNALS signal, is passed on to the ranks, which write their step checkpoint and
    exit 138; the spawner waits for them and exits 138 too, and the same command resumes. Before, the
    signal's default action ended the spawner at once and its ranks with it (SIGINT, no checkpoint)."""
    out = tmp_path / "run"
    status, console, job = _stop_while_training(out, LAUNCH["spawn"], signal.SIGUSR1)
    assert status == 128 + signal.SIGUSR1, f"exit {status}\n{console[-4000:]}"
    assert "Traceback" not in console and "stopped by SIGINT" not in console, console[-6000:]
    assert len(job) >= 3, job  # the spawner and its 2 ranks were seen, and are gone
    assert "[spawn] stopped by SIGUSR1, relayed to every process" in console.splitlines(), console[-4000:]
    _assert_rerun_resumes(out, LAUNCH["spawn"], _assert_step_checkpoint(out))


def test_sigterm_to_the_spawners_group_reaches_each_rank_once(tmp_path):
    """`kill -TERM -PGID` (a terminal, some supervisors): the same as `kill PID`.

    The ranks run in sessions of their own, so only the spawner gets the group's SIGTERM and
    relays it once. Before, each rank got it twice (from the group and from the spawner); the
    second escalated on some ranks only: no step checkpoint and a peer's traceback.
    """
    out = tmp_path / "run"
    status, console, _ = _stop_while_training(out, LAUNCH["spawn"], signal.SIGTERM, to_group=True)
    assert status == 143, f"exit {status}\n{console[-4000:]}"
    assert "Traceback" not in console, console[-6000:]
    assert "[spawn] stopped by SIGTERM; all processes stopped" in console.splitlines()
    _assert_step_checkpoint(out)  # on every rank: the ranks agreed on it, none was cut short


@pytest.mark.parametrize("launcher", ["spawn", "train_net-plain"])
def test_sigint_to_the_launcher_pid_is_ctrl_c(tmp_path, launcher):
    """`kill -INT PID`: every rank stops as after Ctrl-C (SIGINT is not a preemption signal):
    one `stopped by SIGINT` line per rank, status 130, nothing left, the last checkpoint intact."""
    out = tmp_path / "run"
    status, console, _ = _stop_while_training(out, LAUNCH[launcher], signal.SIGINT)
    assert status == 130, f"exit {status}\n{console[-4000:]}"
    assert "Traceback" not in console, console[-6000:]
    lines = console.splitlines()
    assert "stopped by SIGINT" in lines, console[-4000:]
    if launcher == "spawn":
        # The spawner relayed SIGINT itself (it used to send SIGTERM, so the ranks preempted).
        assert "stopped by SIGINT (rank 1)" in lines and "[spawn] stopped by SIGINT; all processes stopped" in lines
    assert not list((out / "checkpoints").glob("step_*.pth"))


def test_a_second_signal_to_the_spawner_reaches_a_stuck_rank(tmp_path):
    """The first SIGTERM is relayed and recorded (a step checkpoint would start); the ranks then
    hang, as in a stuck save. A second SIGTERM to the spawner is relayed too and ends them at
    once, long before the spawner's 30 s grace period and its SIGKILL."""
    script = textwrap.dedent(f"""
        import sys
        from distribuuuu.launch import spawn
        from tests import _signal_workers as w
        sys.exit(spawn.spawn(w.stuck_save_worker, 2, ({str(tmp_path)!r},)))
    """)
    proc = subprocess.Popen([PY, "-c", script], cwd=ROOT, env=env(), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job: dict[int, str] = {}
    try:
        _wait_files(tmp_path, "ready", proc)
        job = process_tree(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)
        _wait_files(tmp_path, "recorded", proc)  # both ranks got the relayed first signal
        time.sleep(0.5)
        assert proc.poll() is None and len(alive(job)) >= 3  # the "stuck save" holds them
        start = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=25)
        took = time.monotonic() - start
        # The spawner has exited; a helper of its own (multiprocessing's resource tracker) sees
        # its pipe close and exits a moment later, so wait a little rather than look at once.
        left = {pid: cmdline(pid) for pid in wait_gone(job, 10)}
    finally:
        kill_tree(proc, job)
    assert proc.returncode == 143, err
    assert took < 15, f"{took:.1f} s: the second signal was not relayed (SIGKILL after the grace period)"
    assert "ended with status 137" not in err, err  # no rank needed the SIGKILL
    assert not left, f"left running 10 s after the spawner exited: {left}"


def _wait_files(folder, prefix: str, proc: subprocess.Popen, n: int = 2, timeout_s: float = 60) -> None:
    end = time.monotonic() + timeout_s
    while len(list(folder.glob(prefix + "*"))) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, f"no {prefix} files after {timeout_s} s"
        time.sleep(0.05)

"""When and how often a stop comes. Every way a job is stopped ends with a checkpoint where one is
due, one line, a documented exit status (docs/launching.md, "Exit status"), and nothing left running.

Real processes, real signals, through the installed command: a terminal that closes (a real pty
hung up: SIGHUP to the launcher, then EIO on every write to it), a preemption signal sent twice or
three times, a signal that lands during the evaluation, a second SIGTERM during the checkpoint's
write, a stop while the spawner starts its processes. Each test waits for what it needs to see (a
line of log.txt, a temporary checkpoint file) before it signals; none times the run.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import sys
import termios
import threading
import time

import pytest
import torch

from tests.conftest import (
    ROOT,
    TINY,
    env,
    kill_tree,
    process_tree,
    read_text_or_empty,
    start_until_training,
    wait_gone,
)

pytestmark = pytest.mark.e2e  # every test here starts processes

COMMAND = os.path.join(os.path.dirname(sys.executable), "distribuuuu")  # the console script
LAUNCH = {"spawn": [COMMAND, "train", "--nproc-per-node", "2"], "plain": [COMMAND, "train"]}
# 1024 samples / 16 per process: 32 steps in 2 processes, 64 in one; a print line every 4 steps.
EPOCH = ["OPTIM.MAX_EPOCH", "1", "TRAIN.SYNTHETIC_SAMPLES", "1024", "TEST.SYNTHETIC_SAMPLES", "16",
         "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8"]


def _args(launcher: str, out, *opts: str) -> list[str]:
    return [*LAUNCH[launcher], "--cfg", TINY, "OUT_DIR", str(out), *EPOCH, *opts]


def _step_checkpoint(out) -> dict:
    """last.pth is a whole mid-epoch checkpoint (it loads): the stop saved the run first."""
    ckpt = torch.load(out / "checkpoints" / "last.pth", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == 0 and ckpt["samples_in_epoch"] > 0, {k: ckpt[k] for k in ("epoch", "samples_in_epoch")}
    return ckpt


def _stop_lines(text: str, name: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(f"stopped by {name}")]


def _iters(out) -> int:
    """The progress lines rank 0 has written to log.txt so far."""
    return read_text_or_empty(out / "log.txt").count("[train] epoch 1/1 iter")


def _after_new_lines(out, proc: subprocess.Popen, n: int = 2) -> None:
    """Wait until rank 0 has logged n more progress lines: its main thread ran on well after a signal
    sent before this call, so the signal's handler has run (two signals cannot merge into one)."""
    start, deadline = _iters(out), time.monotonic() + 120
    while _iters(out) < start + n:
        assert proc.poll() is None and time.monotonic() < deadline, f"exit {proc.poll()}"
        time.sleep(0.02)


def _finish(proc: subprocess.Popen, job: dict[int, str], timeout: float = 90) -> tuple[int, list[int]]:
    """The launcher's status and whatever of the job (its processes, looked up while it runs) is still
    running 10 s after it exited."""
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"still running after {timeout} s"
            job.update(process_tree(proc.pid))
            time.sleep(0.05)
        return proc.returncode, wait_gone(job, 10)
    finally:
        kill_tree(proc, job)


def _writing(out) -> bool:
    """Whether a checkpoint is being written (its temporary file <name>.tmp.<pid> is there)."""
    try:
        return any(".tmp." in name for name in os.listdir(out / "checkpoints"))
    except FileNotFoundError:
        return False


# ---------------------------------------------------------------------------------------------
# A terminal that closes: SIGHUP
# ---------------------------------------------------------------------------------------------
def _hangup_as_a_shell_leaves_it() -> None:
    """In the child, before exec: SIGHUP at its default, as a shell on a terminal starts a command. The
    suite itself may run with SIGHUP ignored (`nohup make test`), which its children would inherit,
    and an ignored SIGHUP stays ignored (test_nohup_keeps_a_run_going_when_its_terminal_closes)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _as_a_terminal_starts_it() -> None:
    _hangup_as_a_shell_leaves_it()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)  # the pty becomes the controlling terminal


def _on_a_terminal(argv: list[str], out, ignore_hangup: bool = False) -> tuple[subprocess.Popen, dict[int, str],
                                                                               threading.Event]:
    """argv with a real terminal (a pty) as its controlling terminal and its stdin/stdout/stderr, its
    output drained by a thread; returned once log.txt shows training steps. Setting the returned
    event closes the terminal: the kernel hangs it up and sends SIGHUP to argv's process. ignore_hangup:
    started as `nohup` starts it (SIGHUP ignored)."""
    master, slave = os.openpty()

    def start() -> None:
        _as_a_terminal_starts_it()
        if ignore_hangup:
            signal.signal(signal.SIGHUP, signal.SIG_IGN)

    proc = subprocess.Popen(argv, cwd=ROOT, env=env(), stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                            preexec_fn=start)
    os.close(slave)
    hang_up = threading.Event()

    def drain() -> None:  # a terminal nobody reads fills up and blocks the writers
        while not hang_up.is_set():
            if select.select([master], [], [], 0.05)[0]:
                try:
                    os.read(master, 65536)
                except OSError:  # every process closed its end
                    hang_up.wait()
        os.close(master)

    threading.Thread(target=drain, daemon=True).start()
    job: dict[int, str] = {}
    deadline = time.monotonic() + 180
    while "[train] epoch 1/1 iter" not in read_text_or_empty(out / "log.txt"):
        if proc.poll() is not None or time.monotonic() > deadline:
            hang_up.set()
            kill_tree(proc, job)
            pytest.fail(f"no training step (exit {proc.returncode})")
        job.update(process_tree(proc.pid))
        time.sleep(0.1)
    job.update(process_tree(proc.pid))
    return proc, job, hang_up


@pytest.mark.parametrize("launcher", list(LAUNCH))
def test_a_closed_terminal_checkpoints_and_ends_129(tmp_path, launcher):
    """The terminal that runs `distribuuuu train` closes (a window closed, an ssh connection dropped):
    SIGHUP is a stop from outside, as SIGTERM: a step checkpoint, every process ends with 129, and its
    line is in log.txt (the terminal is gone); the same command resumes. Writes to the closed terminal
    fail (EIO), so the processes leave it for /dev/null. Before: the spawner died of the signal at
    once, its ranks got SIGINT, no checkpoint; a plain run died at once."""
    out = tmp_path / "run"
    proc, job, hang_up = _on_a_terminal(_args(launcher, out), out)
    hang_up.set()
    status, left = _finish(proc, job)
    log = read_text_or_empty(out / "log.txt")
    assert status == 128 + signal.SIGHUP, f"exit {status}\n{log[-3000:]}"
    assert not left, f"left running: {left}"
    assert "stopped by SIGHUP after a checkpoint" in log and "Traceback" not in log, log[-3000:]
    if launcher == "spawn":
        assert "stopped by SIGHUP (rank 1) after a checkpoint" in log, log[-3000:]
    ckpt = _step_checkpoint(out)
    if launcher == "plain":  # the spawner's ranks resume the same way (tests/test_stop_signals.py)
        again = subprocess.run(_args(launcher, out), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240)
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"{ckpt['samples_in_epoch']} samples into epoch 1, step {ckpt['global_step']}" in again.stdout


def test_nohup_keeps_a_run_going_when_its_terminal_closes(tmp_path):
    """`nohup distribuuuu train ...`: SIGHUP was ignored when the command started, and stays ignored
    (launch/signals.py): the terminal closes mid-epoch and the run trains to its end, exit 0."""
    out = tmp_path / "run"
    proc, job, hang_up = _on_a_terminal(_args("spawn", out), out, ignore_hangup=True)
    hang_up.set()
    status, left = _finish(proc, job)
    log = read_text_or_empty(out / "log.txt")
    assert status == 0 and not left, f"exit {status}, left {left}\n{log[-3000:]}"
    assert "done: best val balanced top-1" in log and "stopped by" not in log, log[-3000:]


# ---------------------------------------------------------------------------------------------
# The same signal again
# ---------------------------------------------------------------------------------------------
# The ranks vote on a signal only at the epoch's end: a second signal surely comes before the
# checkpoint (4096 samples: 128 steps in 2 processes, 256 in one).
LATE_VOTE = ["DIST.VOTE_PERIOD_STEPS", "100000", "TRAIN.SYNTHETIC_SAMPLES", "4096"]


def test_a_preemption_signal_sent_twice_waits_for_the_checkpoint(tmp_path):
    """SIGUSR1 to the spawner twice, the second after the first was recorded and before the
    checkpoint it asks for: the second is held, the epoch's checkpoint is written, every process ends
    with 138 and one line. Before: the second SIGUSR1 killed each rank at once (its default action):
    exit 138 with the spawner's preemption line, and no checkpoint."""
    out = tmp_path / "run"
    proc, job, console = start_until_training(_args("spawn", out, *LATE_VOTE), out)
    os.kill(proc.pid, signal.SIGUSR1)
    _after_new_lines(out, proc)
    os.kill(proc.pid, signal.SIGUSR1)
    status, left = _finish(proc, job)
    text = console.read_text()
    assert status == 128 + signal.SIGUSR1, f"exit {status}\n{text[-4000:]}"
    assert not left, f"left running: {left}"
    assert (out / "checkpoints" / "last.pth").exists(), f"no checkpoint\n{text[-3000:]}"
    ckpt = torch.load(out / "checkpoints" / "last.pth", map_location="cpu", weights_only=True)
    assert (ckpt["epoch"], ckpt["samples_in_epoch"]) == (1, 0)  # the epoch's end, where the ranks voted
    assert "Traceback" not in text, text[-4000:]
    assert "[spawn] stopped by SIGUSR1, relayed to every process" in text.splitlines(), text[-3000:]
    assert sorted(_stop_lines(text, "SIGUSR1")) == ["stopped by SIGUSR1 (rank 1) after a checkpoint",
                                                    "stopped by SIGUSR1 after a checkpoint"], text[-3000:]


def test_a_third_signal_stops_at_once_without_the_checkpoint(tmp_path):
    """The way out of a save that hangs: a third SIGTERM before the checkpoint ends the run at once,
    with 143 and its line, and writes nothing (the previous checkpoint, if any, stays the last)."""
    out = tmp_path / "run"
    proc, job, console = start_until_training(_args("plain", out, *LATE_VOTE), out)
    for _ in range(2):
        os.kill(proc.pid, signal.SIGTERM)
        _after_new_lines(out, proc)
    os.kill(proc.pid, signal.SIGTERM)
    status, left = _finish(proc, job)
    text = console.read_text()
    assert status == 128 + signal.SIGTERM, f"exit {status}\n{text[-4000:]}"
    assert not left and "Traceback" not in text, text[-4000:]
    assert _stop_lines(text, "SIGTERM") == ["stopped by SIGTERM"], text[-3000:]
    assert not (out / "checkpoints").exists() or not os.listdir(out / "checkpoints")


def test_a_second_sigterm_during_the_checkpoint_write_is_held(tmp_path):
    """SIGTERM, then another as soon as the step checkpoint's temporary file appears (a ResNet-18:
    a write long enough to land in): the write completes, the run ends with 143 after it. Before: the
    second SIGTERM cut the write short, and the run ended without its checkpoint."""
    out = tmp_path / "run"
    proc, job, console = start_until_training(_args("plain", out, "MODEL.ARCH", "resnet18", "TRAIN.BATCH_SIZE", "4",
                                                    "MODEL.NUM_CLASSES", "10"), out)
    os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while not _writing(out):
        assert proc.poll() is None and time.monotonic() < deadline, console.read_text()[-3000:]
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGTERM)
    status, left = _finish(proc, job)
    text = console.read_text()
    assert status == 128 + signal.SIGTERM and not left, f"exit {status}, left {left}\n{text[-4000:]}"
    assert _stop_lines(text, "SIGTERM") == ["stopped by SIGTERM after a checkpoint"], text[-3000:]
    _step_checkpoint(out)


def test_a_third_signal_to_the_spawner_reaches_a_rank_stuck_in_its_checkpoint(tmp_path):
    """The spawner relays every SIGTERM. The ranks record the first and then hang, as in a save that
    never ends (tests/_faults.stuck_checkpoint_worker); they hold the second; the third, relayed
    too, ends them at once (143), long before the spawner's 30 s grace period and its SIGKILL."""
    script = ("import sys\nfrom distribuuuu.launch import spawn\nfrom tests import _faults\n"
              f"sys.exit(spawn.spawn(_faults.stuck_checkpoint_worker, 2, ({str(tmp_path)!r},)))")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env(), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job: dict[int, str] = {}
    try:
        for taken in range(3):  # each SIGTERM only once both ranks took the one before
            deadline = time.monotonic() + 120
            while len(list(tmp_path.glob(f"{taken}?"))) < 2:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                job.update(process_tree(proc.pid))
                time.sleep(0.02)
            start = time.monotonic()
            os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=25)
        took = time.monotonic() - start
        left = wait_gone(job, 10)
    finally:
        kill_tree(proc, job)
    assert proc.returncode == 128 + signal.SIGTERM and not left, (proc.returncode, left, err)
    assert took < 15 and "ended with status 137" not in err, err  # no rank needed the SIGKILL
    assert "[spawn] stopped by SIGTERM; all processes stopped" in err.splitlines(), err


# ---------------------------------------------------------------------------------------------
# During evaluation, and while the processes start
# ---------------------------------------------------------------------------------------------
def test_a_signal_during_the_last_evaluation_ends_after_the_epochs_checkpoint(tmp_path):
    """SIGTERM lands while the last epoch evaluates (sent by a hook, after the evaluation and before
    the epoch's checkpoint): the checkpoint is written, then the run ends with 143 and its line.
    Before: the loop never voted again, the signal was forgotten and the run ended 0, `done`."""
    out = tmp_path / "run"
    e = {**env(), "STOP_SIGNAL": "SIGTERM"}
    proc = subprocess.run([*_args("plain", out), "TRAIN.HOOKS", "['tests._faults:SignalDuringEvaluation']"],
                          cwd=ROOT, env=e, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, f"exit {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    assert _stop_lines(proc.stderr, "SIGTERM") == ["stopped by SIGTERM after a checkpoint"], proc.stderr[-3000:]
    ckpt = torch.load(out / "checkpoints" / "last.pth", map_location="cpu", weights_only=True)
    assert (ckpt["epoch"], ckpt["samples_in_epoch"]) == (1, 0)
    assert "] done" not in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_while_the_spawner_starts_its_processes(tmp_path, sig):
    """A stop signal to the spawner as soon as it says it starts its processes: no checkpoint is due;
    128 + the signal, the spawner's one line, no traceback, nothing left running. Before, SIGHUP ended
    the spawner at once, without a line."""
    out = tmp_path / "run"
    console = tmp_path / "console.txt"
    with open(console, "w") as f:
        proc = subprocess.Popen(_args("spawn", out), cwd=ROOT, env=env(), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_hangup_as_a_shell_leaves_it)
    job: dict[int, str] = {}
    deadline = time.monotonic() + 120
    while "[spawn] 2 processes" not in read_text_or_empty(console):
        assert proc.poll() is None and time.monotonic() < deadline, read_text_or_empty(console)
        time.sleep(0.01)
    os.kill(proc.pid, sig)
    status, left = _finish(proc, job)
    text = console.read_text()
    assert status == 128 + sig and not left, f"exit {status}, left {left}\n{text[-4000:]}"
    assert f"[spawn] stopped by {sig.name}; all processes stopped" in text.splitlines() and "Traceback" not in text, text
    assert not (out / "checkpoints").exists()

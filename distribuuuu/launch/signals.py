"""Signals, in one place: how a process stops (Ctrl-C, SIGTERM, a
hang-up) and how a run is preempted.

Two policies, both here:

- Stop signals (``handle_stop_signals``): SIGINT, SIGTERM and SIGHUP (a
  closed terminal, a dropped ssh) unwind the process cleanly and end it
  with 128 + the signal: 130 / 143 / 129. Installed by
  ``launch.comm.setup`` and ``launch.spawn.spawn``.
- Preemption (``preemption_signals``): a cluster that is about to take
  the machines back sends a signal (Slurm: ``--signal=USR1@90`` sends
  SIGUSR1 90 s before the end; most schedulers send SIGTERM). While it
  is active, the signals named in TRAIN.PREEMPT_SIGNALS (and SIGHUP with
  SIGTERM) only record themselves (``received``); the loop agrees with
  the other ranks (``launch.comm.max_over_ranks``), writes a checkpoint,
  and raises ``Preempted``; the run ends with 128 + signal number, after
  ``slurm_requeue`` when TRAIN.REQUEUE asks for it. A second preemption
  signal is held (the checkpoint comes first); a third stops at once,
  the way out of a stuck save.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from distribuuuu.launch import launcher

__all__ = [
    "STOP_SIGNALS",
    "Terminated",
    "PeerStopped",
    "follow_peer",
    "interruption",
    "handle_stop_signals",
    "restore_signal_handlers",
    "stop_status",
    "held_stop_signals",
    "preemption_signals",
    "received",
    "Preempted",
    "slurm_requeue",
]

# ---------------------------------------------------------------------------------------------
# Stop signals: Ctrl-C (SIGINT), SIGTERM and a hang-up (SIGHUP) end a
# process the same, clean way
# ---------------------------------------------------------------------------------------------


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP) as an exception. A KeyboardInterrupt, so it
    unwinds exactly like Ctrl-C."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__()
        self.signum = signum


class PeerStopped(KeyboardInterrupt):
    """Another rank was ended by a stop signal, which broke this rank's
    collective: this rank ends as stopped by the same signal (one line,
    128 + signal), not as a crash (launch.store.stopped_peer)."""

    def __init__(self, signum: int, peer: int) -> None:
        super().__init__(f"rank {peer} was stopped by {signal.Signals(signum).name}")
        self.signum, self.peer = signum, peer


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_stopping: int | None = None  # the stop signal this process is ending for, if any
_saved_handlers: dict[int, Any] = {}


def follow_peer(signum: int, peer: int) -> PeerStopped:
    """This process ends for the stop signal another rank got: later
    stop signals are ignored while it winds down, as after its own (the
    launcher stops the remaining ranks once one has ended)."""
    global _stopping
    _stopping = signum
    return PeerStopped(signum, peer)


def chain(error: BaseException) -> Iterator[BaseException]:
    """error and every exception under it: causes, contexts, and a
    CheckpointException's failures."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo += [current.__cause__, current.__context__]
        todo += [
            failure[0] for failure in getattr(current, "failures", {}).values()
        ]  # CheckpointException


def interruption(error: BaseException) -> KeyboardInterrupt | None:
    """The stop (KeyboardInterrupt, or Terminated) that error was raised
    on top of, if any.

    A stop signal that lands inside a library's write can come out
    wrapped: torch.save's zip writer then fails closing (a RuntimeError
    whose context is the interrupt), and torch.distributed.checkpoint
    collects it into a CheckpointException. Writers re-raise the stop
    itself, so the run ends as stopped (130 / 143), not as a failed
    write."""
    return next((e for e in chain(error) if isinstance(e, KeyboardInterrupt)), None)


def _leave_a_closed_terminal() -> None:
    """After a hang-up: stdout and stderr on the terminal that closed
    fail every write (EIO), which would turn the orderly ending into
    tracebacks and status 1; they go to /dev/null instead (log.txt keeps
    the lines). A terminal that hung up is a character device that is no
    longer a tty."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if stat.S_ISCHR(os.fstat(fd).st_mode) and not os.isatty(fd):
                os.dup2(devnull, fd)
    os.close(devnull)


def _on_stop_signal(signum: int, frame: Any) -> None:
    global _stopping
    if signum == signal.SIGHUP:
        _leave_a_closed_terminal()
    if _stopping is not None:
        return  # already on the way out: a second exception would cut the cleanup short
    _stopping = signum
    raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def handle_stop_signals() -> None:
    """Make SIGINT, SIGTERM and SIGHUP stop this process cleanly. Called
    by comm.setup() and spawn.spawn().

    The policy, in one place:

    - The first stop signal raises in the main thread: KeyboardInterrupt
      for SIGINT (what Python does anyway), ``Terminated`` (a
      KeyboardInterrupt) for SIGTERM and SIGHUP. All unwind through the
      same code: ``comm.session()`` destroys the process group, the CLI
      prints one line and exits with 128 + the signal number: 130 for
      SIGINT, 143 for SIGTERM, 129 for SIGHUP. The spawner first passes
      the same signal to its children and waits for them
      (``STOP_GRACE_S``); its children run in sessions of their own (as
      torchrun's do), so a signal to the job's process group (a
      terminal's Ctrl-C, the shell's SIGHUP when the terminal closes)
      reaches them once, through the spawner, exactly like a signal to
      the spawner's pid.
    - Later stop signals are ignored while the process winds down: under
      other launchers a terminal's Ctrl-C may reach every process and
      the launcher then forwards its own. Launchers follow up with
      SIGKILL when a process does not exit in time (torchrun and spawn:
      30 s).
    - A signal that was already ignored (``nohup``, ``cmd &`` in a
      script) stays ignored.

    During training, ``preemption_signals`` (below) takes over the
    signals named in TRAIN.PREEMPT_SIGNALS (SIGTERM by default, and
    SIGHUP with it): they first write a checkpoint at the next step,
    then end the run with the same status; a third one comes back here.
    """
    global _stopping
    if threading.current_thread() is not threading.main_thread():
        return  # Python delivers signals to the main thread only
    _stopping = None
    for signum in STOP_SIGNALS:
        previous = signal.getsignal(signum)
        if previous is signal.SIG_IGN or previous is _on_stop_signal:
            continue
        _saved_handlers[signum] = previous
        signal.signal(signum, _on_stop_signal)


def restore_signal_handlers() -> None:
    """Put back the handlers handle_stop_signals() replaced; kept while
    a stop is under way."""
    if _stopping is not None or threading.current_thread() is not threading.main_thread():
        return
    for signum, previous in list(_saved_handlers.items()):
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        del _saved_handlers[signum]


def stop_status(exc: KeyboardInterrupt) -> int:
    """The exit status of a process stopped by exc: 128 + signal, 130
    for Ctrl-C, 143 for SIGTERM."""
    return 128 + int(getattr(exc, "signum", signal.SIGINT))


@contextmanager
def held_stop_signals(act_after: bool = True) -> Iterator[None]:
    """Hold a SIGINT/SIGTERM that arrives inside the block, act on it
    after (or not: act_after False).

    The spawner starts its children in such a block: raised in the
    middle of mp.start_processes, the stop would lose the processes
    started so far (there is no context to stop yet); afterwards the
    usual path stops them all. slurm_requeue drops what it held.
    """
    held: list[int] = []
    saved = {}
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is _on_stop_signal:
                saved[signum] = signal.signal(signum, lambda n, _f: held.append(n))
    try:
        yield
    finally:
        for signum, previous in saved.items():
            signal.signal(signum, previous)
    if held and act_after:
        _on_stop_signal(held[0], None)  # raises KeyboardInterrupt / Terminated, as if it came now


# ---------------------------------------------------------------------------------------------
# Preemption: signals become a flag that the training loop reads at step
# boundaries
# ---------------------------------------------------------------------------------------------

received: int | None = (
    None  # the preemption signal this process received (the handler sets it; the loop reads it)
)
_repeats = 0  # preemption signals that came after it
_previous: dict[int, Any] = {}


def _record(signum: int, frame: Any) -> None:
    """The first preemption signal is recorded: the loop checkpoints at
    its next step boundary. A second is held: the same stop delivered
    twice (srun and torchrun both pass a scancel on, a person presses
    twice) must not cost the checkpoint. A third stops at once, as a
    stop signal does: the way out of a stuck save."""
    global received, _repeats
    if signum == signal.SIGHUP:
        _leave_a_closed_terminal()
    if received is None:
        received = signum
        return
    _repeats += 1
    if _repeats >= 2:
        _on_stop_signal(signum, frame)


@contextmanager
def preemption_signals(names: Sequence[str]) -> Iterator[None]:
    """Record the named signals (e.g. ["SIGTERM", "SIGUSR1"]) instead of
    acting on them; SIGHUP goes with SIGTERM (a hang-up stops a job from
    outside, as SIGTERM does); one already ignored stays ignored. Once
    one was received the process is ending for it: its handlers stay
    until teardown (restore_signal_handlers), so a repeat during the
    wind-down is held too, not a default action."""
    global received, _repeats
    received, _repeats = None, 0
    nums = {getattr(signal, name) for name in names}
    if signal.SIGTERM in nums:
        nums.add(signal.SIGHUP)
    for num in nums:
        if signal.getsignal(num) is not signal.SIG_IGN:
            _previous[num] = signal.signal(num, _record)
    try:
        yield
    finally:
        for num, previous in _previous.items():
            if received is None:
                signal.signal(num, previous)
            else:
                _saved_handlers.setdefault(num, previous)
        _previous.clear()


class Preempted(Exception):
    """A preemption signal arrived; a step checkpoint was written and
    the run must end."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum} after a checkpoint")
        self.signum = signum


def slurm_requeue() -> bool:
    """Put this Slurm job back in the queue (`scontrol requeue
    $SLURM_JOB_ID`); False if not Slurm.

    The requeued job starts the same batch script again, and
    TRAIN.AUTO_RESUME picks up the checkpoint. The sbatch script needs
    --requeue (and --signal=USR1@90 for an early warning). Slurm sends
    the job's steps SIGTERM as soon as it takes the requeue, often
    before scontrol returns: that stop is held and dropped (the run is
    ending for the preemption already), so it neither kills scontrol nor
    cuts the line that says the job was requeued.
    """
    job = launcher.slurm_job_id()
    if not job:
        print(
            "[preempt] TRAIN.REQUEUE is set but this is not a Slurm job: nothing requeued",
            flush=True,
        )
        return False
    with held_stop_signals(act_after=False):
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        print(
            f"[preempt] scontrol requeue {job}: "
            f"{'ok' if done.returncode == 0 else done.stderr.strip()}",
            flush=True,
        )
    return done.returncode == 0

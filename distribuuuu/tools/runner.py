"""The sweeps' one way to start a training run: `distribuuuu train ...`
in a child process.

`bench --scaling` and `bench --compare` both run real trainings one
after the other and read what each left in its run folder. Each run is a
fresh interpreter (no thread setting, CUDA context or RNG state carries
over from one run to the next), its output goes to a log file, and the
sweep gets back the exit status and, for a run that failed, the child's
one-line error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import distribuuuu
from distribuuuu.launch import signals

STOP_GRACE_S = (
    60.0  # a stopped child checkpoints first; the spawner itself waits 30 s for its children
)
TAIL_CHARS = 3000  # of a failed run's log, shown on stderr


@dataclass
class RunResult:
    """How one child run ended."""

    status: int  # the child's exit status (0: success, 2: a user error, 128 + N: signal N)
    log_path: str
    error: str = ""  # the child's one-line error message, when it printed one

    def tail(self, chars: int = TAIL_CHARS) -> str:
        """The end of the run's log, to show what went wrong."""
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]


def child_env(threads: int | None = None) -> dict[str, str]:
    """This process's environment for a child run: progress as lines (a
    log file gets no bar), unbuffered output, OMP_NUM_THREADS when
    threads is given, and PYTHONPATH so that the child runs the same
    distribuuuu code as this process, wherever it starts."""
    env = dict(os.environ, DISTRIBUUUU_PROGRESS="lines", PYTHONUNBUFFERED="1")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    root = os.path.dirname(os.path.dirname(os.path.abspath(distribuuuu.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(
        [root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    return env


def error_line(log_path: str) -> str:
    """The message of the last 'error...' line of a log (one rank's may
    be prefixed 'error (rank N):' or, from the spawner, 'error (ranks N,
    M):'), or 'see the log'."""
    with open(log_path, errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.startswith("error")]
    return lines[-1].split(": ", 1)[-1] if lines else "see the log"


def _stop(child: subprocess.Popen, signum: int) -> None:
    """Pass a stop on to the child, once, and give it time to end
    cleanly (it stops its own processes and keeps its checkpoint); then
    kill it."""
    if child.poll() is None:
        child.send_signal(signum)
        try:
            child.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()  # the spawner's children follow it (PR_SET_PDEATHSIG)
            child.wait()


def run_train(args: list[str], log_path: str, threads: int | None = None) -> RunResult:
    """Run `distribuuuu args` (a `train` command line) in a fresh
    interpreter, its output in log_path, and wait for it to end.

    The child runs in a session of its own, as the spawner's children
    do: a Ctrl-C in the terminal reaches this process alone, which
    passes it on once (a second one would cut the child's checkpoint
    short) and waits for the child before it stops itself; SIGTERM the
    same.
    """
    signals.handle_stop_signals()  # SIGTERM becomes an exception too, so the child is stopped
    try:
        with open(log_path, "w") as log:
            child = subprocess.Popen(
                [sys.executable, "-m", "distribuuuu", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env(threads),
                start_new_session=True,
            )
            try:
                status = child.wait()
            except KeyboardInterrupt as stop:  # Ctrl-C, or signals.Terminated for SIGTERM
                _stop(child, int(getattr(stop, "signum", signal.SIGINT)))
                raise
    finally:
        signals.restore_signal_handlers()
    return RunResult(status, log_path, error_line(log_path) if status else "")


def visible_gpus(cfg: Any) -> int:
    """GPUs the runs will see: 0 on the CPU. device_count() creates no
    CUDA context here, which would hold GPU 0 memory during the whole
    sweep."""
    if cfg.DEVICE == "cpu":
        return 0  # and no torch.cuda call at all
    import torch  # only when a GPU may be used: the CPU path stays torch-free

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_label(gpus: int) -> str:
    """'NVIDIA H100 ...' or 'CPU, 16 cores', for the sweeps' table
    titles. Call it after the runs: naming the GPU creates a CUDA
    context."""
    if not gpus:
        return f"CPU, {os.cpu_count()} cores"
    import torch

    return torch.cuda.get_device_name(0)

"""Faults injected at an exact point of a real run, for tests/test_stop_signal_timing.py and
tests/test_write_errors.py (a test could not time them from outside without racing the run): TRAIN.HOOKS
hooks, each acting on rank 0 only, chosen by an environment variable, and a spawner worker that hangs
in its checkpoint. The hooks take the events' arguments after the trainer as *event: 8c3cda4's hooks
got the trainer alone, and these tests run on that version too, to show what it did.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import time

from distribuuuu.engine import HookBase


class SignalDuringEvaluation(HookBase):
    """After an evaluation (the epoch's checkpoint is still to come), rank 0 sends itself the real
    signal named by STOP_SIGNAL, once: a signal that lands while the run evaluates."""

    sent = False

    def after_eval(self, trainer, *event):
        if trainer.ctx.is_main and event[:1] in ((), ("val",)) and not self.sent:
            self.sent = True
            os.kill(os.getpid(), getattr(signal, os.environ["STOP_SIGNAL"]))


class WriteFaultAfterFirstEpoch(HookBase):
    """Once epoch 1 and its checkpoint are written, rank 0 makes the run's next writes fail the way
    WRITE_FAULT names: EFBIG:BYTES (the kernel's file-size limit), EACCES (checkpoints/ made read-only:
    binds only for a process without CAP_DAC_OVERRIDE), EROFS (checkpoints/, a tmpfs of its own,
    remounted read-only: a file system with a file open for writing, as OUT_DIR's log.txt, refuses
    that), ENOENT (OUT_DIR removed)."""

    def after_epoch(self, trainer, *event):
        if not trainer.ctx.is_main or trainer.state.epoch != 1:
            return
        fault, out = os.environ["WRITE_FAULT"], trainer.cfg.OUT_DIR
        if fault.startswith("EFBIG:"):
            resource.setrlimit(resource.RLIMIT_FSIZE, (int(fault[6:]), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        elif fault == "EACCES":
            os.chmod(os.path.join(out, "checkpoints"), 0o555)
        elif fault == "EROFS":
            subprocess.run(["mount", "-o", "remount,ro", os.path.join(out, "checkpoints")], check=True)
        elif fault == "ENOENT":
            shutil.rmtree(out)
        else:
            raise ValueError(f"WRITE_FAULT {fault!r}")


def stuck_checkpoint_worker(folder: str) -> None:
    """A spawned rank whose checkpoint hangs: the first SIGTERM is recorded (as TRAIN.PREEMPT_SIGNALS
    does), then the rank never reaches a step boundary. It leaves a file <n><rank> in folder for each
    SIGTERM it has taken (0: ready), so that the test sends the next one only then."""
    from distribuuuu.launch import signals

    signals.handle_stop_signals()
    rank, taken = os.environ["RANK"], []
    with signals.preemption_signals(["SIGTERM"]):
        record = signal.getsignal(signal.SIGTERM)

        def counted(signum, frame):  # then launch.signals' own handler, which decides what a signal does
            taken.append(signum)
            record(signum, frame)

        signal.signal(signal.SIGTERM, counted)
        marked = -1
        while True:
            while marked < len(taken):
                marked += 1
                open(os.path.join(folder, f"{marked}{rank}"), "w").close()
            time.sleep(0.01)

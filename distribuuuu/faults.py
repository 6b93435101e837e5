"""Preemption: signals become a flag that the training loop reads at step boundaries.

A cluster that is about to take the machines back sends a signal (Slurm: ``--signal=USR1@90``
sends SIGUSR1 90 s before the end; most schedulers send SIGTERM). While ``preemption_signals`` is
active, the signals named in TRAIN.PREEMPT_SIGNALS only record themselves; the loop then agrees
with the other ranks (distributed.any_rank), writes a step checkpoint, and ends the run with exit
status 128 + signal number (see engine.Preempted and cli.run). The same signal a second time
runs the handler that was there before (usually: stop at once), as a way out of a stuck save.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator, Sequence

_received: int | None = None  # set by the handler, read by the training loop


def _record(signum: int, frame: object) -> None:
    global _received
    if _received == signum:  # asked twice: stop now, the old way
        previous = _previous.get(signum, signal.SIG_DFL)
        signal.signal(signum, previous)
        signal.raise_signal(signum)
        return
    _received = signum


_previous: dict[int, object] = {}


@contextmanager
def preemption_signals(names: Sequence[str]) -> Iterator[None]:
    """Record the named signals (e.g. ["SIGTERM", "SIGUSR1"]) instead of acting on them."""
    global _received
    _received = None
    nums = [getattr(signal, name) for name in names]
    for num in nums:
        _previous[num] = signal.signal(num, _record)
    try:
        yield
    finally:
        for num in nums:
            signal.signal(num, _previous.pop(num))


def stop_signal() -> int | None:
    """The preemption signal this process received, if any."""
    return _received

"""Module-level workers for tests/test_stop_signals.py (spawn pickles them by name).

Kept apart from the test module so that a child process imports only this small file.
"""

from __future__ import annotations

import os
import time


def stuck_save_worker(out_dir: str) -> None:
    """Behave like a rank whose step checkpoint hangs: the first SIGTERM is only recorded (as
    TRAIN.PREEMPT_SIGNALS does), then the rank never reaches a step boundary. Only a second
    SIGTERM gets it out (launch.signals escalates it to Terminated)."""
    from distribuuuu.launch import signals

    signals.handle_stop_signals()
    rank = os.environ["RANK"]
    with signals.preemption_signals(["SIGTERM"]):
        with open(os.path.join(out_dir, f"ready{rank}"), "w") as f:
            f.write(str(os.getpid()))
        while signals.received is None:
            time.sleep(0.02)
        with open(os.path.join(out_dir, f"recorded{rank}"), "w") as f:
            f.write("1")
        time.sleep(120)  # the "stuck save"

"""Logging for people (console + OUT_DIR/log.txt) and for programs (OUT_DIR/metrics.jsonl).

Only rank 0 talks at INFO level and writes files; other ranks log warnings and errors to stderr,
so a failure on any rank is still seen.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from typing import Any, Callable

from yacs.config import CfgNode

LOGGER_NAME = "distribuuuu"


def setup_logging(out_dir: str | None, is_main: bool) -> logging.Logger:
    """Configure the "distribuuuu" logger for this process; safe to call again."""
    log = logging.getLogger(LOGGER_NAME)
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    log.propagate = False
    log.setLevel(logging.INFO if is_main else logging.WARNING)
    fmt = logging.Formatter("[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    console = logging.StreamHandler(sys.stdout if is_main else sys.stderr)
    console.setFormatter(fmt)
    log.addHandler(console)
    if is_main and out_dir:
        os.makedirs(out_dir, exist_ok=True)
        file_handler = logging.FileHandler(os.path.join(out_dir, "log.txt"))
        file_handler.setFormatter(fmt)
        log.addHandler(file_handler)
    return log


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends one JSON object per line to OUT_DIR/metrics.jsonl (rank 0 only; others no-op)."""

    def __init__(self, out_dir: str, enabled: bool) -> None:
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.enabled = enabled

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


class Progress:
    """Rank 0's view of one training epoch: a line every TRAIN.PRINT_FREQ iterations and at the end.

    ``step`` is called every iteration and costs next to nothing; only on print steps does it ask
    for the running metrics (a host sync) and time the window since the last line.
    """

    def __init__(self, cfg: CfgNode, enabled: bool, world_size: int, epoch: int, iters: int) -> None:
        self.enabled, self.world_size, self.epoch, self.iters = enabled, world_size, epoch, iters
        self.max_epoch, self.freq, self.topk = cfg.OPTIM.MAX_EPOCH, cfg.TRAIN.PRINT_FREQ, cfg.TRAIN.TOPK
        self.log = logging.getLogger(LOGGER_NAME)
        self._reset_window()

    def _reset_window(self) -> None:
        self.window_start, self.window_data, self.window_iters = time.perf_counter(), 0.0, 0

    def step(self, it: int, data_s: float, batch: int, lr: float,
             running: Callable[[], dict[str, float]]) -> None:
        self.window_iters += 1
        self.window_data += data_s
        if not self.enabled or ((it + 1) % self.freq and it + 1 != self.iters):
            return
        stats = running()
        step_s = (time.perf_counter() - self.window_start) / self.window_iters
        left = (self.iters - it - 1) + (self.max_epoch - self.epoch - 1) * self.iters
        self.log.info(
            "[train] epoch %d/%d iter %d/%d | eta %s | time %.3fs (data %.3fs) | loss %.4f | "
            "acc@1 %.2f | acc@%d %.2f | lr %.5f | %.0f img/s",
            self.epoch + 1, self.max_epoch, it + 1, self.iters, format_seconds(left * step_s), step_s,
            self.window_data / self.window_iters, stats["loss"], stats["top1"], self.topk, stats["top5"],
            lr, batch * self.world_size / step_s,
        )
        self._reset_window()

    def close(self) -> None:
        """End of the epoch (a progress bar would be closed here)."""

"""Logging for people (console, OUT_DIR/log.txt, a progress bar) and for programs (OUT_DIR/metrics.jsonl,
metrics.csv and TensorBoard events in OUT_DIR/tb).

Only rank 0 talks at INFO level and writes files; other ranks log warnings and errors to stderr,
so a failure on any rank is still seen.

Progress during an epoch is a tqdm bar when stdout is a terminal and plain periodic lines when it is
not (a log file or a pipe gets no bar noise); ``DISTRIBUUUU_PROGRESS=bar`` or ``lines`` forces one.
With the bar, the periodic lines still go to log.txt.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from yacs.config import CfgNode

from distribuuuu.log_file import HeldFileHandler

LOGGER_NAME = "distribuuuu"
PROGRESS_ENV = "DISTRIBUUUU_PROGRESS"  # auto (default) | bar | lines
LOG_FILE = "log.txt"  # in OUT_DIR: every rank's warnings and errors, rank 0's lines


def _to_console(record: logging.LogRecord) -> bool:
    """Records logged with extra={"console": False} go to log.txt only (the bar shows them)."""
    return getattr(record, "console", True)


class _ConsoleHandler(logging.StreamHandler):
    """While a progress bar is on screen, a log line is printed above it (tqdm.write), not through it."""

    bar: Any = None  # the active tqdm bar of this process, if any

    def emit(self, record: logging.LogRecord) -> None:
        if self.bar is None:
            return super().emit(record)
        try:
            self.bar.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def release_log() -> None:
    """Write the log lines held so far to log.txt, and the later ones as they come (setup_logging(hold=True))."""
    for handler in logging.getLogger(LOGGER_NAME).handlers:
        if isinstance(handler, HeldFileHandler):
            handler.write_held()


def discard_log() -> None:
    """A refused command: forget the held log lines (log.txt is left as it was, or not made)."""
    for handler in logging.getLogger(LOGGER_NAME).handlers:
        if isinstance(handler, HeldFileHandler) and handler.file is None:
            handler.held = []


def setup_logging(out_dir: str | None, is_main: bool, rank: int = 0, hold: bool = False) -> logging.Logger:
    """Configure the "distribuuuu" logger for this process; safe to call again.

    Rank 0 logs INFO to the console and OUT_DIR/log.txt; every other rank logs warnings and
    errors to stderr and, tagged with its rank, to the same log.txt (appends of whole lines).
    hold: log.txt gets nothing (is not even made) until release_log(), after the command's checks."""
    log = logging.getLogger(LOGGER_NAME)
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    log.propagate = False
    log.setLevel(logging.INFO if is_main else logging.WARNING)
    console = _ConsoleHandler(sys.stdout if is_main else sys.stderr)
    console.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", datefmt="%H:%M:%S"))
    console.addFilter(_to_console)
    log.addHandler(console)
    if out_dir:
        log.addHandler(_file_handler(out_dir, is_main, rank, hold))
    return log


def _file_handler(out_dir: str, is_main: bool, rank: int, hold: bool) -> logging.Handler:
    """OUT_DIR/log.txt, held (HeldFileHandler) or made now; other ranks' lines tagged with the rank."""
    path = os.path.join(out_dir, LOG_FILE)
    if hold:
        handler: logging.Handler = HeldFileHandler(path)
    else:
        os.makedirs(out_dir, exist_ok=True)
        handler = logging.FileHandler(path)
    tag = "" if is_main else f"[rank {rank}] "
    handler.setFormatter(logging.Formatter(f"[%(asctime)s] {tag}%(message)s", datefmt="%H:%M:%S"))
    return handler


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


def progress_mode() -> str:
    """'bar' or 'lines': DISTRIBUUUU_PROGRESS forces one, else a bar only when stdout is a terminal."""
    want = os.environ.get(PROGRESS_ENV, "auto").strip().lower()
    if want in ("bar", "lines"):
        return want
    if want not in ("", "auto"):
        logging.getLogger(LOGGER_NAME).warning("%s=%s is not auto, bar or lines; using auto", PROGRESS_ENV, want)
    return "bar" if sys.stdout.isatty() else "lines"


def _terminal_columns() -> int:
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


class Progress:
    """Rank 0's view of one training epoch.

    Lines mode: a line every TRAIN.PRINT_FREQ iterations and at the end. Bar mode: a tqdm bar moved
    every iteration (tqdm redraws at most a few times a second), its loss / acc / img/s refreshed
    on the same print steps, and the periodic lines written to log.txt only.
    ``step`` is called every iteration and costs next to nothing; only on print steps does it ask
    for the running metrics (a host sync) and time the window since the last line.
    """

    def __init__(self, cfg: CfgNode, enabled: bool, world_size: int, epoch: int, iters: int) -> None:
        self.enabled, self.world_size, self.epoch, self.iters = enabled, world_size, epoch, iters
        self.max_epoch, self.freq, self.topk = cfg.OPTIM.MAX_EPOCH, cfg.TRAIN.PRINT_FREQ, cfg.TRAIN.TOPK
        self.log = logging.getLogger(LOGGER_NAME)
        self.bar = None
        if enabled and progress_mode() == "bar":
            from tqdm import tqdm

            # A terminal that reports no size (a bare pty: 0 x 0) would get no bar at all.
            sized = _terminal_columns() > 0
            self.bar = tqdm(total=iters, desc=f"epoch {epoch + 1}/{self.max_epoch}", file=sys.stdout,
                            dynamic_ncols=sized, ncols=None if sized else 120, nrows=None if sized else 24,
                            leave=True, mininterval=0.5)
            _ConsoleHandler.bar = self.bar
        self._reset_window()

    def _reset_window(self) -> None:
        self.window_start, self.window_data, self.window_iters = time.perf_counter(), 0.0, 0

    def step(self, it: int, data_s: float, batch: int, lr: float,
             running: Callable[[], dict[str, float]]) -> dict[str, float] | None:
        """Count an iteration; on print steps (rank 0) log a line and return its numbers
        (loss, top1, topk, lr, img_per_s: the per-step TensorBoard scalars), else None."""
        self.window_iters += 1
        self.window_data += data_s
        if self.bar is not None:
            self.bar.update(1)
        if not self.enabled or ((it + 1) % self.freq and it + 1 != self.iters):
            return None
        stats = running()
        step_s = (time.perf_counter() - self.window_start) / self.window_iters
        left = (self.iters - it - 1) + (self.max_epoch - self.epoch - 1) * self.iters
        img_s = batch * self.world_size / step_s
        if self.bar is not None:
            self._show_on_bar(stats, img_s, left * step_s)
        self.log.info(
            "[train] epoch %d/%d iter %d/%d | eta %s | time %.3fs (data %.3fs) | loss %.4f | "
            "acc@1 %.2f | acc@%d %.2f | lr %.5f | %.0f img/s",
            self.epoch + 1, self.max_epoch, it + 1, self.iters, format_seconds(left * step_s), step_s,
            self.window_data / self.window_iters, stats["loss"], stats["top1"], self.topk, stats["topk_acc"],
            lr, img_s, extra={"console": self.bar is None},
        )
        self._reset_window()
        return {"loss": stats["loss"], "top1": stats["top1"], "topk_acc": stats["topk_acc"], "lr": lr, "img_per_s": img_s}

    def _show_on_bar(self, stats: dict[str, float], img_s: float, eta_s: float) -> None:
        self.bar.set_postfix_str(
            f"loss {stats['loss']:.4f}, acc@1 {stats['top1']:.2f}, acc@{self.topk} {stats['topk_acc']:.2f}, "
            f"{img_s:.0f} img/s, run eta {format_seconds(eta_s)}", refresh=False)

    def close(self) -> None:
        """End of the epoch: the bar stays on screen, finished."""
        if self.bar is not None:
            self.bar.close()
            self.bar = _ConsoleHandler.bar = None

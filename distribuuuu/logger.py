"""Logging for people: the console, OUT_DIR/log.txt and the progress of
an epoch. (The records for programs, metrics.jsonl and the like, are
run_folder/metrics_files.py's.)

Only rank 0 talks at INFO level and writes files; other ranks log
warnings and errors to stderr, so a failure on any rank is still seen.

Progress during an epoch is a tqdm bar when stdout is a terminal and
plain periodic lines when it is not (a log file or a pipe gets no bar
noise); ``DISTRIBUUUU_PROGRESS=bar`` or ``lines`` forces one. With the
bar, the periodic lines still go to log.txt.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from logging.handlers import MemoryHandler
from typing import Any

from yacs.config import CfgNode

from distribuuuu import files

LOGGER_NAME = "distribuuuu"
PROGRESS_ENV = "DISTRIBUUUU_PROGRESS"  # auto (default) | bar | lines
LOG_FILE = "log.txt"  # in OUT_DIR: every rank's warnings and errors, rank 0's lines


class _HeldFile(MemoryHandler):
    """log.txt (the target), its lines held in memory until
    release_log() lets them through (setup_logging(hold=True)); closed
    with its file."""

    def close(self) -> None:
        if self.target is not None:
            self.target.close()
        super().close()


class _LogFile(logging.FileHandler):
    """log.txt. A line it cannot take for a cause the user must fix ends
    the run, once (files.write_failure: exit 2, one line naming the file
    and the cause), unless an error that ends the run already is being
    handled; the later lines go to the console only. Logging's own
    handling printed a traceback for every line and went on."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        failure = None if self.failed else files.write_failure(self.baseFilename, error)
        if failure is None:
            if not self.failed:
                super().handleError(record)
            return
        self.failed = True
        if error.__context__ is None:
            raise failure


def release_log() -> None:
    """Write the log lines held so far to log.txt, and the later ones as
    they come (setup_logging(hold=True))."""
    for handler in logging.getLogger(LOGGER_NAME).handlers:
        if isinstance(handler, _HeldFile):
            handler.capacity = 0  # from now on every record goes straight through
            handler.flush()


def discard_log() -> None:
    """A refused command: forget the held log lines (log.txt is left as
    it was, or not made)."""
    for handler in logging.getLogger(LOGGER_NAME).handlers:
        if isinstance(handler, _HeldFile):
            handler.buffer.clear()


def setup_logging(
    out_dir: str | None, is_main: bool, rank: int = 0, hold: bool = False
) -> logging.Logger:
    """Configure the "distribuuuu" logger for this process; safe to call
    again.

    Rank 0 logs INFO to the console and OUT_DIR/log.txt; every other
    rank logs warnings and errors to stderr and, tagged with its rank,
    to the same log.txt (appends of whole lines). Records logged with
    extra={"console": False} go to log.txt only (a progress bar shows
    them). hold: log.txt gets nothing (is not even made) until
    release_log(), after the command's checks: a command they refuse
    (exit 2) leaves no log.txt, or no appended lines, behind."""
    log = logging.getLogger(LOGGER_NAME)
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    log.propagate = False
    log.setLevel(logging.INFO if is_main else logging.WARNING)
    console = logging.StreamHandler(sys.stdout if is_main else sys.stderr)
    console.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", datefmt="%H:%M:%S"))
    console.addFilter(lambda record: getattr(record, "console", True))
    log.addHandler(console)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        file = _LogFile(os.path.join(out_dir, LOG_FILE), delay=True)  # made at its first line
        tag = "" if is_main else f"[rank {rank}] "
        file.setFormatter(logging.Formatter(f"[%(asctime)s] {tag}%(message)s", datefmt="%H:%M:%S"))
        held = (
            _HeldFile(sys.maxsize, flushLevel=logging.CRITICAL + 1, target=file, flushOnClose=False)
            if hold
            else None
        )
        log.addHandler(held or file)
    return log


def accuracies(top1: float, k: int, topk: float, name: str = "acc@", unit: str = "") -> str:
    """'acc@1 90.00 | acc@5 99.00'; top-1 alone where TRAIN.TOPK is 1 (2
    classes: inferred/data.py clamps it)."""
    return f"{name}1 {top1:.2f}{unit}" + (f" | {name}{k} {topk:.2f}{unit}" if k > 1 else "")


def format_seconds(seconds: float) -> str:
    """H:MM:SS ("1 day, H:MM:SS" beyond)."""
    return str(datetime.timedelta(seconds=round(seconds)))


def progress_mode() -> str:
    """'bar' or 'lines': DISTRIBUUUU_PROGRESS forces one, else a bar
    only when stdout is a terminal."""
    want = os.environ.get(PROGRESS_ENV, "auto").strip().lower()
    if want in ("bar", "lines"):
        return want
    if want not in ("", "auto"):
        logging.getLogger(LOGGER_NAME).warning(
            "%s=%s is not auto, bar or lines; using auto", PROGRESS_ENV, want
        )
    return "bar" if sys.stdout.isatty() else "lines"


def _terminal_columns() -> int:
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


PRINT_SECONDS = 10.0  # a progress line at least this often, whatever TRAIN.PRINT_FREQ


class Progress:
    """Rank 0's view of one training epoch.

    Lines mode: a line every TRAIN.PRINT_FREQ iterations and at the end,
    also after the run's first step, and, whenever PRINT_SECONDS pass
    without one, a shorter line (where the run is and its eta: the
    metrics would cost a host sync; 30 iterations of a slow model were
    minutes of silence). Bar mode: a tqdm bar moved every iteration
    (tqdm redraws at most a few times a second), its loss / acc / img/s
    refreshed on the same print steps, log lines printed above it, and
    the periodic lines written to log.txt only. ``step`` is called every
    iteration and costs next to nothing; only on print steps does
    ``_print`` ask for the running metrics (a host sync) and time the
    window since the last line.
    """

    def __init__(
        self, cfg: CfgNode, enabled: bool, world_size: int, epoch: int, iters: int
    ) -> None:
        self.enabled, self.world_size, self.epoch, self.iters = enabled, world_size, epoch, iters
        self.max_epoch, self.topk = cfg.OPTIM.MAX_EPOCH, cfg.TRAIN.TOPK
        self.freq = cfg.TRAIN.PRINT_FREQ
        self.bar: Any = self._open_bar() if enabled and progress_mode() == "bar" else None
        self.window_start, self.window_data, self.window_iters = time.perf_counter(), 0.0, 0
        # The iteration (1-based) of the next line: the run's first, then every PRINT_FREQ-th
        # and the epoch's last; none on ranks that do not print.
        self.print_at = 1 if epoch == 0 else min(self.freq, iters)
        if not enabled:
            self.print_at = -1
        # When a short line is due (no line for PRINT_SECONDS): never under a bar.
        self.beat_at = math.inf
        if enabled and self.bar is None:
            self.beat_at = self.window_start + PRINT_SECONDS

    def _open_bar(self) -> Any:
        """The tqdm bar, and the console log lines printed above it
        (tqdm.write) until close()."""
        from tqdm import tqdm
        from tqdm.contrib import DummyTqdmFile

        sized = (
            _terminal_columns() > 0
        )  # a terminal that reports no size (a bare pty: 0 x 0) gets 120 x 24
        bar = tqdm(
            total=self.iters,
            desc=f"epoch {self.epoch + 1}/{self.max_epoch}",
            file=sys.stdout,
            dynamic_ncols=sized,
            ncols=None if sized else 120,
            nrows=None if sized else 24,
            leave=True,
            mininterval=0.5,
        )
        self.consoles = [
            (h, h.stream)
            for h in logging.getLogger(LOGGER_NAME).handlers
            if type(h) is logging.StreamHandler and h.stream is sys.stdout
        ]
        for handler, stream in self.consoles:
            handler.setStream(DummyTqdmFile(stream))
        return bar

    def step(
        self, it: int, data_s: float, batch: int, lr: float, running: Callable[[], dict[str, float]]
    ) -> dict[str, float] | None:
        """Count an iteration; on print steps (rank 0) log a line and
        return its numbers (loss, top1, topk, lr, img_per_s: the
        per-step TensorBoard scalars), else None."""
        self.window_iters += 1
        self.window_data += data_s
        if self.bar is not None:
            self.bar.update(1)
        if it + 1 == self.print_at:
            return self._print(it, batch, lr, running())
        if time.perf_counter() >= self.beat_at:
            self._beat(it)
        return None

    def _beat(self, it: int) -> None:
        """A short line (where the run is, its eta; the metrics would
        cost a host sync) after PRINT_SECONDS without one: 30 iterations
        of a slow model were minutes of silence."""
        now = time.perf_counter()
        self.beat_at = now + PRINT_SECONDS
        step_s = (now - self.window_start) / self.window_iters
        logging.getLogger(LOGGER_NAME).info(
            "[train] epoch %d/%d iter %d/%d | eta %s | time %.3fs",
            self.epoch + 1,
            self.max_epoch,
            it + 1,
            self.iters,
            format_seconds(self._left(it) * step_s),
            step_s,
        )

    def _left(self, it: int) -> int:
        """The run's iterations after iteration it (this epoch's
        iteration count for the epochs to come)."""
        return (self.iters - it - 1) + (self.max_epoch - self.epoch - 1) * self.iters

    def _print(self, it: int, batch: int, lr: float, stats: dict[str, float]) -> dict[str, float]:
        """A print step: the line (log.txt only under a bar, which shows
        the numbers), a new window."""
        step_s = (time.perf_counter() - self.window_start) / self.window_iters
        eta = format_seconds(self._left(it) * step_s)
        img_s = batch * self.world_size / step_s
        loss, top1, topk = stats["loss"], stats["top1"], stats["topk_acc"]
        if self.bar is not None:
            self._show_on_bar(loss, top1, topk, img_s, eta)
        logging.getLogger(LOGGER_NAME).info(
            "[train] epoch %d/%d iter %d/%d | eta %s | time %.3fs (data %.3fs) | loss %.4f | %s | "
            "lr %.5f | %.0f img/s",
            self.epoch + 1,
            self.max_epoch,
            it + 1,
            self.iters,
            eta,
            step_s,
            self.window_data / self.window_iters,
            loss,
            accuracies(top1, self.topk, topk),
            lr,
            img_s,
            extra={"console": self.bar is None},
        )
        self.window_start, self.window_data, self.window_iters = time.perf_counter(), 0.0, 0
        self.print_at = min((it + 1) // self.freq * self.freq + self.freq, self.iters)
        if self.beat_at < math.inf:
            self.beat_at = self.window_start + PRINT_SECONDS
        return {"loss": loss, "top1": top1, "topk_acc": topk, "lr": lr, "img_per_s": img_s}

    def _show_on_bar(self, loss: float, top1: float, topk: float, img_s: float, eta: str) -> None:
        self.bar.set_postfix_str(
            f"loss {loss:.4f}, {accuracies(top1, self.topk, topk).replace(' |', ',')}, {img_s:.0f} "
            f"img/s, run eta {eta}",
            refresh=False,
        )

    def close(self) -> None:
        """End of the epoch: the bar stays on screen, finished; log
        lines go straight to the console again."""
        if self.bar is not None:
            self._close_bar()

    def _close_bar(self) -> None:
        self.bar.close()
        for handler, stream in self.consoles:
            handler.setStream(stream)
        self.bar = None

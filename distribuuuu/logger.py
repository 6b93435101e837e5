"""Logging for people (console, OUT_DIR/log.txt, a progress bar) and for programs (OUT_DIR/metrics.jsonl,
metrics.csv and TensorBoard events in OUT_DIR/tb).

Only rank 0 talks at INFO level and writes files; other ranks log warnings and errors to stderr,
so a failure on any rank is still seen.

Progress during an epoch is a tqdm bar when stdout is a terminal and plain periodic lines when it is
not (a log file or a pipe gets no bar noise); ``DISTRIBUUUU_PROGRESS=bar`` or ``lines`` forces one.
With the bar, the periodic lines still go to log.txt.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from yacs.config import CfgNode

from distribuuuu.files import atomic_write_bytes
from distribuuuu.log_file import HeldFileHandler

LOGGER_NAME = "distribuuuu"
PROGRESS_ENV = "DISTRIBUUUU_PROGRESS"  # auto (default) | bar | lines

# metrics.csv columns, in this order; keys a record brings beyond these are appended.
CSV_COLUMNS = ["epoch", "split", "step", "loss", "top1", "top5", "topk", "n", "lr", "img_per_s",
               "time_s", "data_frac", "peak_mem_mb"]
# The numbers that become TensorBoard scalars, as <split>/<key>, against the epoch. The "top5" field
# holds top-TRAIN.TOPK (its name is kept in metrics.jsonl/csv for the tools and scripts that read
# it; the "topk" field says k); its TensorBoard tag names the real k: <split>/top<k>.
TB_KEYS = ("loss", "top1", "top5", "lr", "img_per_s", "data_frac", "peak_mem_mb", "skipped_steps")
# Every TRAIN.PRINT_FREQ iterations, against the global step: train_step/<key> (Progress's numbers).
STEP_KEYS = ("loss", "top1", "topk", "lr", "img_per_s")


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
    fmt = logging.Formatter("[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    console = _ConsoleHandler(sys.stdout if is_main else sys.stderr)
    console.setFormatter(fmt)
    console.addFilter(_to_console)
    log.addHandler(console)
    if out_dir:
        file_handler: logging.Handler
        if hold:
            file_handler = HeldFileHandler(os.path.join(out_dir, "log.txt"))
        else:
            os.makedirs(out_dir, exist_ok=True)
            file_handler = logging.FileHandler(os.path.join(out_dir, "log.txt"))
        file_handler.setFormatter(fmt if is_main else logging.Formatter(
            f"[%(asctime)s] [rank {rank}] %(message)s", datefmt="%H:%M:%S"))
        log.addHandler(file_handler)
    return log


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Rank 0 appends each record to OUT_DIR/metrics.jsonl and metrics.csv, and writes its numbers
    as TensorBoard scalars to OUT_DIR/tb (records with an epoch only). Other ranks: no-op."""

    def __init__(self, out_dir: str, enabled: bool, tensorboard: bool = True, topk: int = 5) -> None:
        self.topk = topk  # TRAIN.TOPK: names the tag of the "top5" field
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.csv_path = os.path.join(out_dir, "metrics.csv")
        self.tb_dir = os.path.join(out_dir, "tb")
        self.enabled, self.tensorboard = enabled, tensorboard
        self._tb: Any = None  # the SummaryWriter, made at the first epoch record (eval runs make none)
        # On resume: the first global step the run writes again. TensorBoard drops every event of
        # the earlier files from this step on (a SessionLog START): the steps written after the
        # checkpoint, before a crash, are not shown twice. Epoch-numbered records are safe from it
        # (an epoch number is never above the global step); metrics.jsonl is repaired (repair()).
        self.purge_step: int | None = None

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {k: _clean(v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self._write_csv(record)
        if self.tensorboard and isinstance(record.get("epoch"), int):
            self._write_tb(record)

    def _write_csv(self, record: dict[str, Any]) -> None:
        header = CSV_COLUMNS
        if os.path.isfile(self.csv_path):
            with open(self.csv_path, newline="") as f:
                header = next(csv.reader(f), CSV_COLUMNS)
        new = [k for k in record if k not in header]
        if new or not os.path.isfile(self.csv_path):
            # A key never seen before widens the table: rewrite it, older rows get empty cells.
            rows = []
            if os.path.isfile(self.csv_path):
                with open(self.csv_path, newline="") as f:
                    rows = list(csv.DictReader(f))
            header = header + new
            with open(self.csv_path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=header)
                w.writeheader()
                w.writerows(rows)
        with open(self.csv_path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=header).writerow(record)

    def _events(self) -> Any:
        """The SummaryWriter, made on first use; None without TensorBoard."""
        if self._tb is None and self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # tensorboard is a dependency; a broken install only costs the events
                logging.getLogger(LOGGER_NAME).warning("no TensorBoard events: %s", e)
                self.tensorboard = False
                return None
            self._tb = SummaryWriter(self.tb_dir, purge_step=self.purge_step)
        return self._tb

    def tag(self, split: str, key: str) -> str:
        """The TensorBoard tag of a record's number: the top-k field is named by its real k."""
        return f"{split}/top{self.topk}" if key in ("top5", "topk") else f"{split}/{key}"

    def write_step(self, step: int, scalars: dict[str, float]) -> None:
        """Per-step TensorBoard scalars (train_step/loss, lr, img_per_s, top1, top<k>) against the
        global step; not flushed here (the epoch's record flushes), so a print step costs little."""
        tb = self._events() if self.enabled else None
        if tb is None:
            return
        for key in STEP_KEYS:
            value = scalars.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                tb.add_scalar(self.tag("train_step", key), value, step)

    def _write_tb(self, record: dict[str, Any]) -> None:
        tb = self._events()
        if tb is None:
            return
        split = record.get("split", "train")
        for key in TB_KEYS:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                tb.add_scalar(self.tag(split, key), value, record["epoch"])
        tb.flush()  # one flush per epoch: TensorBoard sees the run live, a crash loses nothing

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def repair(self, completed_epochs: int) -> list[str]:
        """On resume (rank 0): make metrics.jsonl agree with the checkpoint the run continues from.

        A line torn by a kill (the last one, without its newline), any other line that is not JSON,
        and every record of an epoch after ``completed_epochs`` (written before a kill stopped the
        epoch's checkpoint from landing: the run trains and records that epoch again) are MOVED to
        metrics_dropped.jsonl as {"line", "reason", "text"}; metrics.csv is rebuilt from what is
        kept. Returns the warnings it logged (one per reason)."""
        if not self.enabled or not os.path.isfile(self.path):
            return []
        with open(self.path, "rb") as f:
            raw = f.read()
        lines = raw.split(b"\n")
        kept: list[bytes] = []
        dropped: list[dict[str, Any]] = []
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            reason = _drop_reason(line, completed_epochs, torn=(i == len(lines)))
            if reason:
                dropped.append({"line": i, "reason": reason, "text": line.decode("utf-8", "replace")})
            else:
                kept.append(line)
        if not dropped and raw.endswith(b"\n"):
            return []
        atomic_write_bytes(self.path, b"".join(ln + b"\n" for ln in kept))
        notes = self._move_dropped(dropped)
        self._rebuild_csv([json.loads(ln) for ln in kept])
        return notes

    def _move_dropped(self, dropped: list[dict[str, Any]]) -> list[str]:
        if not dropped:
            return []
        where = os.path.join(os.path.dirname(self.path), "metrics_dropped.jsonl")
        with open(where, "a") as f:
            f.writelines(json.dumps(d) + "\n" for d in dropped)
        notes = []
        for reason in dict.fromkeys(d["reason"] for d in dropped):
            numbers = [str(d["line"]) for d in dropped if d["reason"] == reason]
            lines = f"line{'s' if len(numbers) > 1 else ''} {', '.join(numbers)}"
            notes.append(f"{self.path}: {lines} moved to {where}: {reason}")
            logging.getLogger(LOGGER_NAME).warning("%s", notes[-1])
        return notes

    def _rebuild_csv(self, records: list[dict[str, Any]]) -> None:
        header = list(CSV_COLUMNS) + [k for r in records for k in r if k not in CSV_COLUMNS]
        header = list(dict.fromkeys(header))
        text = io.StringIO(newline="")
        w = csv.DictWriter(text, fieldnames=header)
        w.writeheader()
        w.writerows(records)
        atomic_write_bytes(self.csv_path, text.getvalue().encode())


EVAL_RECORDS = "eval.jsonl"  # `eval` records: apart from metrics.jsonl, whose lines are the run's epochs


def write_eval_record(out_dir: str, record: dict[str, Any], enabled: bool) -> str:
    """Rank 0 appends an ``eval`` record to OUT_DIR/eval.jsonl; returns that path.

    Kept out of metrics.jsonl so that a training run's records stay one per epoch and split: plot,
    bench --compare and resume's repair read metrics.jsonl only, and an eval into a run folder
    must not change what they see."""
    path = os.path.join(out_dir, EVAL_RECORDS)
    if enabled:
        os.makedirs(out_dir, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
    return path


def _drop_reason(line: bytes, completed_epochs: int, torn: bool) -> str | None:
    """Why a metrics.jsonl line must go on resume, or None to keep it."""
    try:
        record = json.loads(line)
    except ValueError:  # also UnicodeDecodeError
        return "torn by an interrupted write" if torn else "not JSON"
    if not isinstance(record, dict):
        return "not a JSON object"
    epoch = record.get("epoch")
    if isinstance(epoch, int) and epoch > completed_epochs:
        return (f"records written after the checkpoint the run resumes from (epoch {completed_epochs}); "
                "those epochs are trained and recorded again")
    return None


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file; a line that is not one (torn by a kill, edited) is skipped
    with a warning naming the file and the line, so one bad line never hides the rest."""
    records = []
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                logging.getLogger(LOGGER_NAME).warning("%s line %d is not JSON (%s): skipped", path, i, e)
                continue
            if not isinstance(record, dict):
                logging.getLogger(LOGGER_NAME).warning("%s line %d is not a JSON object: skipped", path, i)
                continue
            records.append(record)
    return records


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
            self.bar.set_postfix_str(
                f"loss {stats['loss']:.4f}, acc@1 {stats['top1']:.2f}, acc@{self.topk} {stats['top5']:.2f}, "
                f"{img_s:.0f} img/s, run eta {format_seconds(left * step_s)}", refresh=False)
        self.log.info(
            "[train] epoch %d/%d iter %d/%d | eta %s | time %.3fs (data %.3fs) | loss %.4f | "
            "acc@1 %.2f | acc@%d %.2f | lr %.5f | %.0f img/s",
            self.epoch + 1, self.max_epoch, it + 1, self.iters, format_seconds(left * step_s), step_s,
            self.window_data / self.window_iters, stats["loss"], stats["top1"], self.topk, stats["top5"],
            lr, img_s, extra={"console": self.bar is None},
        )
        self._reset_window()
        return {"loss": stats["loss"], "top1": stats["top1"], "topk": stats["top5"], "lr": lr, "img_per_s": img_s}

    def close(self) -> None:
        """End of the epoch: the bar stays on screen, finished."""
        if self.bar is not None:
            self.bar.close()
            self.bar = _ConsoleHandler.bar = None

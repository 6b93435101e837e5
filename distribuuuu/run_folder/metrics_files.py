"""The run's records for programs: OUT_DIR/metrics.jsonl, metrics.csv, TensorBoard events in OUT_DIR/tb,
and eval.jsonl; and their repair when a run resumes from a checkpoint older than its last records.

Only rank 0 writes. metrics.jsonl holds one record per epoch and split (train, val, test), so plot,
bench --compare and resume's repair read it alone; ``distribuuuu eval`` appends to eval.jsonl instead.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
from typing import Any

from distribuuuu.files import atomic_write_bytes
from distribuuuu.run_folder.layout import EVAL_RECORDS, METRICS, METRICS_CSV, METRICS_DROPPED, TENSORBOARD

log = logging.getLogger("distribuuuu")

# metrics.csv columns, in this order; keys a record brings beyond these are appended.
CSV_COLUMNS = ["epoch", "split", "step", "loss", "top1", "topk_acc", "topk", "n", "lr", "img_per_s",
               "time_s", "data_frac", "peak_mem_mb"]
# The numbers that become TensorBoard scalars, as <split>/<key>, against the epoch. "topk_acc" is the
# top-TRAIN.TOPK accuracy ("topk" says k); its TensorBoard tag names the real k: <split>/top<k>.
TB_KEYS = ("loss", "top1", "topk_acc", "lr", "img_per_s", "data_frac", "peak_mem_mb", "skipped_steps")
# Every TRAIN.PRINT_FREQ iterations, against the global step: train_step/<key> (Progress's numbers).
STEP_KEYS = ("loss", "top1", "topk_acc", "lr", "img_per_s")


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Rank 0 appends each record to OUT_DIR/metrics.jsonl and metrics.csv, and writes its numbers
    as TensorBoard scalars to OUT_DIR/tb (records with an epoch only). Other ranks: no-op."""

    def __init__(self, out_dir: str, enabled: bool, tensorboard: bool = True, topk: int = 5) -> None:
        self.topk = topk  # TRAIN.TOPK: names the tag of the "topk_acc" field
        self.path = os.path.join(out_dir, METRICS)
        self.csv_path = os.path.join(out_dir, METRICS_CSV)
        self.tb_dir = os.path.join(out_dir, TENSORBOARD)
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
                log.warning("no TensorBoard events: %s", e)
                self.tensorboard = False
                return None
            self._tb = SummaryWriter(self.tb_dir, purge_step=self.purge_step)
        return self._tb

    def tag(self, split: str, key: str) -> str:
        """The TensorBoard tag of a record's number: the top-k field is named by its real k."""
        return f"{split}/top{self.topk}" if key == "topk_acc" else f"{split}/{key}"

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
        where = os.path.join(os.path.dirname(self.path), METRICS_DROPPED)
        with open(where, "a") as f:
            f.writelines(json.dumps(d) + "\n" for d in dropped)
        notes = []
        for reason in dict.fromkeys(d["reason"] for d in dropped):
            numbers = [str(d["line"]) for d in dropped if d["reason"] == reason]
            lines = f"line{'s' if len(numbers) > 1 else ''} {', '.join(numbers)}"
            notes.append(f"{self.path}: {lines} moved to {where}: {reason}")
            log.warning("%s", notes[-1])
        return notes

    def _rebuild_csv(self, records: list[dict[str, Any]]) -> None:
        header = list(CSV_COLUMNS) + [k for r in records for k in r if k not in CSV_COLUMNS]
        header = list(dict.fromkeys(header))
        text = io.StringIO(newline="")
        w = csv.DictWriter(text, fieldnames=header)
        w.writeheader()
        w.writerows(records)
        atomic_write_bytes(self.csv_path, text.getvalue().encode())


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
                log.warning("%s line %d is not JSON (%s): skipped", path, i, e)
                continue
            if not isinstance(record, dict):
                log.warning("%s line %d is not a JSON object: skipped", path, i)
                continue
            records.append(upgraded(record))
    return records


# Field names of older metrics files, and their names now: readers accept both (read_jsonl).
RENAMED_FIELDS = {"top5": "topk_acc"}  # it always held top-TRAIN.TOPK, whatever k was


def upgraded(record: dict[str, Any]) -> dict[str, Any]:
    """A record of an older metrics.jsonl / eval.jsonl with today's field names."""
    for old, new in RENAMED_FIELDS.items():
        if old in record and new not in record:
            record[new] = record.pop(old)
    return record


def recorded_test(out_dir: str) -> dict[str, Any] | None:
    """The test record that ends metrics.jsonl, if it does (the run was finished), else None."""
    try:
        with open(os.path.join(out_dir, METRICS), "rb") as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
        last = json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None
    return last if isinstance(last, dict) and last.get("split") == "test" else None

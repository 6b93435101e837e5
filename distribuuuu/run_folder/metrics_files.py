"""The run's records for programs: OUT_DIR/metrics.jsonl, metrics.csv
and TensorBoard events in OUT_DIR/tb; and their repair when a run
resumes from a checkpoint older than its last records: each epoch and
step is recorded once, whenever the kill came.

Only rank 0 writes. metrics.jsonl holds one record per epoch and split
(train, val, test), so plot, bench --compare and resume's repair read it
alone; ``distribuuuu eval`` appends to eval.jsonl instead
(RunFolder.write_eval_record). A record is one line added in one write
(files.append); a rewrite of metrics.csv or metrics.jsonl goes through a
temporary file (files.atomic_write).
"""

from __future__ import annotations

import csv
import glob
import io
import json
import logging
import math
import os
import threading
from collections.abc import Iterator
from typing import Any

from distribuuuu import files

log = logging.getLogger("distribuuuu")

METRICS, METRICS_CSV, TENSORBOARD = "metrics.jsonl", "metrics.csv", "tb"
METRICS_FILES = (METRICS, METRICS_CSV, TENSORBOARD)  # what a run appends to: set aside together
METRICS_DROPPED = "metrics_dropped.jsonl"  # records a resume moved out of metrics.jsonl
EVAL_RECORDS = (
    "eval.jsonl"  # `eval` records: apart from metrics.jsonl, whose lines are the run's epochs
)
# metrics.csv columns, in this order; keys a record brings beyond these
# are appended.
CSV_COLUMNS = [
    "epoch",
    "split",
    "step",
    "loss",
    "top1",
    "topk_acc",
    "topk",
    "n",
    "lr",
    "img_per_s",
    "time_s",
    "data_frac",
    "peak_mem_mb",
]
# The numbers that become TensorBoard scalars, as <split>/<key>, against
# the epoch. "topk_acc" is the top-TRAIN.TOPK accuracy ("topk" says k);
# its TensorBoard tag names the real k: <split>/top<k>.
TB_KEYS = (
    "loss",
    "top1",
    "topk_acc",
    "lr",
    "img_per_s",
    "data_frac",
    "peak_mem_mb",
    "skipped_steps",
)
# Every TRAIN.PRINT_FREQ iterations, against the global step:
# train_step/<key> (Progress's numbers).
STEP_KEYS, STEP_PREFIX = ("loss", "top1", "topk_acc", "lr", "img_per_s"), "train_step"


def clean(record: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN/inf: null instead."""
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }


def _csv_rows(path: str) -> list[dict[str, str]]:
    if not os.path.isfile(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


class MetricsWriter:
    """Rank 0 appends each record to OUT_DIR/metrics.jsonl and
    metrics.csv, and writes its numbers as TensorBoard scalars to
    OUT_DIR/tb (records with an epoch only). Other ranks: no-op."""

    def __init__(
        self, out_dir: str, enabled: bool, tensorboard: bool = True, topk: int = 5
    ) -> None:
        self.out_dir, self.enabled, self.tensorboard, self.topk = (
            out_dir,
            enabled,
            tensorboard,
            topk,
        )  # topk: TRAIN.TOPK
        self.path, self.csv_path = (
            os.path.join(out_dir, METRICS),
            os.path.join(out_dir, METRICS_CSV),
        )
        self.csv_header: list[str] | None = None  # metrics.csv's columns, once read or written
        self._tb: Any = (
            None  # the SummaryWriter, made at the first epoch record (eval runs make none)
        )
        # On resume: the first global step the run writes again.
        # TensorBoard drops every event of the earlier files from this
        # step on (a SessionLog START): the steps written after the
        # checkpoint, before a crash, are not shown twice. The per-epoch
        # tags, whose epoch numbers lie below it, and metrics.jsonl are
        # repaired instead (repair()).
        self.purge_step: int | None = None

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = clean(record)
        files.append(self.path, json.dumps(record) + "\n")
        self._write_csv(
            {k: v for k, v in record.items() if not isinstance(v, list)}
        )  # per-class lists: jsonl only
        if self.tensorboard and isinstance(record.get("epoch"), int):
            # flushed once per epoch: TensorBoard sees the run live, a
            # crash loses nothing
            self._scalars(
                record.get("split", "train"), record, TB_KEYS, record["epoch"], flush=True
            )

    def write_step(self, step: int, scalars: dict[str, float]) -> None:
        """Per-step TensorBoard scalars (train_step/loss, lr, img_per_s,
        top1, top<k>) against the global step; not flushed here (the
        epoch's record flushes), so a print step costs little."""
        if self.enabled and self.tensorboard:
            self._scalars(STEP_PREFIX, scalars, STEP_KEYS, step)

    def _scalars(
        self,
        prefix: str,
        values: dict[str, Any],
        keys: tuple[str, ...],
        step: int,
        flush: bool = False,
    ) -> None:
        """The finite numbers of values under keys as TensorBoard
        scalars <prefix>/<key> (the top-k field named by its real k:
        <prefix>/top<k>); the SummaryWriter is made on first use. Its
        thread's failed write comes back here, at the next scalar or
        flush (files.writing)."""
        folder = os.path.join(self.out_dir, TENSORBOARD)
        with files.writing(folder):
            if self._tb is None:
                self._tb = _summary_writer(folder, self.purge_step)
            for key in keys:
                value = values.get(key)
                if (
                    isinstance(value, (int, float))
                    and not isinstance(value, bool)
                    and math.isfinite(value)
                ):
                    self._tb.add_scalar(
                        f"{prefix}/top{self.topk}" if key == "topk_acc" else f"{prefix}/{key}",
                        value,
                        step,
                    )
            if flush:
                self._tb.flush()

    def _write_csv(self, record: dict[str, Any]) -> None:
        if self.csv_header is None and os.path.isfile(
            self.csv_path
        ):  # the columns of an earlier start
            with open(self.csv_path, newline="") as f:
                self.csv_header = next(csv.reader(f), None)
        if self.csv_header is not None and record.keys() <= set(self.csv_header):
            row = io.StringIO(newline="")
            csv.DictWriter(row, fieldnames=self.csv_header).writerow(record)
            files.append(self.csv_path, row.getvalue())  # one row, one write
        # a first record, or a key never seen before: a new column,
        # older rows get empty cells
        else:
            self._rebuild_csv([*_csv_rows(self.csv_path), record])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def repair(self, completed_epochs: int) -> list[str]:
        """On resume (rank 0): make metrics.jsonl and TensorBoard's
        per-epoch tags agree with the checkpoint the run continues from.

        A line torn by a kill (the last one, without its newline), any
        other line that is not JSON, and every record of an epoch after
        ``completed_epochs`` (written before a kill stopped the epoch's
        checkpoint from landing: the run trains and records that epoch
        again) are MOVED to metrics_dropped.jsonl as {"line", "reason",
        "text"}; metrics.csv is rebuilt from what is kept; the
        TensorBoard scalars of those epochs are removed
        (drop_epochs_after). Returns the warnings it logged (one per
        reason)."""
        if not self.enabled:
            return []
        notes = (
            drop_epochs_after(os.path.join(self.out_dir, TENSORBOARD), completed_epochs)
            if self.tensorboard
            else []
        )
        if not os.path.isfile(self.path):
            return notes
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
                dropped.append(
                    {"line": i, "reason": reason, "text": line.decode("utf-8", "replace")}
                )
            else:
                kept.append(line)
        if not dropped and raw.endswith(b"\n"):
            return notes
        files.atomic_write(self.path, lambda f: f.writelines(ln + b"\n" for ln in kept))
        notes += self._move_dropped(dropped)
        self._rebuild_csv([json.loads(ln) for ln in kept])
        return notes

    def _move_dropped(self, dropped: list[dict[str, Any]]) -> list[str]:
        if not dropped:
            return []
        where = os.path.join(os.path.dirname(self.path), METRICS_DROPPED)
        files.append(where, "".join(json.dumps(d) + "\n" for d in dropped))
        notes = []
        for reason in dict.fromkeys(d["reason"] for d in dropped):
            numbers = [str(d["line"]) for d in dropped if d["reason"] == reason]
            lines = f"line{'s' if len(numbers) > 1 else ''} {', '.join(numbers)}"
            notes.append(f"{self.path}: {lines} moved to {where}: {reason}")
            log.warning("%s", notes[-1])
        return notes

    def _rebuild_csv(self, records: list[dict[str, Any]]) -> None:
        header = list(CSV_COLUMNS) + [k for r in records for k in r if k not in CSV_COLUMNS]
        self.csv_header = list(dict.fromkeys(header))
        text = io.StringIO(newline="")
        w = csv.DictWriter(text, fieldnames=self.csv_header)
        w.writeheader()
        w.writerows(records)
        files.atomic_write(self.csv_path, lambda f: f.write(text.getvalue().encode()))


def drop_epochs_after(tb: str, completed_epochs: int) -> list[str]:
    """Remove from the event files in tb (each rewritten atomically, its
    other records byte for byte) the per-epoch scalars (every tag but
    train_step/*) of the epochs after completed_epochs; the warning it
    logged, if any."""
    from tensorboard.compat.proto.event_pb2 import (
        Event,
    )  # tensorboard: torch's SummaryWriter needs it

    def later(data: bytes) -> bool:
        event = Event.FromString(data)
        return event.step > completed_epochs and any(
            not v.tag.startswith(f"{STEP_PREFIX}/") for v in event.summary.value
        )

    removed = 0
    for path in glob.glob(os.path.join(tb, "events.out.tfevents.*")):
        with open(path, "rb") as f:
            records = list(_tf_records(f.read()))
        kept = [whole for whole, data in records if not later(data)]
        if len(kept) < len(records):
            files.atomic_write(path, lambda f, kept=kept: f.writelines(kept))
            removed += len(records) - len(kept)
    if not removed:
        return []
    note = (
        f"{tb}: {removed} per-epoch scalars of epochs after {completed_epochs} removed (written "
        "before the checkpoint the run resumes from; those epochs are trained and recorded again)"
    )
    log.warning("%s", note)
    return [note]


def _tf_records(raw: bytes) -> Iterator[tuple[bytes, bytes]]:
    """(the whole record, its data) of each complete record of an event
    file (TFRecord: the data's length in 8 bytes, 4 of checksum, the
    data, 4 of checksum); a record torn by a kill ends the file."""
    pos = 0
    while pos + 12 <= len(raw):
        end = pos + 16 + int.from_bytes(raw[pos : pos + 8], "little")
        if end > len(raw):
            return
        yield raw[pos:end], raw[pos + 12 : end - 4]
        pos = end


def _summary_writer(folder: str, purge_step: int | None) -> Any:
    """TensorBoard's SummaryWriter. Its writer thread re-raises a write
    that failed, which threading prints as a traceback; the same error
    comes back to MetricsWriter as one line (_scalars), so the thread's
    own report is left out (every other thread's goes to the hook that
    was there)."""
    from torch.utils.tensorboard import SummaryWriter

    previous = threading.excepthook
    if not getattr(previous, "quiet_tensorboard", False):

        def hook(args: Any) -> None:
            if not type(args.thread).__module__.startswith("tensorboard."):
                previous(args)

        hook.quiet_tensorboard = True  # type: ignore[attr-defined]
        threading.excepthook = hook
    return SummaryWriter(folder, purge_step=purge_step)


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
        return (
            "records written after the checkpoint the run resumes from (epoch "
            f"{completed_epochs}); those epochs are trained and recorded again"
        )
    return None


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file; a line that is not one (torn
    by a kill, edited) is skipped with a warning naming the file and the
    line, so one bad line never hides the rest."""
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


# Field names of older metrics files, and their names now: readers
# accept both (read_jsonl).
RENAMED_FIELDS = {"top5": "topk_acc"}  # it always held top-TRAIN.TOPK, whatever k was


def upgraded(record: dict[str, Any]) -> dict[str, Any]:
    """A record of an older metrics.jsonl / eval.jsonl with today's
    field names."""
    for old, new in RENAMED_FIELDS.items():
        if old in record and new not in record:
            record[new] = record.pop(old)
    return record

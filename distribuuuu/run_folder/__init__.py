"""The run folder (OUT_DIR) behind one object: the training core reads and writes it only through
``RunFolder``; the commands around it use the few functions below.

What is in the folder and which module writes each file: layout.py. The modules of this package:
  checkpoint.py    checkpoint files: atomic save, keep-k, integrity digests, the newest intact one
  lock.py          OUT_DIR/run.lock: one training run per folder
  ownership.py     the folder checks before any process group, debris, records of an earlier run
  resume_check.py  whether a checkpoint fits the run that would continue it
  metrics_files.py metrics.jsonl / metrics.csv / TensorBoard / eval.jsonl, and their repair on resume
  records.py       env.json, env_history.jsonl, model.txt (and config.yaml through config/)

The order of the calls in one training run (engine/trainer.py):
  owned (api.run_command: rank 0 takes the lock) -> RunFolder(cfg) -> previous_seed -> has_checkpoint
  -> prepare_record -> latest + check_resume (resuming) -> write_record -> metrics -> save (each
  checkpoint) -> best (the test of the chosen checkpoint).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from yacs.config import CfgNode

from distribuuuu.errors import UserError
from distribuuuu.launch import comm
from distribuuuu.run_folder import checkpoint, ownership, records, resume_check
from distribuuuu.run_folder.layout import checkpoint_dir
from distribuuuu.run_folder.lock import Holder, acquire, lock_path, release, this_process
from distribuuuu.run_folder.metrics_files import MetricsWriter, recorded_test, write_eval_record
from distribuuuu.run_folder.ownership import (
    log_notes,
    refuse_existing_run,
    remove_debris,
    remove_if_empty,
    set_aside_records,
)

__all__ = ["RunFolder", "owned", "log_notes", "remove_if_empty", "preflight"]


def preflight(cfg: CfgNode, command: str, all_ranks_here: bool) -> None:
    """The folder's checks that need no process group: usable, not another live run's, and (train)
    a resume whose config may continue the run in it."""
    ownership.preflight(cfg, command, all_ranks_here)
    if command == "train":  # an edited config must not resume a run it does not fit (before config.yaml is written)
        resume_check.preflight(cfg)


def take(cfg: Any, me: Holder) -> list[str]:
    """Rank 0: acquire the lock, re-check under it what preflight saw, clear debris. Returns log lines."""
    notes = acquire(cfg.OUT_DIR, me)
    try:
        if not cfg.TRAIN.AUTO_RESUME:
            refuse_existing_run(cfg.OUT_DIR)
        debris = remove_debris(cfg.OUT_DIR)
    except BaseException:
        release(cfg.OUT_DIR, me)
        raise
    return notes + ([debris] if debris else [])


@contextlib.contextmanager
def owned(cfg: Any, ctx: Any, lock: bool = True) -> Iterator[list[str]]:
    """``with owned(cfg, ctx) as notes:`` rank 0 holds OUT_DIR/run.lock for the body.

    Collective: rank 0 decides and broadcasts the outcome, so every rank raises the same
    UserError when the folder is taken (none is left waiting). ``notes``: rank 0's lines to log
    once logging is set up. lock=False (eval): yields [] and does nothing.
    """
    if not lock:
        yield []
        return
    me, outcome, failure = this_process(), ("ok", []), None
    if ctx.is_main:
        try:
            outcome = ("ok", take(cfg, me))
        except UserError as e:
            outcome = ("user", str(e))
        except Exception as e:  # noqa: BLE001 - shared first, so no rank waits; re-raised below
            outcome, failure = ("crash", f"{type(e).__name__}: {e}"), e
    held = ctx.is_main and outcome[0] == "ok"
    try:
        kind, detail = comm.broadcast_object(outcome)
        if kind == "user":
            raise UserError(detail)
        if kind == "crash":
            if failure is not None:
                raise failure
            raise RuntimeError(f"rank 0 could not take the run lock {lock_path(cfg.OUT_DIR)}: {detail}")
        yield detail if ctx.is_main else []
    finally:
        if held:  # also when the broadcast itself failed (another rank died)
            release(cfg.OUT_DIR, me)


class RunFolder:
    """OUT_DIR as the training core sees it. Every rank makes one; only rank 0 writes files
    (``save``'s caller and MetricsWriter know which rank they are on)."""

    def __init__(self, cfg: CfgNode) -> None:
        self.cfg, self.out_dir = cfg, cfg.OUT_DIR
        self.checkpoints = checkpoint_dir(cfg.OUT_DIR)  # a sharded (FSDP) state's .dcp folders live here too

    # -- before the model is built ---------------------------------------------------------------
    def previous_seed(self) -> int | None:
        """RNG_SEED None and a run to continue: the seed it started with (env.json), else None."""
        return records.previous_seed(self.cfg)

    def has_checkpoint(self) -> bool:
        """Whether TRAIN.AUTO_RESUME will continue from a checkpoint here (its weights replace MODEL.WEIGHTS)."""
        return self.cfg.TRAIN.AUTO_RESUME and bool(checkpoint.resume_candidates(self.out_dir))

    def prepare_record(self, ctx: Any, model: torch.nn.Module) -> dict[str, Any] | None:
        """Collective: env.json's and model.txt's contents, gathered now, written by write_record."""
        return records.prepare_run_record(self.cfg, ctx, model)

    def write_record(self, prepared: dict[str, Any] | None, seed: int) -> None:
        """Once every check passed (a refused run leaves OUT_DIR as it was): config, env, model.txt, log.txt."""
        records.write_run_record(self.cfg, prepared, seed)

    # -- resume ----------------------------------------------------------------------------------
    def latest(self) -> tuple[dict[str, Any] | None, str | None]:
        """The newest intact checkpoint and its path, or (None, None) (a damaged one is skipped with a warning)."""
        return checkpoint.load_latest(self.out_dir)

    def check_resume(self, ckpt: dict[str, Any], path: str, facts: dict[str, Any],
                     model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> None:
        """Refuse (UserError) a checkpoint that does not fit this run: config, data, model, optimizer."""
        resume_check.check(ckpt, path, self.cfg, facts, model, optimizer)

    @staticmethod
    def facts(train_samples: int, val_samples: int) -> dict[str, Any]:
        """What a checkpoint records about the data, checked when the run resumes."""
        return resume_check.run_facts(train_samples, val_samples)

    # -- records ---------------------------------------------------------------------------------
    def metrics(self, is_main: bool, resumed_epoch: int | None, global_step: int) -> MetricsWriter:
        """The writer of metrics.jsonl/csv and TensorBoard. A fresh start moves an earlier run's records
        aside; a resume drops the records of epochs the checkpoint does not hold."""
        if resumed_epoch is None and is_main and (moved := set_aside_records(self.out_dir)):
            log_notes([moved])
        writer = MetricsWriter(self.out_dir, is_main, topk=self.cfg.TRAIN.TOPK)
        if resumed_epoch is not None:
            writer.repair(resumed_epoch)
            writer.purge_step = global_step + 1  # TensorBoard: steps after it are written again
        return writer

    def recorded_test(self) -> dict[str, Any] | None:
        """The test record that ends metrics.jsonl (a finished run), or None. Rank 0 reads it."""
        return recorded_test(self.out_dir)

    def write_eval_record(self, record: dict[str, Any], enabled: bool) -> str:
        return write_eval_record(self.out_dir, record, enabled)

    # -- checkpoints -----------------------------------------------------------------------------
    def save(self, record: dict[str, Any], is_best: bool) -> str:
        """Rank 0: the checkpoint file (atomic, with its digest), last.pth and best.pth, keep-k pruning."""
        return checkpoint.save(record, self.out_dir, is_best=is_best, keep=self.cfg.TRAIN.CKPT_KEEP)

    def shards_path(self, counters: dict[str, Any]) -> str:
        """The .dcp folder of a sharded (FSDP) state saved with these counters."""
        return checkpoint.checkpoint_path(self.out_dir, counters)[:-len(".pth")] + ".dcp"

    @staticmethod
    def load(path: str) -> dict[str, Any]:
        """A checkpoint file's entries: tensors and plain values only, its integrity digest verified."""
        return checkpoint.load(path)

    def best(self) -> str | None:
        """The checkpoint the run chose: best.pth, else last.pth, else None."""
        return checkpoint.best_or_last(self.out_dir)

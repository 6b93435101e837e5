"""The run folder (OUT_DIR) behind one object: the training core reads
and writes it only through ``RunFolder``; the commands around it use the
few functions below. Only this package writes here.

OUT_DIR/
  checkpoints/      epoch_NNNN.pth, step_NNNNNNNN.pth, last.pth (the newest), best.pth (the chosen
                    one), <name>.dcp/ (an FSDP run's shards, DIST.FSDP_STATE_DICT sharded):
                    RunFolder below, the file format: weights.py
  run.lock          the training run that owns the folder (lock.py)
  metrics.jsonl, metrics.csv, tb/   the run's records, one per epoch and split (metrics_files.py);
                    metrics_dropped.jsonl: those a resume moved out
  eval.jsonl        the records of ``distribuuuu eval`` into this folder
                    (RunFolder.write_eval_record)
  config.yaml (CFG_DEST), config_diff.yaml, env.json, env_history.jsonl, model.txt   the run's
                    config, what ran where, and the model (records.py); log.txt (logger.py)
  heldout.txt       the files TRAIN.VAL_SPLIT held out (RunFolder.write_heldout;
                    data/split_files.py lists them and lays the split out)

Whether a checkpoint fits the run that would continue it:
resume_check.py, entered only by a run that resumes. The order of the
calls in one training run (api.run_command, engine/trainer.py):
  check_folder (every process, before any process group) -> owned (rank 0 takes the lock) ->
  RunFolder(cfg) -> previous_seed -> has_checkpoint -> prepare_record -> latest + check_resume
  (resuming) -> metrics -> write_record -> save (each checkpoint) -> best (the test of the chosen
  one).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import socket
from typing import Any

import torch
from yacs.config import CfgNode

from distribuuuu import config, files, weights
from distribuuuu.errors import UserError
from distribuuuu.launch import comm, signals
from distribuuuu.logger import LOG_FILE, release_log
from distribuuuu.run_folder import lock, records, resume_check
from distribuuuu.run_folder.lock import BEST, CHECKPOINTS, LAST, LOCK, owned
from distribuuuu.run_folder.metrics_files import (
    EVAL_RECORDS,
    METRICS,
    METRICS_DROPPED,
    METRICS_FILES,
    MetricsWriter,
    clean,
)

__all__ = [
    "RunFolder",
    "owned",
    "check_folder",
    "log_notes",
    "remove_if_empty",
    "best_or_last",
    "checkpoint_in",
    "best_path",
    "HELDOUT",
    "NAMES",
    "CHECKPOINTS",
    "LAST",
    "BEST",
]

log = logging.getLogger("distribuuuu")

# Everything a run, and the tools, put into OUT_DIR besides the config
# (CFG_DEST must be none of them)
CONFUSION = (
    "confusion.csv"  # the best checkpoint's confusion matrix (rows: true class, columns: predicted)
)
HELDOUT = "heldout.txt"  # the held-out files, one path a line, relative to the training data
NAMES = (
    CHECKPOINTS,
    *METRICS_FILES,
    records.ENV,
    records.ENV_HISTORY,
    EVAL_RECORDS,
    METRICS_DROPPED,
    records.MODEL_TABLE,
    config.CONFIG_DIFF,
    LOG_FILE,
    LOCK,
    "plots",
    "bench",
    "export",
    "mlflow.db",
    "mlartifacts",
    "wandb",
    "trackers.json",
    CONFUSION,
    HELDOUT,
)  # mlflow.db to trackers.json: TRAIN.TRACKERS (trackers.py)
_NUMBERED = re.compile(r"(epoch|step)_(\d+)\.pth$")


# ---------------------------------------------------------------------------------------------
# The folder before any process group, and the commands around training
# ---------------------------------------------------------------------------------------------
def _probe_writable(folder: str, what: str) -> None:
    """Really create and remove a small file in folder (os.access lies
    for root and on network filesystems); UserError if that fails."""
    probe = os.path.join(folder, f".distribuuuu-probe.{socket.gethostname()}.{os.getpid()}")
    try:
        with open(probe, "x") as f:
            f.write("0")
        os.remove(probe)
    except OSError as e:
        raise UserError(
            f"{what} {folder} is not writable ({e.strerror}): a file cannot be created in it. Make "
            f"it writable (chmod u+w {folder}) or give another OUT_DIR"
        ) from None


def check_folder(cfg: CfgNode, command: str, all_ranks_here: bool) -> None:
    """The folder's checks that need no process group, in every process
    before any starts, so that every rank decides alike and none is left
    waiting: OUT_DIR lies outside the datasets' folders and is a folder
    (made if needed) that takes new files; for train, so is
    OUT_DIR/checkpoints if it exists, CFG_DEST names a file of its own,
    no live run holds the lock (lock.check_not_busy), TRAIN.AUTO_RESUME
    False finds no earlier run, and a run about to resume may continue
    with this config (before config.yaml or any checkpoint is written)."""
    out_dir = cfg.OUT_DIR
    _refuse_out_dir_in_data(cfg)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:  # a file where it, or a folder above it, would be; or no permission
        why = (
            "is a file, not a folder"
            if os.path.isfile(out_dir)
            else f"cannot be created ({e.strerror})"
        )
        raise UserError(
            f"OUT_DIR {out_dir} {why}; give a folder path you can write to (OUT_DIR runs/NAME)"
        ) from None
    _probe_writable(out_dir, "OUT_DIR")
    if command != "train":
        return
    ckpt_dir = os.path.join(out_dir, CHECKPOINTS)
    if os.path.lexists(ckpt_dir) and not os.path.isdir(ckpt_dir):
        raise UserError(f"{ckpt_dir} is a file, not a folder; move it away or give another OUT_DIR")
    if os.path.isdir(ckpt_dir):
        _probe_writable(ckpt_dir, "the checkpoints folder")
    if cfg.CFG_DEST in NAMES or os.path.isdir(os.path.join(out_dir, cfg.CFG_DEST)):
        _refuse_cfg_dest(cfg.CFG_DEST, out_dir)
    lock.check_not_busy(out_dir, all_ranks_here)
    if not cfg.TRAIN.AUTO_RESUME:
        lock.refuse_existing_run(out_dir)
    elif candidates := resume_candidates(out_dir):
        resume_check.check_resumable_config(cfg, candidates)


def _refuse_out_dir_in_data(cfg: CfgNode) -> None:
    """OUT_DIR inside an image folder of the run would become part of
    the data: the next run lists its folders (plots/, checkpoints/) as
    classes, or its files as images."""
    out = os.path.realpath(cfg.OUT_DIR)
    for key in ("TRAIN", "TEST"):
        data = os.path.realpath(cfg[key].DATASET)
        if os.path.isdir(cfg[key].DATASET) and os.path.commonpath([out, data]) == data:
            raise UserError(
                f"OUT_DIR {cfg.OUT_DIR} is inside {key}.DATASET {cfg[key].DATASET}: the run's "
                "files would become part of the data (its folders classes, its plots images); "
                f"give an OUT_DIR outside it (e.g. OUT_DIR runs/{os.path.basename(out)})"
            )


def _refuse_cfg_dest(name: str, out_dir: str) -> None:
    """CFG_DEST names a file in OUT_DIR: not a name the run folder uses
    for something else, nor a folder there."""
    if name in NAMES:
        raise UserError(
            f"CFG_DEST {name!r} is a name the run folder uses for something else; use a name such "
            "as config.yaml"
        )
    raise UserError(
        f"CFG_DEST {name!r} is an existing folder in OUT_DIR ({os.path.join(out_dir, name)}); the "
        "full config is written to that name: use a file name such as config.yaml"
    )


def log_notes(notes: list[str]) -> None:
    """owned's notes (a stale lock taken over, debris removed), once
    logging is set up."""
    for line in notes:
        log.warning(line)


def remove_if_empty(folder: str) -> None:
    """The folder a refused command made (check_folder), if nothing was
    written into it: a refused command makes no folder. A folder with
    anything in it stays."""
    try:
        os.rmdir(folder)
    except OSError:
        pass


def best_path(out_dir: str) -> str:
    """Where a run in out_dir keeps the checkpoint it chose (messages
    name it)."""
    return os.path.join(out_dir, CHECKPOINTS, BEST)


def last_path(out_dir: str) -> str:
    """OUT_DIR's last.pth (it may not exist)."""
    return os.path.join(out_dir, CHECKPOINTS, LAST)


def best_or_last(out_dir: str) -> str | None:
    """The run's chosen checkpoint, the one eval, predict, export and
    the final test use: best.pth (best on the validation split), else
    last.pth (no finite evaluation yet), else None."""
    paths = (os.path.join(out_dir, CHECKPOINTS, name) for name in (BEST, LAST))
    return next((p for p in paths if os.path.isfile(p)), None)


def checkpoint_in(folder: str) -> str | None:
    """The checkpoint file that a folder given for one most likely
    means: a run folder's chosen one (best_or_last), or best.pth /
    last.pth of a checkpoints folder itself; None when neither is
    there (a hint must name a file that exists)."""
    inside = (os.path.join(folder, name) for name in (BEST, LAST))
    return best_or_last(folder) or next((p for p in inside if os.path.isfile(p)), None)


def _numbered(folder: str, kind: str = "*") -> list[str]:
    """The epoch_*.pth / step_*.pth files in folder (kind "epoch",
    "step" or both), oldest first."""
    found = [
        p
        for p in glob.glob(os.path.join(folder, f"{kind}_*.pth"))
        if _NUMBERED.match(os.path.basename(p))
    ]
    return sorted(found, key=lambda p: int(_NUMBERED.match(os.path.basename(p)).group(2)))


def resume_candidates(out_dir: str) -> list[str]:
    """The checkpoint files auto-resume tries, in order: last.pth, then
    epoch/step files, newest first."""
    folder = os.path.join(out_dir, CHECKPOINTS)
    candidates = [
        os.path.join(folder, LAST),
        *sorted(_numbered(folder), key=os.path.getmtime, reverse=True),
    ]
    return [p for p in candidates if os.path.isfile(p)]


def _newest_intact(out_dir: str, candidates: list[str]) -> tuple[dict[str, Any], str]:
    """The first candidate that loads and passes its integrity check, a
    damaged one skipped with a warning; a UserError when every one is
    unreadable or damaged (starting over would overwrite them)."""
    tried: set[tuple[int, int]] = set()  # last.pth and best.pth are hard links: read each file once
    failed: list[str] = []
    for path in candidates:
        inode = (os.stat(path).st_dev, os.stat(path).st_ino)
        if inode in tried:
            continue
        tried.add(inode)
        try:
            return weights.load_checkpoint(path), path
        except (
            weights.UnreadableCheckpoint
        ) as e:  # a truncated, corrupt or damaged file: try an older one
            kind = "damaged" if isinstance(e, weights.DamagedCheckpoint) else "unreadable"
            log.warning("skipping %s checkpoint %s (%s)", kind, path, e)
            failed.append(os.path.basename(path))
    raise UserError(
        f"no intact checkpoint to resume in {os.path.join(out_dir, CHECKPOINTS)}: "
        f"{', '.join(failed)} cannot be used (see the warnings above). Starting over there would "
        f"overwrite them: move them away (mv {out_dir} {out_dir.rstrip('/')}.damaged) or give "
        "another OUT_DIR"
    )


def _failed_save(path: str, error: Exception) -> BaseException:
    """What a failed checkpoint write raises: the stop signal that
    interrupted it (torch's zip writer then failed closing),
    files.WriteFailed (exit 2) for a cause the user must fix, or an
    OSError; the last two say what the run can go on from."""
    interrupt = signals.interruption(error)
    if interrupt is not None:
        return interrupt
    kept = resume_candidates(os.path.dirname(os.path.dirname(path)))
    kept_line = (
        f"{os.path.basename(kept[0])}, the previous checkpoint, is intact"
        if kept
        else "no checkpoint of this run is kept yet (a re-run starts from the beginning)"
    )
    return files.write_failure(path, error, kept_line) or OSError(
        f"writing checkpoint {path} failed ({type(error).__name__}: {error}); {kept_line}"
    )


# ---------------------------------------------------------------------------------------------
# The folder as the training core sees it
# ---------------------------------------------------------------------------------------------
class RunFolder:
    """OUT_DIR as the training core sees it. Every rank makes one; only
    rank 0 writes files (``save``'s caller and MetricsWriter know which
    rank they are on)."""

    # a checkpoint file's entries, its integrity digest verified
    load = staticmethod(weights.load_checkpoint)

    def __init__(self, cfg: CfgNode) -> None:
        self.cfg, self.out_dir = cfg, cfg.OUT_DIR
        self.checkpoints = os.path.join(cfg.OUT_DIR, CHECKPOINTS)  # FSDP's .dcp folders too

    # -- before the model is built
    # ---------------------------------------------------------------
    def previous_seed(self) -> int | None:
        """RNG_SEED None and a run to continue: the seed it started with
        (env.json), so that the resumed run shuffles as it began; else
        None."""
        if self.cfg.RNG_SEED is not None or not self.has_checkpoint():
            return None
        return records.recorded_seed(self.out_dir)

    def has_checkpoint(self) -> bool:
        """Whether TRAIN.AUTO_RESUME will continue from a checkpoint
        here (its weights replace MODEL.WEIGHTS)."""
        return self.cfg.TRAIN.AUTO_RESUME and bool(resume_candidates(self.out_dir))

    def prepare_record(
        self, ctx: comm.DistContext, model: torch.nn.Module
    ) -> dict[str, Any] | None:
        """Collective (every rank's host is gathered): what write_record
        writes, taken now and written nothing yet; model is the bare
        module, before sharding. Rank 0 gets it, the others None."""
        placements = comm.all_gather_object(records.placement(ctx))
        if not ctx.is_main:
            return None
        return {
            "env": records.env_record(self.cfg, ctx, placements),
            "model": records.model_table(model, self.cfg),
        }

    def write_record(self, prepared: dict[str, Any] | None, seed: int) -> None:
        """Once every check passed (a refused run leaves OUT_DIR as it
        was), rank 0 (``prepared``): config.yaml, config_diff.yaml,
        env.json and model.txt, each replaced atomically, and a line
        added to env_history.jsonl; every rank: log.txt gets the lines
        held so far (logger.release_log)."""
        if prepared is not None:
            os.makedirs(self.out_dir, exist_ok=True)  # engine.fit called without api's checks
            env = {**prepared["env"], "seed": seed}
            texts = {
                self.cfg.CFG_DEST: self.cfg.dump(),
                config.CONFIG_DIFF: records.config_diff(self.cfg),
                records.ENV: json.dumps(env, indent=2) + "\n",
                records.MODEL_TABLE: prepared["model"],
            }
            for name, text in texts.items():
                files.atomic_write(
                    os.path.join(self.out_dir, name), lambda f, text=text: f.write(text.encode())
                )
            files.append(
                os.path.join(self.out_dir, records.ENV_HISTORY), json.dumps(env) + "\n"
            )  # one per start
            log.info(
                "run record: env.json, model.txt (%s)",
                prepared["model"].rstrip().splitlines()[-1].strip(),
            )
        release_log()

    # -- resume
    # ----------------------------------------------------------------------------------
    def latest(self) -> tuple[dict[str, Any] | None, str | None]:
        """The newest intact checkpoint and its path, or (None, None) (a
        damaged one is skipped with a warning)."""
        candidates = resume_candidates(self.out_dir)
        return _newest_intact(self.out_dir, candidates) if candidates else (None, None)

    def check_resume(
        self,
        ckpt: dict[str, Any],
        path: str,
        data_identity: dict[str, Any],
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        """Refuse (UserError) a checkpoint that does not fit this run:
        config, data, model, optimizer."""
        resume_check.check(ckpt, path, self.cfg, data_identity, model, optimizer)

    @staticmethod
    def data_identity(
        train_samples: int, val_samples: int, classes: list[str] | None = None
    ) -> dict[str, Any]:
        """What a checkpoint records about the data beyond the config
        (its "facts" entry), checked when the run resumes: the sizes,
        and the training classes in label order (the model card's)."""
        return {
            "train_samples": int(train_samples),
            "val_samples": int(val_samples),
            "classes": classes,
        }

    # -- records
    # ---------------------------------------------------------------------------------
    def metrics(self, is_main: bool, resumed_epoch: int | None, global_step: int) -> MetricsWriter:
        """The writer of metrics.jsonl/csv and TensorBoard. A fresh
        start moves an earlier run's records aside; a resume drops the
        records of epochs the checkpoint does not hold."""
        if resumed_epoch is None and is_main and (found := lock.count_records(self.out_dir)):
            log.warning(lock.set_aside_records(self.out_dir, found))
        writer = MetricsWriter(self.out_dir, is_main, topk=self.cfg.TRAIN.TOPK)
        if resumed_epoch is not None:
            writer.repair(resumed_epoch)
            writer.purge_step = global_step + 1  # TensorBoard: steps after it are written again
        return writer

    def recorded_test(self) -> dict[str, Any] | None:
        """The test record that ends metrics.jsonl (a finished run), or
        None. Rank 0 reads it."""
        try:
            with open(os.path.join(self.out_dir, METRICS), "rb") as f:
                lines = [line for line in f.read().splitlines() if line.strip()]
            last = json.loads(lines[-1]) if lines else None
        except (OSError, ValueError):
            return None
        return last if isinstance(last, dict) and last.get("split") == "test" else None

    def write_heldout(self, paths: list[str] | None) -> None:
        """Rank 0: heldout.txt, the files TRAIN.VAL_SPLIT held out (one
        path a line), replaced atomically; nothing for a source without
        files (paths None)."""
        if paths is not None:
            text = "".join(f"{path}\n" for path in paths)
            files.atomic_write(
                os.path.join(self.out_dir, HELDOUT), lambda f: f.write(text.encode())
            )

    def write_confusion(self, text: str, folder: str | None = None) -> str:
        """Rank 0: confusion.csv (engine/evaluation.py's text) in
        OUT_DIR (the best checkpoint's) or in ``folder`` (eval's
        TEST.OUT_DIR), replaced atomically; returns its path."""
        path = os.path.join(folder or self.out_dir, CONFUSION)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        files.atomic_write(path, lambda f: f.write(text.encode()))
        return path

    def write_eval_record(self, record: dict[str, Any], enabled: bool) -> str:
        """Rank 0 (enabled) adds an ``eval`` record to
        OUT_DIR/eval.jsonl; returns that path. Kept out of
        metrics.jsonl, whose lines are the run's epochs and splits
        (plot, bench --compare and resume's repair read it): an eval
        into a run folder must not change what they see."""
        path = os.path.join(self.out_dir, EVAL_RECORDS)
        if enabled:
            os.makedirs(self.out_dir, exist_ok=True)
            files.append(path, json.dumps(clean(record)) + "\n")
        return path

    # -- checkpoints
    # -----------------------------------------------------------------------------
    def _path(self, counters: dict[str, Any]) -> str:
        """epoch_NNNN.pth at an epoch's end, step_NNNNNNNN.pth
        mid-epoch."""
        if counters.get("samples_in_epoch"):
            return os.path.join(self.checkpoints, f"step_{counters['global_step']:08d}.pth")
        return os.path.join(self.checkpoints, f"epoch_{counters['epoch']:04d}.pth")

    def shards_path(self, counters: dict[str, Any]) -> str:
        """The .dcp folder of a sharded (FSDP) state saved with these
        counters."""
        return self._path(counters)[: -len(".pth")] + ".dcp"

    def save(self, record: dict[str, Any], is_best: bool) -> str:
        """Rank 0: the checkpoint file (weights.save_checkpoint: atomic,
        with its digest), last.pth and best.pth pointed at it, then the
        oldest files of its kind beyond TRAIN.CKPT_KEEP pruned (with
        their .dcp shard folders). A failed write leaves the previous
        checkpoint and says so."""
        path = self._path(record)
        try:
            if not os.path.isdir(self.checkpoints):  # in OUT_DIR, which must still be there
                os.mkdir(self.checkpoints)
            weights.save_checkpoint(record, path)
        except Exception as e:  # a stop signal, a full disk or another failure
            raise _failed_save(path, e) from e
        files.atomic_link(path, os.path.join(self.checkpoints, LAST))
        if is_best:
            files.atomic_link(path, os.path.join(self.checkpoints, BEST))
        keep = self.cfg.TRAIN.CKPT_KEEP  # pruned only now that the new checkpoint is complete
        existing = _numbered(
            self.checkpoints, "step" if record.get("samples_in_epoch") else "epoch"
        )
        for old in existing[:-keep] if keep > 0 else existing:
            if old != path:
                os.remove(old)
                shards = old[: -len(".pth")] + ".dcp"
                if (
                    os.path.isdir(shards) and shards not in self._pinned_shards()
                ):  # best.pth may need its shards
                    shutil.rmtree(shards)
        return path

    def _pinned_shards(self) -> set[str | None]:
        """The .dcp folders that last.pth and best.pth (sharded
        checkpoints) refer to."""
        pinned = set()
        for name in (LAST, BEST):
            # peek: only the small "sharded" entry is needed, not the
            # tensors of the whole file
            try:
                ref = weights.peek_checkpoint(os.path.join(self.checkpoints, name)).get("sharded")
            except Exception:  # noqa: BLE001 - a missing or unreadable file pins nothing
                ref = None
            pinned.add(os.path.join(self.checkpoints, ref) if ref else None)
        return pinned

    def best(self) -> str | None:
        """The checkpoint the run chose: best.pth, else last.pth, else
        None."""
        return best_or_last(self.out_dir)

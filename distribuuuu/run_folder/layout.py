"""The names of the run folder's files: each is stated here once, and only this package uses them.

OUT_DIR/
  checkpoints/      epoch_NNNN.pth, step_NNNNNNNN.pth, last.pth (the newest), best.pth (the chosen one),
                    <name>.dcp/ (an FSDP run's shards, DIST.FSDP_STATE_DICT sharded)
  run.lock          the training run that owns the folder (lock.py)
  metrics.jsonl, metrics.csv, tb/   the run's records, one per epoch and split (metrics_files.py);
                    metrics_dropped.jsonl: those a resume moved out
  eval.jsonl        the records of ``distribuuuu eval`` into this folder (metrics_files.py)
  env.json, env_history.jsonl, model.txt   what ran where, and the model (records.py)
  config.yaml (CFG_DEST), config_diff.yaml   the run's config (config/), log.txt (logger.py)
"""

from __future__ import annotations

import os

CHECKPOINTS = "checkpoints"
LAST = "last.pth"  # a hard link to the newest checkpoint
BEST = "best.pth"  # a hard link to the checkpoint TRAIN.BEST_METRIC chose
LOCK = "run.lock"
METRICS = "metrics.jsonl"
METRICS_CSV = "metrics.csv"
TENSORBOARD = "tb"
METRICS_DROPPED = "metrics_dropped.jsonl"  # records a resume moved out of metrics.jsonl
EVAL_RECORDS = "eval.jsonl"  # `eval` records: apart from metrics.jsonl, whose lines are the run's epochs
ENV, ENV_HISTORY, MODEL_TABLE = "env.json", "env_history.jsonl", "model.txt"
METRICS_FILES = (METRICS, METRICS_CSV, TENSORBOARD)  # what a run appends to: set aside together
# What this package writes into OUT_DIR, and what the tools put there (api.preflight adds log.txt and
# config_diff.yaml, whose writers name them: CFG_DEST must replace none of them)
NAMES = (CHECKPOINTS, *METRICS_FILES, ENV, ENV_HISTORY, EVAL_RECORDS, METRICS_DROPPED, MODEL_TABLE, LOCK,
         "plots", "bench", "export")


def checkpoint_dir(out_dir: str) -> str:
    return os.path.join(out_dir, CHECKPOINTS)


def best_path(out_dir: str) -> str:
    """Where a run in out_dir keeps the checkpoint it chose (messages name it; best_or_last reads it)."""
    return os.path.join(checkpoint_dir(out_dir), BEST)

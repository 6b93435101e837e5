"""Experiment trackers (TRAIN.TRACKERS): MLflow and Weights & Biases,
one tracker run per job, written by global rank 0 alone and continued
across resumes. engine/hooks.py's TrackerHook feeds them.

A run gets the config once, as flattened parameters (MLflow: each value
cut to its length cap); config.yaml and env.json as files; tags from
env.json (git commit, torch version, world size, launcher) and, at the
end, the best and last checkpoint paths (TRAIN.TRACKER_CHECKPOINTS: the
files too); metrics against the global optimizer step: the print steps'
numbers (train_step/loss, ...) and every train/val/test record
(<split>/<key>; numbers nested in a record, such as per-class results,
as <split>/<key>/<name>). Its status on the way out: finished, failed
(an error), or killed (a stop signal); a resume sets it running again.

Resume: the run ids are in every checkpoint (Trainer.remember); the
resumed job reattaches them and logs no parameters again (MLflow refuses
a changed value). A kill can leave a tracker holding points past the
checkpoint, which the resumed job computes again: OUT_DIR/trackers.json
keeps each run's last step per metric, and a point at or below it is not
logged again (MLflow and W&B keep one value per step; an offline W&B run
cannot be asked what it holds).

Offline by default: MLflow writes OUT_DIR/mlflow.db (sqlite; files in
OUT_DIR/mlartifacts) unless MLFLOW_TRACKING_URI is set; W&B follows
WANDB_MODE and is offline when it is unset (OUT_DIR/wandb/, an
offline-run-* folder per job, all with the run's id). A tracker that
cannot start stops the run before training; one that fails later is
dropped with one line, and training goes on (the run folder is the
record).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from yacs.config import CfgNode

from distribuuuu import config, files
from distribuuuu.errors import UserError
from distribuuuu.launch import signals
from distribuuuu.logger import LOGGER_NAME
from distribuuuu.run_folder import BEST, CHECKPOINTS, LAST, records

log = logging.getLogger(LOGGER_NAME)

MARKS = "trackers.json"  # in OUT_DIR: {run id: {metric: the last step logged}}
LABELS = ("epoch", "split", "step", "topk", "n")  # a record's labels and sample count: not metrics
STATUS_EXIT_CODES = {
    "finished": 0,
    "failed": 1,
    "killed": 255,
}  # W&B's status is its exit code (255: Ctrl-C's)


def require_installed(names: list[str]) -> None:
    """Each named tracker's package is importable here (every rank asks,
    so every rank stops alike)."""
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise UserError(
                f"TRAIN.TRACKERS names {name}, which is not installed here: pip install "
                f"'distribuuuu[{name}]'"
            )


class MLflowRun:
    """A run in MLflow's store: OUT_DIR/mlflow.db, or the one
    MLFLOW_TRACKING_URI names (a server)."""

    WHERE = "MLFLOW_TRACKING_URI says where it writes (unset: OUT_DIR/mlflow.db)"

    def __init__(self, out_dir: str, run_id: str | None, name: str) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        given = os.environ.get("MLFLOW_TRACKING_URI")
        self.uri = given or f"sqlite:///{os.path.abspath(out_dir)}/mlflow.db"
        self.client = MlflowClient(self.uri)
        if run_id is not None:  # the checkpoint's run, running again
            try:
                self.client.update_run(run_id, status="RUNNING")
            except MlflowException as e:  # e.g. a run folder moved without its store
                log.warning(
                    "MLflow: run %s of the checkpoint is not in %s (%s): a new run",
                    run_id,
                    self.uri,
                    e,
                )
                run_id = None
        if run_id is None:
            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "distribuuuu")
            found = self.client.get_experiment_by_name(experiment)
            local = (
                None if given else Path(out_dir, "mlartifacts").resolve().as_uri()
            )  # not ./mlruns of the cwd
            exp_id = (
                found.experiment_id if found else self.client.create_experiment(experiment, local)
            )
            run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        self.run_id = run_id
        log.info(
            "MLflow run %s in %s%s",
            run_id,
            self.uri,
            "" if given else f" (browse: mlflow ui --backend-store-uri {self.uri})",
        )

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        items = [Param(k, str(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in params.items()]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + MAX_PARAMS_TAGS_PER_BATCH])

    def log_files(self, paths: list[str]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, path)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        names = {
            k: re.sub(r"[^\w\-. :/]", "_", k) for k in metrics
        }  # MLflow's: letters, digits, _-. :/ only
        self.client.log_batch(
            self.run_id, metrics=[Metric(names[k], v, now, step) for k, v in metrics.items()]
        )

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status.upper())


class WandbRun:
    """A W&B run, offline in OUT_DIR/wandb unless WANDB_MODE says
    otherwise."""

    WHERE = "WANDB_MODE says where it writes (unset: offline, OUT_DIR/wandb)"

    def __init__(self, out_dir: str, run_id: str | None, name: str) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "distribuuuu"),
            name=name,
            id=run_id,
            resume="allow" if run_id else None,
            dir=out_dir,
            mode=None if os.environ.get("WANDB_MODE") else "offline",  # None: WANDB_MODE's
            settings=wandb.Settings(console="off", silent=True),
        )  # log.txt has the console
        self.run_id = self.run.id
        where = os.path.dirname(self.run.dir)  # the job's offline-run-* (or run-*) folder
        log.info(
            "W&B run %s in %s%s",
            self.run_id,
            where,
            f" (upload: wandb sync --id {self.run_id} "
            f"{os.path.dirname(where)}/offline-run-*-{self.run_id})"
            if self.run.offline
            else "",
        )

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params)

    def log_files(self, paths: list[str]) -> None:
        folder = os.path.join(
            self.run.dir, "distribuuuu"
        )  # the run's files (W&B writes its own config.yaml)
        os.makedirs(folder, exist_ok=True)
        for path in paths:
            shutil.copy(path, folder)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.run.summary.update(tags)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self, status: str) -> None:
        if status == "killed":
            self.run.mark_preempting()  # W&B's word for a run stopped to be resumed
        self.run.finish(exit_code=STATUS_EXIT_CODES[status])


CLIENTS = {"mlflow": MLflowRun, "wandb": WandbRun}  # config/validate.py's TRACKERS


def as_metrics(prefix: str, values: dict[str, Any], topk: int) -> dict[str, float]:
    """The numbers of a record as <prefix>/<key> ("topk_acc" as top<k>,
    as in TensorBoard), nested ones (per-class results) as
    <prefix>/<key>/<name>; its labels and sample count left out."""
    metrics: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}/top{topk}" if key == "topk_acc" else f"{prefix}/{key}"
        if isinstance(value, dict):
            metrics.update(as_metrics(name, value, topk))
        elif key not in LABELS and isinstance(value, (int, float)) and not isinstance(value, bool):
            metrics[name] = float(value)
    return metrics


class Runs:
    """Rank 0's tracker runs of one job: started (or reattached:
    ``ids``, from the checkpoint) together and fed together. Ends them
    at exit when the run did not get to ``finish``: killed after a stop
    signal, failed otherwise."""

    def __init__(self, cfg: CfgNode, ids: dict[str, str]) -> None:
        out_dir, self.topk, self.upload = cfg.OUT_DIR, cfg.TRAIN.TOPK, cfg.TRAIN.TRACKER_CHECKPOINTS
        self.marks_path, self.checkpoints = (
            os.path.join(out_dir, MARKS),
            os.path.join(out_dir, CHECKPOINTS),
        )
        self.clients: dict[str, Any] = {}
        for name in cfg.TRAIN.TRACKERS:
            try:
                self.clients[name] = CLIENTS[name](
                    out_dir, ids.get(name), os.path.basename(os.path.abspath(out_dir))
                )
            except Exception as e:  # noqa: BLE001 - whatever stops a client (a server unreachable, a bad URI)
                self.finish("failed")  # the ones already started
                first = (str(e).strip().splitlines() or [""])[0]
                raise UserError(
                    f"TRAIN.TRACKERS: {name} could not start ({type(e).__name__}: {first}); "
                    f"{CLIENTS[name].WHERE}"
                ) from None
        atexit.register(self._at_exit)
        self.marks = _read_json(
            self.marks_path
        )  # kept for a dropped tracker too: a resume reattaches it
        self.logged = {
            name: self.marks.setdefault(client.run_id, {}) for name, client in self.clients.items()
        }
        with open(
            os.path.join(out_dir, records.ENV)
        ) as f:  # this start's record (RunFolder.write_record)
            env = json.load(f)
        new = [name for name in self.clients if name not in ids]
        self._each(
            "log_params", config.flatten(cfg), only=new
        )  # once per run: never again on resume
        self._each(
            "log_files", [os.path.join(out_dir, cfg.CFG_DEST), os.path.join(out_dir, records.ENV)]
        )
        self._each(
            "set_tags",
            {
                "git_commit": str((env.get("git") or {}).get("commit")),
                "torch": env["versions"]["torch"],
                "world_size": str(env["world_size"]),
                "launcher": env["launcher"],
            },
        )

    @property
    def ids(self) -> dict[str, str]:
        """What every checkpoint keeps, for the resumed job to reattach."""
        return {name: client.run_id for name, client in self.clients.items()}

    def _each(self, method: str, *args: Any, only: list[str] | None = None) -> None:
        """Call method on every client (or those named in only); one
        that fails is dropped with one line."""
        for name, client in list(self.clients.items()):
            if only is None or name in only:
                try:
                    getattr(client, method)(*args)
                except Exception as e:  # noqa: BLE001 - a tracker's failure must not end the training
                    log.warning(
                        "TRAIN.TRACKERS: %s failed (%s: %s); training goes on without it (the run "
                        "folder keeps every record)",
                        name,
                        type(e).__name__,
                        e,
                    )
                    del self.clients[name]

    def log(self, prefix: str, values: dict[str, Any], step: int) -> None:
        """values (a record, or a print step's numbers) as metrics at
        step, but for each run the metrics whose step it holds already
        (a resumed job computes them again)."""
        metrics = as_metrics(prefix, values, self.topk)
        for name in list(self.clients):
            fresh = {k: v for k, v in metrics.items() if step > self.logged[name].get(k, -1)}
            if fresh:
                self._each("log_metrics", fresh, step, only=[name])
                if name in self.clients:  # logged (a failure dropped it)
                    self.logged[name].update(dict.fromkeys(fresh, step))
        files.atomic_write(self.marks_path, lambda f: f.write(json.dumps(self.marks).encode()))

    def finish(self, status: str) -> None:
        """Tag the checkpoint paths (TRAIN.TRACKER_CHECKPOINTS: send the
        files too, at a finished run's end only: a stopped job has no
        time to spare) and end every run with status (finished, failed
        or killed)."""
        paths = {
            "best_checkpoint": os.path.join(self.checkpoints, BEST),
            "last_checkpoint": os.path.join(self.checkpoints, LAST),
        }
        tags = {k: path for k, path in paths.items() if os.path.exists(path)}
        if tags:
            self._each("set_tags", tags)
        if tags and self.upload and status == "finished":
            self._each("log_files", list(tags.values()))
        self._each("finish", status)
        self.clients = {}
        atexit.unregister(self._at_exit)

    def _at_exit(self) -> None:
        self.finish(
            "killed" if signals.received else "failed"
        )  # a stop signal: after its checkpoint


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):  # none yet, or torn by a kill: no marks
        return {}

"""Experiment trackers (TRAIN.TRACKERS): MLflow and Weights & Biases,
one tracker run per run folder, written by global rank 0 alone and
continued across resumes. engine/hooks.py's TrackerHook feeds them.

A run gets the config once, when it is made, as flattened parameters
(MLflow: each value cut to its length cap); with its first points
config.yaml and env.json as files and tags from env.json (git commit,
torch version, world size, launcher); at the end the best and last
checkpoint paths (TRAIN.TRACKER_CHECKPOINTS: the files too); metrics
against the global optimizer step: the print steps' numbers
(train_step/loss, ...) and every train/val/test record
(<split>/<key>; a record's per-class results, per_class_top1, as
<split>/per_class_top1/<class name>). Metric names keep MLflow's
characters (letters, digits, _-. :/; others become _) in both
trackers. Its status on the way out: finished, failed (an error), or
killed (a stop signal); a resume sets it running again.

Starting: a tracker starts before the run record is written, so one
that cannot start (exit 2) leaves OUT_DIR as it was. Its one line
says where it writes; a server that refuses or does not answer is
tried again for TRAIN.TRACKER_START_S seconds (MLflow's own retries
are off meanwhile; W&B waits that long as its init_timeout), and a
stop signal ends the wait.

A tracker run belongs to one run folder: every checkpoint keeps the
folder and the run ids (Trainer.remember). A resume in that folder
reattaches them and logs no parameters again (MLflow refuses a changed
value); a checkpoint of another folder (a copy, a branch, a moved
folder) starts new runs here, tagged parent_run (the checkpoint's run
id) and parent_folder. A kill can leave a tracker holding points past
the checkpoint, which the resumed job computes again: a point at or
below the last step a run holds is not logged again. What a run holds
is asked from MLflow's store, and kept in OUT_DIR/trackers.json
({run id: {metric: the last step logged}}), the only record for W&B
(an offline run cannot be asked; online, W&B itself drops a step below
its current one). A damaged trackers.json is said once.

Offline by default: MLflow writes OUT_DIR/mlflow.db (sqlite; files in
OUT_DIR/mlartifacts) unless MLFLOW_TRACKING_URI is set; W&B follows
WANDB_MODE and is offline when it is unset (OUT_DIR/wandb/, an
offline-run-* folder per job, all with the run's id). A tracker that
fails later, or whose local store is removed mid-run, is dropped with
one line, and training goes on (the run folder is the record).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator
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
PAUSE_S = 1.0  # between two tries of a start that reached no server
REQUEST_S = 10  # the longest one request of a start may wait: a stop signal is acted on between two


def require_installed(names: list[str]) -> None:
    """Each named tracker's package is importable here (every rank asks,
    so every rank stops alike)."""
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise UserError(
                f"TRAIN.TRACKERS names {name}, which is not installed here: pip install "
                f"'distribuuuu[{name}]'"
            )


def unreachable(error: BaseException) -> bool:
    """Whether error came from not reaching a server (an OSError under
    it: refused, timed out, unresolved; requests' errors are OSErrors),
    which a later try may not meet."""
    return any(isinstance(e, OSError) for e in signals.chain(error))


def _pause(seconds: float) -> None:
    """Sleep, a stop signal received meanwhile (recorded: a preemption
    signal) ending the wait as a stop."""
    end = time.monotonic() + seconds
    while signals.received is None and time.monotonic() < end:
        time.sleep(min(0.1, max(0.0, end - time.monotonic())))
    if signals.received is not None:
        raise signals.Terminated(signals.received)


def within(seconds: float, attempt: Callable[[float], Any]) -> Any:
    """attempt(seconds left), tried again while it reaches no server and
    time is left; the last failure goes up."""
    deadline = time.monotonic() + seconds
    while True:
        _pause(0)
        try:
            return attempt(deadline - time.monotonic())
        except Exception as e:  # told apart by unreachable()
            left = deadline - time.monotonic()
            if left <= 0 or not unreachable(e):
                raise
        _pause(min(PAUSE_S, left))


@contextlib.contextmanager
def _bounded_mlflow_requests(seconds: float) -> Iterator[None]:
    """MLflow's requests, while a run starts: no retries of its own (a
    refused connection waited 259 s through them), each answered within
    the time left (at most REQUEST_S)."""
    names = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")
    before = {name: os.environ.get(name) for name in names}
    timeout = min(REQUEST_S, max(1, math.ceil(seconds)))
    os.environ.update(zip(names, ("0", str(timeout))))
    try:
        yield
    finally:
        for name, value in before.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


class MLflowRun:
    """A run in MLflow's store: OUT_DIR/mlflow.db, or the one
    MLFLOW_TRACKING_URI names (a server). ``created``: a new run (not
    the checkpoint's); ``held``: the last step of each metric the store
    holds for a reattached run."""

    WHERE = "MLFLOW_TRACKING_URI says where it writes (unset: OUT_DIR/mlflow.db)"

    def __init__(self, out_dir: str, run_id: str | None, name: str, seconds: float) -> None:
        from mlflow.tracking import MlflowClient

        given = os.environ.get("MLFLOW_TRACKING_URI")
        self.store = self.uri(out_dir)
        self.local = None  # OUT_DIR's sqlite file
        self.artifacts = None  # OUT_DIR's folder for its files (not ./mlruns of the cwd)
        browse = ""
        if given:
            log.info(
                "MLflow: starting a run at %s (a server that refuses or does not answer is tried "
                "again for %g s, TRAIN.TRACKER_START_S)",
                given,
                seconds,
            )
        else:
            self.local = self.store.removeprefix("sqlite:///")
            self.artifacts = Path(out_dir, "mlartifacts").resolve().as_uri()
            browse = f" (browse: mlflow ui --backend-store-uri {self.store})"
        self.client = MlflowClient(self.store)
        self.run_id, self.created, self.held = within(
            seconds, lambda left: self._start(run_id, name, left)
        )
        log.info("MLflow run %s in %s%s", self.run_id, self.store, browse)

    @staticmethod
    def uri(out_dir: str = "OUT_DIR") -> str:
        """Where the run goes: MLFLOW_TRACKING_URI, else OUT_DIR's
        sqlite file."""
        local = os.path.join(os.path.abspath(out_dir), "mlflow.db")
        return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{local}"

    def _start(
        self, run_id: str | None, name: str, seconds: float
    ) -> tuple[str, bool, dict[str, int]]:
        """One try: the checkpoint's run running again, with the steps
        it holds, or a new run."""
        from mlflow.exceptions import MlflowException

        with _bounded_mlflow_requests(seconds):
            if run_id is not None:
                try:
                    self.client.update_run(run_id, status="RUNNING")
                    metrics = self.client.get_run(run_id).data.to_proto().metrics
                    return run_id, False, {m.key: m.step for m in metrics}
                except MlflowException as e:  # e.g. a run folder moved without its store
                    if unreachable(e):
                        raise
                    log.warning(
                        "MLflow: run %s of the checkpoint is not in %s (%s): a new run",
                        run_id,
                        self.store,
                        e,
                    )
            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "distribuuuu")
            found = self.client.get_experiment_by_name(experiment)
            if found is not None:
                experiment_id = found.experiment_id
            else:
                experiment_id = self.client.create_experiment(experiment, self.artifacts)
            return self.client.create_run(experiment_id, run_name=name).info.run_id, True, {}

    def lost(self) -> str | None:
        """What is gone of OUT_DIR's store, if it was removed."""
        if self.local is not None and not os.path.exists(self.local):
            return f"its store {self.local} was removed"
        return None

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
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(items), MAX_METRICS_PER_BATCH):  # per-class results: many
            self.client.log_batch(self.run_id, metrics=items[i : i + MAX_METRICS_PER_BATCH])

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status.upper())


class WandbRun:
    """A W&B run, offline in OUT_DIR/wandb unless WANDB_MODE says
    otherwise. It cannot say which steps it holds (``held`` empty)."""

    WHERE = "WANDB_MODE says where it writes (unset: offline, OUT_DIR/wandb)"

    @staticmethod
    def uri(out_dir: str = "OUT_DIR") -> str:
        """W&B's server (online)."""
        return os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")

    def __init__(self, out_dir: str, run_id: str | None, name: str, seconds: float) -> None:
        import wandb

        mode = None  # WANDB_MODE's
        if not os.environ.get("WANDB_MODE"):
            mode = "offline"
        elif os.environ["WANDB_MODE"] == "online":
            log.info(
                "W&B: starting a run at %s (waiting up to %g s for it, TRAIN.TRACKER_START_S)",
                self.uri(),
                seconds,
            )
        folder = os.path.join(out_dir, "wandb")
        made = not os.path.exists(folder)
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "distribuuuu"),
                name=name,
                id=run_id,
                resume="allow" if run_id else None,
                dir=out_dir,
                mode=mode,
                settings=wandb.Settings(console="off", silent=True, init_timeout=seconds),
            )  # log.txt has the console
        except Exception:
            if made:  # what this start made: a refused run leaves OUT_DIR as it was
                shutil.rmtree(folder, ignore_errors=True)
            raise
        self.run_id, self.created, self.held = self.run.id, run_id is None, {}
        where = os.path.dirname(self.run.dir)  # the job's offline-run-* (or run-*) folder
        upload = ""
        if self.run.offline:
            upload = (
                f" (upload: wandb sync --id {self.run_id} "
                f"{os.path.dirname(where)}/offline-run-*-{self.run_id})"
            )
        log.info("W&B run %s in %s%s", self.run_id, where, upload)

    def lost(self) -> str | None:
        """An offline run keeps every point in its folder: whether that
        was removed."""
        where = os.path.dirname(self.run.dir)
        if self.run.offline and not os.path.isdir(where):
            return f"its folder {where} was removed"
        return None

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params)

    def log_files(self, paths: list[str]) -> None:
        # the run's files (W&B writes its own config.yaml)
        folder = os.path.join(self.run.dir, "distribuuuu")
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


def metric_name(name: str) -> str:
    """name with MLflow's characters only (letters, digits, _-. :/):
    one name for a metric in every tracker and in trackers.json."""
    return re.sub(r"[^\w\-. :/]", "_", name)


def class_keys(classes: list[str]) -> list[str]:
    """Each class's part of its metric names (metric_name's characters;
    classes that would share one get their index too)."""
    keys = [metric_name(c).replace("/", "_") for c in classes]
    shared = Counter(keys)
    return [k if shared[k] == 1 else f"{k}_{i}" for i, k in enumerate(keys)]


def as_metrics(
    prefix: str, values: dict[str, Any], topk: int, classes: list[str] | None = None
) -> dict[str, float]:
    """The numbers of a record as <prefix>/<key> ("topk_acc" as
    top<k>, as in TensorBoard), a list (per_class_top1) as
    <prefix>/<key>/<class> (``classes``: class_keys; None: a class
    without samples, left out), a dict as <prefix>/<key>/<name>; its
    labels and sample count left out."""
    metrics: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}/top{topk}" if key == "topk_acc" else f"{prefix}/{key}"
        if isinstance(value, list):
            names = [str(i) for i in range(len(value))]
            if classes is not None and len(classes) == len(value):
                names = classes
            per_class = zip(names, value)
            metrics.update(
                {metric_name(f"{name}/{c}"): float(v) for c, v in per_class if _number(v)}
            )
        elif isinstance(value, dict):
            metrics.update(as_metrics(name, value, topk))
        elif key not in LABELS and _number(value):
            metrics[metric_name(name)] = float(value)
    return metrics


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _read_marks(path: str) -> dict[str, dict[str, int]]:
    """trackers.json ({} when there is none yet); a damaged one is said
    once and read as none."""
    try:
        with open(path) as f:
            marks = json.load(f)
        if not isinstance(marks, dict) or not all(isinstance(m, dict) for m in marks.values()):
            raise ValueError("not {run id: {metric: step}}")
        return marks
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # torn by a kill, edited, or unreadable
        log.warning(
            "TRAIN.TRACKERS: %s is damaged (%s): the steps each run holds are asked from its "
            "store (MLflow); W&B cannot be asked, and may get the steps after the checkpoint again",
            path,
            e,
        )
        return {}


def _refusal(tracker: str, error: Exception, seconds: float) -> str:
    """The line of a tracker that could not start: the server it did
    not reach and why, or the client's own reason."""
    where = CLIENTS[tracker].WHERE
    if unreachable(error):
        system = [e for e in signals.chain(error) if type(e).__module__ == "builtins"]
        why = str(system[-1] if system else error).strip().splitlines()[0]
        return (
            f"TRAIN.TRACKERS: {tracker} reached no server at {CLIENTS[tracker].uri()} in "
            f"{seconds:g} s ({why}; TRAIN.TRACKER_START_S says how long it is tried); {where}"
        )
    first = (str(error).strip().splitlines() or [""])[0]
    return f"TRAIN.TRACKERS: {tracker} could not start ({type(error).__name__}: {first}); {where}"


def _own_runs(saved: dict[str, Any], folder: str) -> tuple[dict[str, str], dict[str, str]]:
    """From a checkpoint's tracker state: (the run ids to continue, the
    ids of the runs that new ones here branch from)."""
    if "runs" not in saved:  # a checkpoint from before the folder was kept: this folder's
        return saved, {}
    if saved["folder"] == folder:
        return saved["runs"], {}
    if saved["runs"]:
        log.info(
            "TRAIN.TRACKERS: the checkpoint's tracker runs are those of %s, a run folder this one "
            "was copied from: new runs here, tagged parent_run",
            saved["folder"],
        )
    return {}, saved["runs"]


class Runs:
    """Rank 0's tracker runs of one run folder: started (``saved``: the
    checkpoint's tracker state, whose runs are reattached or branched
    from) together and fed together. Ends them at exit when the run did
    not get to ``finish``: killed after a stop signal, failed
    otherwise."""

    def __init__(self, cfg: CfgNode, saved: dict[str, Any], classes: list[str]) -> None:
        out_dir, self.topk, self.upload = cfg.OUT_DIR, cfg.TRAIN.TOPK, cfg.TRAIN.TRACKER_CHECKPOINTS
        self.out_dir, self.cfg_dest, self.classes = out_dir, cfg.CFG_DEST, class_keys(classes)
        self.marks_path = os.path.join(out_dir, MARKS)
        self.folder = os.path.realpath(out_dir)
        ids, parents = _own_runs(saved, self.folder)
        self.clients: dict[str, Any] = {}
        self._start_all(cfg, ids)
        atexit.register(self._at_exit)
        self.saved = {"folder": self.folder, "runs": self.ids}  # what every checkpoint keeps
        # kept for a dropped tracker too: a resume reattaches it
        self.marks = _read_marks(self.marks_path)
        self.logged: dict[str, dict[str, int]] = {}
        for name, client in self.clients.items():
            logged = self.marks.setdefault(client.run_id, {})
            for key, step in client.held.items():  # the store's own answer
                logged[key] = max(step, logged.get(key, -1))
            self.logged[name] = logged
        new = [name for name, client in self.clients.items() if client.created]
        self._each("log_params", config.flatten(cfg), only=new)  # once per run
        for name in set(new) & set(parents):
            parent = {"parent_run": parents[name], "parent_folder": saved["folder"]}
            self._each("set_tags", parent, only=[name])
        self.described = False  # the run record's files and tags: with the first points

    def _start_all(self, cfg: CfgNode, ids: dict[str, str]) -> None:
        """Each tracker's run; one that cannot start ends those started
        (failed; killed by a stop signal) and refuses the run."""
        name = os.path.basename(self.folder)
        for tracker in cfg.TRAIN.TRACKERS:
            client_class = CLIENTS[tracker]
            try:
                self.clients[tracker] = client_class(
                    self.out_dir, ids.get(tracker), name, cfg.TRAIN.TRACKER_START_S
                )
            except KeyboardInterrupt:  # a stop signal while it waited
                self.finish("killed")
                raise
            except Exception as e:  # noqa: BLE001 - whatever stops a client (a server unreachable, a bad URI)
                self.finish("failed")
                raise UserError(_refusal(tracker, e, cfg.TRAIN.TRACKER_START_S)) from None

    @property
    def ids(self) -> dict[str, str]:
        return {name: client.run_id for name, client in self.clients.items()}

    def _each(self, method: str, *args: Any, only: list[str] | None = None) -> None:
        """Call method on every client (or those named in only); one
        that fails, or whose local store is gone, is dropped with one
        line."""
        for name, client in list(self.clients.items()):
            if only is not None and name not in only:
                continue
            try:
                lost = client.lost()
                if lost is None:
                    getattr(client, method)(*args)
            except Exception as e:  # noqa: BLE001 - a tracker's failure must not end the training
                lost = f"it failed ({type(e).__name__}: {e})"
            if lost is not None:
                log.warning(
                    "TRAIN.TRACKERS: %s dropped: %s; training goes on without it (the run folder "
                    "keeps every record)",
                    name,
                    lost,
                )
                del self.clients[name]

    def _describe(self) -> None:
        """The run record (config.yaml, env.json: written once the
        trackers started) as files and tags, with the first points."""
        self.described = True
        with open(os.path.join(self.out_dir, records.ENV)) as f:
            env = json.load(f)
        paths = [os.path.join(self.out_dir, name) for name in (self.cfg_dest, records.ENV)]
        self._each("log_files", paths)
        self._each(
            "set_tags",
            {
                "git_commit": str((env.get("git") or {}).get("commit")),
                "torch": env["versions"]["torch"],
                "world_size": str(env["world_size"]),
                "launcher": env["launcher"],
            },
        )

    def log(self, prefix: str, values: dict[str, Any], step: int) -> None:
        """values (a record, or a print step's numbers) as metrics at
        step, but for each run the metrics whose step it holds already
        (a resumed job computes them again)."""
        if not self.described:
            self._describe()
        metrics = as_metrics(prefix, values, self.topk, self.classes)
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
            "best_checkpoint": os.path.join(self.out_dir, CHECKPOINTS, BEST),
            "last_checkpoint": os.path.join(self.out_dir, CHECKPOINTS, LAST),
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
        # a stop signal: after its checkpoint
        self.finish("killed" if signals.received else "failed")

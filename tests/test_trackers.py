"""TRAIN.TRACKERS: MLflow and W&B runs written by rank 0, one per job, continued across resumes.

Real clients, offline: MLflow's sqlite store in OUT_DIR is read with the mlflow client, W&B's offline
run folders (OUT_DIR/wandb/offline-run-*) from disk. Real processes and real signals: SIGTERM mid-epoch
(a preemption: a step checkpoint, then the same command again) and SIGKILL (no goodbye: the tracker
holds steps past the checkpoint, which the resumed job trains again and must not log twice).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections import Counter

import pytest
import torch

from tests.conftest import (
    ROOT,
    TINY,
    check,
    cli_main,
    env,
    free_port,
    kill_tree,
    logged,
    make_cfg,
    read_metrics,
    read_text_or_empty,
    start_until,
    stop_and_wait,
)

BOTH = ["TRAIN.TRACKERS", "['mlflow', 'wandb']"]
# 2048 samples / (2 ranks x 16) = 64 steps an epoch at 8 px: long enough for a signal to land mid-epoch
LONG = ["TRAIN.SYNTHETIC_SAMPLES", "2048", "TEST.SYNTHETIC_SAMPLES", "16", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8"]


def _train(out, *opts: str) -> list[str]:
    return [sys.executable, "-m", "distribuuuu", "train", "--cfg", TINY, "--nproc-per-node", "2", *BOTH, *LONG,
            "OUT_DIR", str(out), *opts]


def _checkpoint(out) -> dict:
    return torch.load(out / "checkpoints" / "last.pth", map_location="cpu", weights_only=True)


def _mlflow(out):
    """(client, the runs in OUT_DIR/mlflow.db)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    return client, client.search_runs([e.experiment_id for e in client.search_experiments()])


def _mlflow_steps(client, run) -> dict[str, list[int]]:
    return {key: [m.step for m in client.get_metric_history(run.info.run_id, key)] for key in run.data.metrics}


def _wandb_records(path: str):
    """The records of a W&B run file (run-<id>.wandb): a LevelDB-style log (32 KiB blocks, 7-byte headers:
    crc, length, type) of wandb_internal_pb2.Record messages after a 7-byte file header. A torn tail
    (a SIGKILL) ends the list."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:7]
    pos, block, part = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 or pos + 7 + length > len(data):
            break
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            part = b""
            yield record


def _wandb_jobs(out) -> list[dict]:
    """Each offline run folder (one per job, oldest first): its id, history steps per key, config keys, exit code."""
    folder = out / "wandb"
    jobs = []
    for name in sorted(n for n in os.listdir(folder) if n.startswith("offline-run-")):
        run_id = name.rsplit("-", 1)[1]
        job = {"folder": name, "id": run_id, "steps": {}, "config": set(), "exit": None}
        for record in _wandb_records(str(folder / name / f"run-{run_id}.wandb")):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                for key in items:
                    if not key.startswith("_"):
                        job["steps"].setdefault(key, []).append(items["_step"])
            elif kind == "config":
                job["config"] |= {i.key for i in record.config.update if not i.key.startswith("_")}
            elif kind == "exit":
                job["exit"] = record.exit.exit_code
        jobs.append(job)
    return jobs


def _assert_no_step_twice(steps_per_key: dict[str, list[int]]) -> None:
    twice = {k: [s for s, n in Counter(v).items() if n > 1] for k, v in steps_per_key.items()}
    assert not any(twice.values()), {k: v for k, v in twice.items() if v}


def _merged(jobs: list[dict]) -> dict[str, list[int]]:
    merged: dict[str, list[int]] = {}
    for job in jobs:
        for key, steps in job["steps"].items():
            merged.setdefault(key, []).extend(steps)
    return merged


@pytest.mark.e2e
def test_sigterm_mid_epoch_then_the_same_command_continues_one_run_in_each_tracker(tmp_path):
    """The Done-when: 2 processes, both trackers; SIGTERM in epoch 2 (a step checkpoint, exit 143, the runs
    marked killed), the same command again: one MLflow run in OUT_DIR's sqlite file with the config
    parameters, val top-1 for each epoch and per-step loss, the same id, finished, no step twice; W&B: one
    offline folder per job, both of the checkpoint's run id, the config in the first only. With
    TRAIN.TRACKER_CHECKPOINTS the finished run gets best.pth and last.pth as files too."""
    out = tmp_path / "run"
    argv = _train(out, "TRAIN.TRACKER_CHECKPOINTS", "True")
    stop_and_wait(*start_until(argv, out, logged("epoch 2/2 iter"), timeout=240), timeout=90)
    stopped = _checkpoint(out)
    assert stopped["epoch"] == 1 and stopped["samples_in_epoch"] > 0  # mid-epoch 2
    ids = stopped["hooks"]["trackers"]
    client, runs = _mlflow(out)
    assert [(r.info.run_id, r.info.status) for r in runs] == [(ids["mlflow"], "KILLED")]
    assert [j["exit"] for j in _wandb_jobs(out)] == [255]  # W&B: preempting, exit code 255
    assert {a.path for a in client.list_artifacts(ids["mlflow"])} == {"config.yaml", "env.json"}  # no upload

    check(subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240))
    log = (out / "log.txt").read_text()
    assert f"{stopped['samples_in_epoch']} samples into epoch 2, step {stopped['global_step']}" in log
    assert f"upload: wandb sync --id {ids['wandb']} {out}/wandb/offline-run-*-{ids['wandb']})" in log
    assert _checkpoint(out)["hooks"]["trackers"] == ids  # the resumed job reattached, and keeps the same ids

    client, runs = _mlflow(out)
    assert [(r.info.run_id, r.info.status) for r in runs] == [(ids["mlflow"], "FINISHED")]
    run = runs[0]
    assert run.data.params["TRAIN.BATCH_SIZE"] == "16" and run.data.params["TRAIN.TRACKERS"] == "['mlflow', 'wandb']"
    assert run.data.tags["launcher"] == "spawn" and run.data.tags["world_size"] == "2"
    assert run.data.tags["torch"] == torch.__version__
    assert run.data.tags["best_checkpoint"] == str(out / "checkpoints" / "best.pth")
    assert {a.path for a in client.list_artifacts(ids["mlflow"])} == {"config.yaml", "env.json", "best.pth",
                                                                      "last.pth"}
    steps = _mlflow_steps(client, run)
    _assert_no_step_twice(steps)
    val = [m for m in read_metrics(str(out)) if m["split"] == "val"]
    assert [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"], "val/top1")] == [
        (64, val[0]["top1"]), (128, val[1]["top1"])]  # one per epoch, at the global step
    assert steps["train_step/loss"][0] == 1 and max(steps["train_step/loss"]) == 128  # print steps (the first step too), both jobs

    jobs = _wandb_jobs(out)
    assert [j["id"] for j in jobs] == [ids["wandb"]] * 2 and [j["exit"] for j in jobs] == [255, 0]
    assert sorted(os.listdir(out / "wandb" / jobs[1]["folder"] / "files" / "distribuuuu")) == [
        "best.pth", "config.yaml", "env.json", "last.pth"]
    assert "TRAIN.BATCH_SIZE" in jobs[0]["config"] and not jobs[1]["config"]  # parameters once
    merged = _merged(jobs)
    _assert_no_step_twice(merged)
    assert merged["val/top1"] == [64, 128] and max(merged["train_step/loss"]) == 128


@pytest.mark.e2e
def test_after_a_sigkill_the_resumed_job_logs_no_step_twice(tmp_path):
    """SIGKILL after steps past a step checkpoint were logged: no status is set, and the resumed job
    trains those steps again. OUT_DIR/trackers.json says what each run holds: nothing is logged twice,
    the training goes on to the end, and the run ends finished."""
    out = tmp_path / "run"

    def past_checkpoint(o) -> bool:
        marks = json.loads(read_text_or_empty(o / "trackers.json") or "{}")
        last = max((s for m in marks.values() for s in m.values()), default=0)
        return (o / "checkpoints" / "step_00000020.pth").exists() and last > 20

    proc, job, _ = start_until(_train(out, "OPTIM.MAX_EPOCH", "1", "TRAIN.CKPT_PERIOD_STEPS", "20"), out, past_checkpoint,
                               timeout=240)
    kill_tree(proc, job)  # SIGKILL, every process of the job
    stopped = _checkpoint(out)
    marks = json.loads((out / "trackers.json").read_text())
    logged = max(marks[stopped["hooks"]["trackers"]["mlflow"]].values())
    assert stopped["global_step"] < logged, (stopped["global_step"], logged)  # steps the next job repeats

    check(subprocess.run(_train(out, "OPTIM.MAX_EPOCH", "1", "TRAIN.CKPT_PERIOD_STEPS", "20"), cwd=ROOT, env=env(),
                         capture_output=True, text=True, timeout=240))
    client, runs = _mlflow(out)
    assert [r.info.status for r in runs] == ["FINISHED"]
    steps = _mlflow_steps(client, runs[0])
    _assert_no_step_twice(steps)
    assert max(steps["train_step/loss"]) == 64 and steps["val/top1"] == [64]
    merged = _merged(_wandb_jobs(out))
    _assert_no_step_twice(merged)
    assert max(merged["train_step/loss"]) == 64


@pytest.mark.e2e
def test_a_missing_tracker_package_is_exit_2_with_one_line_naming_the_extra(tmp_path):
    """mlflow made unimportable (None in sys.modules, as for an uninstalled package): exit 2 before
    anything is built, one line naming the extra, no folder left."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['mlflow'] = None\n")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "distribuuuu", "train", "--cfg", TINY, "TRAIN.TRACKERS", "['mlflow']",
                           "OUT_DIR", str(out)], cwd=ROOT, env={**env(), "PYTHONPATH": f"{blocker}:{ROOT}"},
                          capture_output=True, text=True, timeout=240)
    check(proc, 2)
    assert proc.stderr.splitlines() == ["error: TRAIN.TRACKERS names mlflow, which is not installed here: "
                                        "pip install 'distribuuuu[mlflow]'"], proc.stderr
    assert not out.exists()


@pytest.mark.e2e
def test_an_unreachable_mlflow_server_is_exit_2_before_training(tmp_path):
    """MLFLOW_TRACKING_URI names a server nobody listens on: rank 0 cannot start the run, every rank
    hears it, exit 2 with the reason, before any training step."""
    out = tmp_path / "run"
    server = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run([sys.executable, "-m", "distribuuuu", "train", "--cfg", TINY, "--nproc-per-node", "2",
                           "TRAIN.TRACKERS", "['mlflow']", "OUT_DIR", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=240, env={**env(), "MLFLOW_TRACKING_URI": server,
                                                       "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})
    check(proc, 2)
    said = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]  # rank 0's line
    assert len(said) == 1, proc.stderr
    assert said[0].startswith("error: TRAIN.TRACKERS: mlflow could not start (MlflowException: "), said
    assert said[0].endswith("; MLFLOW_TRACKING_URI says where it writes (unset: OUT_DIR/mlflow.db)"), said
    assert "[train]" not in proc.stdout and not (out / "checkpoints").exists()


@pytest.mark.e2e
def test_an_error_mid_run_ends_the_runs_failed(tmp_path):
    """A crash (a user's hook raising after epoch 1): exit 1, and on the way out both runs are marked
    failed (W&B: exit code 1), after epoch 1's train record reached them."""
    (tmp_path / "boom.py").write_text(
        "from distribuuuu.engine import HookBase\n\n\nclass Boom(HookBase):\n"
        "    def after_epoch(self, trainer, metrics):\n        raise RuntimeError('boom')\n")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "distribuuuu", "train", "--cfg", TINY, *BOTH, "TRAIN.HOOKS",
                           "['boom:Boom']", "OUT_DIR", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, env={**env(), "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    check(proc, 1)
    assert "RuntimeError: boom" in proc.stderr
    client, runs = _mlflow(out)
    assert [r.info.status for r in runs] == ["FAILED"] and "train/loss" in runs[0].data.metrics
    assert [(j["exit"], "train/loss" in j["steps"]) for j in _wandb_jobs(out)] == [(1, True)]


@pytest.mark.slow
def test_a_tracker_failing_mid_run_is_dropped_with_one_line(tmp_path, caplog):
    """The MLflow run deleted from under the job (a user in the UI): the next log fails, one warning
    line, the tracker is dropped and nothing else fails; the run folder keeps the records."""
    from mlflow.tracking import MlflowClient

    from distribuuuu import trackers

    cfg = make_cfg({"OUT_DIR": str(tmp_path), "TRAIN.TRACKERS": ["mlflow"]})
    (tmp_path / "config.yaml").write_text(cfg.dump())
    (tmp_path / "env.json").write_text(json.dumps({"git": None, "versions": {"torch": torch.__version__},
                                                   "world_size": 1, "launcher": "plain"}))
    runs = trackers.Runs(cfg, {})
    run_id = runs.ids["mlflow"]
    runs.log("train", {"loss": 1.0, "split": "train"}, 1)
    MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").delete_run(run_id)
    with caplog.at_level("WARNING", logger="distribuuuu"):
        runs.log("train", {"loss": 0.5}, 2)
        runs.log("train", {"loss": 0.25}, 3)
        runs.finish("finished")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith("TRAIN.TRACKERS: mlflow failed ("), warnings
    assert runs.ids == {}


def test_tracker_names_are_checked_with_the_config():
    proc = cli_main("train", "--cfg", TINY, "TRAIN.TRACKERS", "['tensorboard']")
    check(proc, 2)
    assert proc.stderr.strip() == "error: TRAIN.TRACKERS may hold mlflow, wandb, got ['tensorboard']"


def test_the_config_names_the_trackers_that_exist():
    from distribuuuu import trackers
    from distribuuuu.config.validate import TRACKERS

    assert tuple(trackers.CLIENTS) == TRACKERS


def test_the_tracker_hook_comes_only_with_trackers_and_first():
    from distribuuuu.engine import hooks

    assert not any(isinstance(h, hooks.TrackerHook) for h in hooks.default_hooks(make_cfg({}), 1))
    named = hooks.default_hooks(make_cfg({"TRAIN.TRACKERS": ["wandb"]}), 1)
    assert isinstance(named[0], hooks.TrackerHook) and sum(isinstance(h, hooks.TrackerHook) for h in named) == 1


def test_records_become_metrics_named_by_split_and_key():
    """As in TensorBoard: <split>/<key>, top-k by its k; labels, the sample count and text are not metrics;
    nested numbers (per-class results) are named by their path."""
    from distribuuuu import trackers

    record = {"epoch": 2, "split": "val", "loss": 0.5, "top1": 90.0, "topk_acc": 99.0, "topk": 5, "n": 100,
              "weights": "best.pth", "final": True, "per_class": {"cat": 80.0, "dog": 100}}
    assert trackers.as_metrics("val", record, 5) == {"val/loss": 0.5, "val/top1": 90.0, "val/top5": 99.0,
                                                     "val/per_class/cat": 80.0, "val/per_class/dog": 100.0}

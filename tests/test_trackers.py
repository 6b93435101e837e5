"""TRAIN.TRACKERS: MLflow and W&B runs written by rank 0, one per run folder, continued across resumes.

Real clients: MLflow's sqlite store in OUT_DIR is read with the mlflow client, W&B's offline run folders
(OUT_DIR/wandb/offline-run-*) from disk, and a local `mlflow server` (one for the module, started and
stopped here) is the store a team shares, or, on a port nobody listens on, the server that is down. Real
processes and real signals: SIGTERM mid-epoch (a preemption: a step checkpoint, then the same command
again), SIGKILL (no goodbye: the tracker holds steps past the checkpoint, which the resumed job trains
again and must not log twice), SIGTERM while a tracker waits for its server.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from collections import Counter

import pytest
import torch

from tests.conftest import (
    ROOT,
    TINY,
    check,
    check_user_error,
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
    ids = stopped["hooks"]["trackers"]["runs"]
    client, runs = _mlflow(out)
    assert [(r.info.run_id, r.info.status) for r in runs] == [(ids["mlflow"], "KILLED")]
    assert [j["exit"] for j in _wandb_jobs(out)] == [255]  # W&B: preempting, exit code 255
    assert {a.path for a in client.list_artifacts(ids["mlflow"])} == {"config.yaml", "env.json"}  # no upload

    check(subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240))
    log = (out / "log.txt").read_text()
    assert f"{stopped['samples_in_epoch']} samples into epoch 2, step {stopped['global_step']}" in log
    assert f"upload: wandb sync --id {ids['wandb']} {out}/wandb/offline-run-*-{ids['wandb']})" in log
    assert _checkpoint(out)["hooks"]["trackers"]["runs"] == ids  # the resumed job reattached, and keeps the same ids

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
    logged = max(marks[stopped["hooks"]["trackers"]["runs"]["mlflow"]].values())
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


def _unreachable_uri() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nobody listens there


@pytest.mark.e2e
def test_an_unreachable_mlflow_server_is_exit_2_in_seconds_and_leaves_no_folder(tmp_path):
    """MLFLOW_TRACKING_URI names a server nobody listens on, 2 processes, the default
    TRAIN.TRACKER_START_S (10 s): a line says what is tried (the uri, for how long); MLflow's own
    retries are off and ours stop at 10 s; exit 2 with one line naming the uri and the reason; no
    run folder left (the trackers start before the run record is written). Before: 259 s with no
    line, then exit 2, and the new folder left."""
    out = tmp_path / "run"
    uri = _unreachable_uri()
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "distribuuuu", "train", "--cfg", TINY, "--nproc-per-node", "2",
                           "TRAIN.TRACKERS", "['mlflow']", "OUT_DIR", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=240, env={**env(), "MLFLOW_TRACKING_URI": uri})
    took = time.monotonic() - start
    check(proc, 2)
    assert f"MLflow: starting a run at {uri} (a server that refuses or does not answer is tried again for 10 s, " \
           "TRAIN.TRACKER_START_S)" in proc.stdout, proc.stdout[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert said == [f"error: TRAIN.TRACKERS: mlflow reached no server at {uri} in 10 s ([Errno 111] Connection "
                    "refused; TRAIN.TRACKER_START_S says how long it is tried); MLFLOW_TRACKING_URI says where it "
                    "writes (unset: OUT_DIR/mlflow.db)"], proc.stderr  # one line: both ranks say the same
    assert "Traceback" not in proc.stderr and "[train]" not in proc.stdout and not out.exists()
    assert took < 60, took  # measured 25.7 s on 2 loaded cores: process start, 10 s of tries, the way out


@pytest.mark.e2e
def test_sigterm_while_a_tracker_waits_for_its_server_stops_every_rank_at_once(tmp_path):
    """2 processes, a server nobody answers, TRAIN.TRACKER_START_S 120: SIGTERM to the spawner while
    rank 0 tries. Every rank ends with its stop line, 143, no traceback, none needed the spawner's
    SIGKILL, nothing left running, nothing but log.txt written. Before: the signal was not acted on
    while MLflow retried, the spawner SIGKILLed both ranks after 30 s and rank 1 printed gloo's
    traceback."""
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "distribuuuu", "train", "--cfg", TINY, "--nproc-per-node", "2", "TRAIN.TRACKERS",
            "['mlflow']", "TRAIN.TRACKER_START_S", "120", "OUT_DIR", str(out)]
    trying = lambda o: "MLflow: starting a run at" in read_text_or_empty(o.parent / f"{o.name}.console.txt")  # noqa: E731
    os.environ["MLFLOW_TRACKING_URI"] = _unreachable_uri()  # for env() in start_until; put back after the test
    proc, job, console = start_until(argv, out, trying, timeout=180)
    start = time.monotonic()
    stop_and_wait(proc, job, console, timeout=60)
    took = time.monotonic() - start
    text = console.read_text()
    assert took < 20 and "ended with status" not in text and "Traceback" not in text, (took, text[-3000:])
    lines = text.splitlines()
    assert {"stopped by SIGTERM", "stopped by SIGTERM (rank 1)",
            "[spawn] stopped by SIGTERM; all processes stopped"} <= set(lines), text[-3000:]
    assert sorted(os.listdir(out)) == ["log.txt"]  # its stop line: no record, no checkpoint, no lock


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A local MLflow server (`mlflow server`, its own sqlite store), one for the module: the store a
    team shares. Stopped, with its workers, at the end."""
    folder = tmp_path_factory.mktemp("mlflow_server")
    uri = f"http://127.0.0.1:{free_port()}"
    with open(folder / "server.log", "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                                   f"sqlite:///{folder}/store.db", "--default-artifact-root",
                                   (folder / "artifacts").as_uri(), "--host", "127.0.0.1", "--port",
                                   uri.rsplit(":", 1)[1], "--workers", "1"], cwd=folder, stdout=log,
                                  env={**env(), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _answers(f"{uri}/health"):
            assert server.poll() is None and time.monotonic() < deadline, (folder / "server.log").read_text()
            time.sleep(0.2)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


@pytest.mark.e2e
def test_a_copied_run_folder_on_a_shared_store_continues_as_a_new_run_tagged_with_its_parent(tmp_path,
                                                                                           mlflow_server):
    """The Done-when: tA trains epoch 1 into a team's MLflow server; `cp -a tA tB`; both go on to
    epoch 2. Two runs: tA's continued (both epochs), tB's new, tagged parent_run (tA's id) and
    parent_folder, with every parameter and its own points only (epoch 2); no (key, step) twice in
    either. Per-class top-1 reaches both, per class name. Before: both folders reattached to the same
    run: val/top1 at step 16 held two values, 39 duplicate points, no warning."""
    from mlflow.tracking import MlflowClient

    from distribuuuu import config

    tiny = ["TRAIN.SYNTHETIC_SAMPLES", "64", "TEST.SYNTHETIC_SAMPLES", "16", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8"]
    e = {**env(), "MLFLOW_TRACKING_URI": mlflow_server, "MLFLOW_EXPERIMENT_NAME": "copied"}

    def train(out, epochs: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "distribuuuu", "train", "--cfg", TINY, "TRAIN.TRACKERS",
                                 "['mlflow']", "OPTIM.LR_POLICY", "constant", *tiny, "OPTIM.MAX_EPOCH", epochs,
                                 "OUT_DIR", str(out)], cwd=ROOT, env=e, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def finished(*procs: subprocess.Popen) -> None:
        for proc in procs:
            out, _ = proc.communicate(timeout=240)
            assert proc.returncode == 0, out[-3000:]

    a, b = tmp_path / "tA", tmp_path / "tB"
    finished(train(a, "1"))
    check(subprocess.run(["cp", "-a", str(a), str(b)], capture_output=True, text=True))
    finished(train(a, "2"), train(b, "2"))  # both go on, at the same time
    kept = {out: _checkpoint(out)["hooks"]["trackers"] for out in (a, b)}
    assert kept[a]["folder"] == str(a.resolve()) and kept[b]["folder"] == str(b.resolve())
    parent, child = kept[a]["runs"]["mlflow"], kept[b]["runs"]["mlflow"]
    client = MlflowClient(mlflow_server)
    runs = {r.info.run_id: r for r in client.search_runs([client.get_experiment_by_name("copied").experiment_id])}
    assert sorted(runs) == sorted([parent, child]) and parent != child
    assert "parent_run" not in runs[parent].data.tags
    assert (runs[child].data.tags["parent_run"], runs[child].data.tags["parent_folder"]) == (parent, str(a.resolve()))
    assert len(runs[child].data.params) == len(config.flatten(make_cfg(base=TINY))) > 100  # a new run: all of them
    steps = {run_id: _mlflow_steps(client, run) for run_id, run in runs.items()}
    for held in steps.values():
        _assert_no_step_twice(held)
    assert (steps[parent]["val/top1"], steps[child]["val/top1"]) == ([4, 8], [8])  # 4 steps an epoch
    assert steps[child]["val/per_class_top1/3"] == [8] and len([k for k in steps[parent] if "per_class" in k]) == 4
    assert min(steps[child]["train_step/loss"]) > 4  # only what the copy trained after its checkpoint


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

    runs = trackers.Runs(_cfg_with_record(tmp_path, ["mlflow"]), {}, ["a", "b", "c", "d"])
    run_id = runs.ids["mlflow"]
    runs.log("train", {"loss": 1.0, "split": "train"}, 1)
    MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").delete_run(run_id)
    with caplog.at_level("WARNING", logger="distribuuuu"):
        runs.log("train", {"loss": 0.5}, 2)
        runs.log("train", {"loss": 0.25}, 3)
        runs.finish("finished")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith("TRAIN.TRACKERS: mlflow dropped: it failed ("), warnings
    assert runs.ids == {}


def _cfg_with_record(out, trackers: list[str]):
    """A config and the run record (config.yaml, env.json) a tracker's first points take along."""
    cfg = make_cfg({"OUT_DIR": str(out), "TRAIN.TRACKERS": trackers})
    (out / "config.yaml").write_text(cfg.dump())
    (out / "env.json").write_text(json.dumps({"git": None, "versions": {"torch": torch.__version__},
                                              "world_size": 1, "launcher": "plain"}))
    return cfg


@pytest.mark.slow
def test_mlflow_is_asked_what_it_holds_and_a_new_run_gets_every_parameter(tmp_path, caplog):
    """In process, MLflow's sqlite store: a job logs steps 1-2 and is killed; trackers.json is torn
    (said once: a bad file read as "no marks" before, and 10 points went in twice); the resumed job
    asks MLflow, logs step 2 again, and only step 3 goes in. Then mlflow.db is deleted: the
    checkpoint's run is not there, the new run gets every parameter (before: 0 of 110). Then
    mlflow.db is removed mid-run: one warning, MLflow dropped."""
    from mlflow.tracking import MlflowClient

    from distribuuuu import config, trackers

    cfg, classes = _cfg_with_record(tmp_path, ["mlflow"]), ["a", "b", "c", "d"]
    runs = trackers.Runs(cfg, {}, classes)
    saved = runs.saved
    runs.log("train", {"loss": 1.0}, 1)
    runs.log("train", {"loss": 0.5}, 2)
    runs.finish("killed")
    (tmp_path / "trackers.json").write_text('{"torn')
    with caplog.at_level("WARNING", logger="distribuuuu"):
        runs = trackers.Runs(cfg, saved, classes)
        runs.log("train", {"loss": 0.7}, 2)
        runs.log("train", {"loss": 0.25}, 3)
        runs.finish("finished")
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and said[0].startswith(f"TRAIN.TRACKERS: {tmp_path}/trackers.json is damaged ("), said
    store = f"sqlite:///{tmp_path}/mlflow.db"
    history = MlflowClient(store).get_metric_history(saved["runs"]["mlflow"], "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 0.5), (3, 0.25)]

    # mlflow.db deleted: a fresh store (another folder here: this process keeps MLflow's engine of
    # the first file), the checkpoint's run not in it
    out = tmp_path / "deleted"
    out.mkdir()
    cfg = _cfg_with_record(out, ["mlflow"])
    caplog.clear()
    with caplog.at_level("WARNING", logger="distribuuuu"):
        runs = trackers.Runs(cfg, {**saved, "folder": str(out.resolve())}, classes)
        new = runs.ids["mlflow"]
        assert new != saved["runs"]["mlflow"]
        assert len(MlflowClient(f"sqlite:///{out}/mlflow.db").get_run(new).data.params) == len(config.flatten(cfg))
        runs.log("train", {"loss": 0.1}, 4)
        os.remove(out / "mlflow.db")
        runs.log("train", {"loss": 0.05}, 5)
        runs.log("train", {"loss": 0.01}, 6)
        runs.finish("finished")
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 2 and "is not in" in said[0], said
    assert said[1].startswith(f"TRAIN.TRACKERS: mlflow dropped: its store {out}/mlflow.db was removed"), said
    assert not (out / "mlflow.db").exists()  # not made again, empty


@pytest.mark.e2e
def test_a_wandb_folder_removed_mid_run_is_one_warning_and_marks_nothing_after(tmp_path):
    """OUT_DIR/wandb removed after epoch 1 (a user's hook, as a user's rm -r): one warning, W&B dropped,
    MLflow and the training go on to the end, exit 0; trackers.json marks nothing past epoch 1 for
    W&B. Before: exit 0, no line, every W&B point gone, and trackers.json marked them all logged."""
    (tmp_path / "rm_wandb.py").write_text(
        "import os\nimport shutil\n\nfrom distribuuuu.engine import HookBase\n\n\nclass RemoveWandb(HookBase):\n"
        "    def after_epoch(self, trainer, metrics):\n        if trainer.state.epoch == 1:\n"
        "            shutil.rmtree(os.path.join(trainer.cfg.OUT_DIR, 'wandb'))\n")
    out = tmp_path / "run"
    proc = check(subprocess.run([sys.executable, "-m", "distribuuuu", "train", "--cfg", TINY, *BOTH, "TRAIN.HOOKS",
                                 "['rm_wandb:RemoveWandb']", "OUT_DIR", str(out)], cwd=ROOT, capture_output=True,
                                text=True, timeout=240, env={**env(), "PYTHONPATH": f"{tmp_path}:{ROOT}"}))
    log = (out / "log.txt").read_text()
    dropped = [line for line in log.splitlines() if "TRAIN.TRACKERS: wandb dropped" in line]
    assert len(dropped) == 1 and "its folder" in dropped[0] and "was removed" in dropped[0], log[-3000:]
    ids = _checkpoint(out)["hooks"]["trackers"]["runs"]
    marks = json.loads((out / "trackers.json").read_text())
    assert max(marks[ids["wandb"]].values()) == 8 and max(marks[ids["mlflow"]].values()) == 16, marks
    assert "Traceback" not in proc.stderr


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
    per_class_top1, a list in the records (engine/evaluation.py), per class name (a class without samples,
    None, left out); names keep MLflow's characters, and two classes that would share one get their
    index. Before: only dicts were flattened, and no record holds one."""
    from distribuuuu import trackers

    record = {"epoch": 2, "split": "val", "loss": 0.5, "top1": 90.0, "topk_acc": 99.0, "topk": 5, "n": 100,
              "weights": "best.pth", "final": True, "per_class_top1": [80.0, 100, None, 50.0, 25.0]}
    classes = trackers.class_keys(["cat", "dog", "n", "a+b", "a_b"])
    assert classes == ["cat", "dog", "n", "a_b_3", "a_b_4"]
    assert trackers.as_metrics("val", record, 5, classes) == {
        "val/loss": 0.5, "val/top1": 90.0, "val/top5": 99.0, "val/per_class_top1/cat": 80.0,
        "val/per_class_top1/dog": 100.0, "val/per_class_top1/a_b_3": 50.0, "val/per_class_top1/a_b_4": 25.0}


def test_a_tracker_named_twice_or_an_unusable_start_time_is_refused():
    """Before: two MLflow runs, the first RUNNING forever. The start time is positive and within the
    time the other ranks wait in a collective."""
    proc = cli_main("train", "--cfg", TINY, "TRAIN.TRACKERS", "['mlflow', 'mlflow']")
    check_user_error(proc, "TRAIN.TRACKERS names a tracker twice, got ['mlflow', 'mlflow']")
    check_user_error(cli_main("train", "--cfg", TINY, "TRAIN.TRACKER_START_S", "0"), "must be positive")
    check_user_error(cli_main("train", "--cfg", TINY, "TRAIN.TRACKER_START_S", "4000"),
                     "TRAIN.TRACKER_START_S 4000.0 must be below DIST.TIMEOUT_S 1800")


def test_the_config_allows_exactly_the_trackers_there_are():
    """TRAIN.TRACKERS' choices (config/validate.py, below trackers.py in the layers) are
    trackers.CLIENTS' names."""
    from distribuuuu import trackers
    from distribuuuu.config.validate import TRACKERS

    assert set(TRACKERS) == set(trackers.CLIENTS)

"""The run folder (OUT_DIR): one run per folder, nothing of an earlier run lost, and a refusal that leaves it
as it was (docs/reliability.md).

The lock names the run that holds the folder and is taken over from a run that is gone; checkpoints
keep the last k, best.pth and last.pth, and a damaged, failed, killed or stopped write leaves the
previous one; records (metrics, TensorBoard, config.yaml, env.json) are written whole, each step and
epoch once, and a run without a checkpoint is moved aside, never overwritten; the folder's mistakes
(a file, no permission) end with exit 2 and one line before any training step. Real processes, a
real SIGKILL in a real checkpoint write, real permissions.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import yaml

from distribuuuu import config
from distribuuuu.errors import UserError
from distribuuuu.run_folder import RunFolder
from distribuuuu.run_folder import lock as run_lock
from distribuuuu.weights import load_checkpoint
from tests.conftest import (
    ROOT,
    TINY,
    check,
    check_user_error,
    distribuuuu,
    env,
    make_cfg,
    read_metrics,
)

KILL_IN_SAVE = os.path.join(ROOT, "tests", "scripts", "kill_in_save.py")
AS_NOBODY = os.path.join(ROOT, "tests", "scripts", "as_nobody.py")
FAULT_RUN = os.path.join(ROOT, "tests", "scripts", "fault_run.py")
SHORT = ["--cfg", TINY, "TRAIN.PRINT_FREQ", "1000"]  # 2 epochs of 8 steps, seconds
# One epoch of 4 steps at 8 px: for the tests that only need a finished or refused run
TINY_RUN = ["--cfg", TINY, "OPTIM.MAX_EPOCH", "1", "TRAIN.SYNTHETIC_SAMPLES", "64", "TEST.SYNTHETIC_SAMPLES", "16",
            "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8"]


def _train(cwd, *args, extra_env=None, script=None, timeout=120, preexec_fn=None):
    """`python -m distribuuuu train ...` (or `python SCRIPT ...`) from cwd, outside the repo."""
    e = env()
    e.update(extra_env or {})
    cmd = [sys.executable, script] if script else [sys.executable, "-m", "distribuuuu", "train"]
    return subprocess.run(cmd + list(args), cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=preexec_fn)


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _hashes(folder) -> dict[str, str]:
    """Every file under folder: relative path -> sha256 (what a refusal must leave as it was)."""
    return {str(p.relative_to(folder)): _sha(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def _debris(out):
    return sorted(n for n in os.listdir(os.path.join(out, "checkpoints")) if ".tmp." in n)


# ---------------------------------------------------------------------------------------------
# One run per folder: the lock
# ---------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_second_train_into_a_running_folder_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "distribuuuu", "train", *SHORT, "OUT_DIR", str(out),
                              "OPTIM.MAX_EPOCH", "400"], cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / "run.lock").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (out / "run.lock").exists(), "the first run never took the lock"
        lock = json.loads((out / "run.lock").read_text())
        assert (lock["pid"], lock["host"]) == (first.pid, socket.gethostname())
        config_before = (out / "config.yaml").read_bytes() if (out / "config.yaml").exists() else None
        second = _train(tmp_path, *SHORT, "OUT_DIR", str(out), "OPTIM.BASE_LR", "0.5")
        check_user_error(second, f"OUT_DIR {out} is in use by another training run", f"pid {first.pid}",
                         socket.gethostname(), "OPTIM.MAX_EPOCH 400", f"kill {first.pid}")
        assert first.poll() is None, "the first run stopped"
        if config_before is not None:
            assert (out / "config.yaml").read_bytes() == config_before
        first.send_signal(signal.SIGTERM)  # preemption: a checkpoint, then exit 143
        output, _ = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert not (out / "run.lock").exists()  # released when the run ended
    assert "BASE_LR: 0.5" not in (out / "config.yaml").read_text()
    epochs = [m["epoch"] for m in read_metrics(out) if m["split"] == "train"]
    assert epochs == list(range(1, len(epochs) + 1))  # one writer: no record twice
    ckpt = torch.load(out / "checkpoints" / "last.pth", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == len(epochs)


@pytest.mark.e2e
def test_foreign_host_lock_is_refused_with_the_delete_hint(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    lock = {"host": "node-that-is-not-here", "pid": 4242, "pid_start": 777, "started": "2026-01-02 03:04:05 UTC",
            "command": "python train_net.py --cfg big.yaml", "boot_id": "x", "job": "", "attempt": 0}
    (out / "run.lock").write_text(json.dumps(lock))
    proc = _train(tmp_path, "--nproc-per-node", "2", *SHORT, "OUT_DIR", str(out))
    check_user_error(proc, "another host", "pid 4242 on host node-that-is-not-here", "2026-01-02 03:04:05",
                     f"delete {out / 'run.lock'}")
    assert json.loads((out / "run.lock").read_text()) == lock  # untouched
    assert not (out / "metrics.jsonl").exists()
    os.remove(out / "run.lock")  # what the message says to do
    check(_train(tmp_path, *SHORT, "OUT_DIR", str(out), "OPTIM.MAX_EPOCH", "1"))


@pytest.mark.e2e
def test_foreign_lock_on_a_two_node_job_ends_every_rank_without_a_hang(tmp_path):
    """Two torchrun groups (--nnodes 2, one process each) on this host: no rank can check another
    host's lock before the process group, so rank 0 decides after it and every rank exits 2."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.lock").write_text(json.dumps({"host": "elsewhere", "pid": 99, "pid_start": 1,
                                              "started": "yesterday", "command": "train"}))
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1",
         "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "distribuuuu", "train", *SHORT,
         "OUT_DIR", str(out), "DIST.TIMEOUT_S", "120"],
        cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in range(2)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=90))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, (stdout, stderr) in zip(procs, outputs):
        assert proc.returncode != 0, stdout + stderr
        assert "locked by a training run on another host: pid 99 on host elsewhere" in stderr, stderr[-3000:]
    # Rank 1 skipped the check before the process group (it cannot see another host's processes):
    # its message is rank 0's decision, received over the group.
    assert "error (rank 1): OUT_DIR" in outputs[1][1], outputs[1][1][-3000:]
    assert (out / "run.lock").exists() and not (out / "metrics.jsonl").exists()


def test_lock_of_a_live_process_holds_and_a_reused_pid_does_not(tmp_path):
    """In-process, against a real live process: alive -> refused; the same pid with another start
    time (a reused pid) -> taken over; our own lock is removed on release, another's is not."""
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        me = run_lock.this_process()
        live = run_lock.Holder(me.host, sleeper.pid, run_lock.process_start(sleeper.pid), "now", "sleep 60",
                                 me.boot_id)
        (tmp_path / "run.lock").write_text(json.dumps(live.__dict__))
        with pytest.raises(UserError, match=f"in use by another training run: pid {sleeper.pid}"):
            run_lock.acquire(str(tmp_path), me)
        reused = run_lock.Holder(**{**live.__dict__, "pid_start": live.pid_start - 1})
        (tmp_path / "run.lock").write_text(json.dumps(reused.__dict__))
        notes = run_lock.acquire(str(tmp_path), me)
        assert len(notes) == 1 and f"pid {sleeper.pid}" in notes[0]
        assert run_lock.read_lock(str(tmp_path)) == me
        run_lock.release(str(tmp_path), live)  # not the holder: nothing happens
        assert run_lock.read_lock(str(tmp_path)) == me
        run_lock.release(str(tmp_path), me)
        assert not (tmp_path / "run.lock").exists()
    finally:
        sleeper.kill()
        sleeper.wait()


# ---------------------------------------------------------------------------------------------
# Checkpoint files: the last k, best.pth and last.pth; a damaged, failed or stopped write leaves the last good one
# ---------------------------------------------------------------------------------------------
def _state(epoch):
    return {"model": {"w": torch.full((2,), float(epoch))}, "epoch": epoch}


def _folder(out, keep=3):
    """The run folder out, as a run with TRAIN.CKPT_KEEP keep sees it."""
    return RunFolder(make_cfg({"OUT_DIR": out, "TRAIN.CKPT_KEEP": keep}))


def test_checkpoints_keep_k_and_last_best(tmp_path):
    out = str(tmp_path)
    for epoch in range(1, 6):
        _folder(out, keep=2).save(_state(epoch), is_best=(epoch == 2))
    names = sorted(os.listdir(os.path.join(out, "checkpoints")))
    assert names == ["best.pth", "epoch_0004.pth", "epoch_0005.pth", "last.pth"]
    assert load_checkpoint(os.path.join(out, "checkpoints", "best.pth"))["epoch"] == 2
    ckpt, path = _folder(out).latest()
    assert ckpt["epoch"] == 5 and path.endswith("last.pth")


def test_a_corrupt_last_checkpoint_falls_back_to_an_older_one(tmp_path, caplog):
    out = str(tmp_path)
    for epoch in (1, 2):
        _folder(out).save(_state(epoch), is_best=False)
    last = os.path.join(out, "checkpoints", "last.pth")
    os.remove(last)
    with open(last, "wb") as f:
        f.write(b"not a checkpoint")
    with open(os.path.join(out, "checkpoints", "epoch_0002.pth"), "r+b") as f:
        f.truncate(20)
    ckpt, path = _folder(out).latest()
    assert ckpt["epoch"] == 1 and path.endswith("epoch_0001.pth")
    assert "skipping unreadable checkpoint" in caplog.text


def test_a_failed_write_leaves_the_previous_checkpoint_and_no_temporary_file(tmp_path):
    out = str(tmp_path)
    _folder(out).save(_state(1), is_best=False)

    class Exploding:
        def __reduce__(self):
            raise OSError("disk full")

    with pytest.raises(OSError):
        _folder(out).save({"model": {}, "epoch": 2, "boom": Exploding()}, is_best=False)
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["epoch_0001.pth", "last.pth"]
    assert _folder(out).latest()[0]["epoch"] == 1


@pytest.mark.parametrize("stop", [KeyboardInterrupt, "Terminated"])
def test_a_stop_signal_mid_write_is_a_stop_not_a_write_error(tmp_path, monkeypatch, stop):
    """Ctrl-C / SIGTERM raised inside torch.save's writes: torch's zip writer then fails closing
    ("unexpected pos"), which was reported as a failed checkpoint write (a traceback, in CI). The
    stop must come out, the previous checkpoint stay, and no temporary file be left."""
    from distribuuuu.launch.signals import Terminated

    stop = Terminated if stop == "Terminated" else stop
    out = str(tmp_path)
    _folder(out).save(_state(1), is_best=False)
    real_save = torch.save

    class Interrupting:  # a file whose writes are cut by the signal after 3 KB
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            self.written += len(data)
            if self.written > 3000:
                raise stop()
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    monkeypatch.setattr(torch, "save", lambda obj, f: real_save(obj, Interrupting(f)))
    big = {**_state(2), "model": {"w": torch.zeros(10_000)}}
    with pytest.raises(stop):
        _folder(out).save(big, is_best=False)
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["epoch_0001.pth", "last.pth"]
    assert _folder(out).latest()[0]["epoch"] == 1


# ---------------------------------------------------------------------------------------------
# A killed save leaves nothing behind; a killed run's lock is taken over
# ---------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_killed_save_debris_and_stale_lock_are_cleared_and_training_resumes(tmp_path):
    out = tmp_path / "run"
    killed = _train(tmp_path, *SHORT, "OUT_DIR", str(out), script=KILL_IN_SAVE, extra_env={"KILL_IN_SAVE": "2"})
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-2000:]
    lock = json.loads((out / "run.lock").read_text())  # left behind by the killed run
    debris = _debris(out)
    assert debris == [f"epoch_0002.pth.tmp.{lock['pid']}"]
    size = os.path.getsize(out / "checkpoints" / debris[0])
    assert size > 100_000
    again = check(_train(tmp_path, *SHORT, "OUT_DIR", str(out)))
    assert f"took over {out}/run.lock, left by a run that is no longer running: pid {lock['pid']} on host " \
        f"{socket.gethostname()}" in again.stdout
    assert f"removed 1 temporary file left by a killed write ({size / 1e6:.1f} MB): checkpoints/{debris[0]}" \
        in again.stdout
    assert "resumed from" in again.stdout and "2 epochs done" not in again.stdout
    assert _debris(out) == [] and not (out / "run.lock").exists()
    assert torch.load(out / "checkpoints" / "last.pth", map_location="cpu", weights_only=True)["epoch"] == 2


@pytest.mark.e2e
def test_killed_link_of_last_pth_is_cleared_and_training_resumes(tmp_path):
    out = tmp_path / "run"
    killed = _train(tmp_path, *SHORT, "OUT_DIR", str(out), script=KILL_IN_SAVE, extra_env={"KILL_IN_LINK": "1"})
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-2000:]
    pid = json.loads((out / "run.lock").read_text())["pid"]
    assert _debris(out) == [f"last.pth.tmp.{pid}"]
    again = check(_train(tmp_path, *SHORT, "OUT_DIR", str(out)))
    assert f"checkpoints/last.pth.tmp.{pid}" in again.stdout
    assert f"resumed from {out}/checkpoints/epoch_0001.pth" in again.stdout  # last.pth was never made
    assert _debris(out) == [] and not (out / "run.lock").exists()


# ---------------------------------------------------------------------------------------------
# Nothing of an earlier run lost: records written whole, each step and epoch once, moved aside, never replaced
# ---------------------------------------------------------------------------------------------
def test_a_record_write_that_fails_half_way_leaves_every_record_file_as_it_was(tmp_path):
    """config.yaml, config_diff.yaml, env.json, env_history.jsonl and model.txt are each replaced
    through a temporary file (or get a whole line): a write that fails half-way (here at the
    file-size limit, EFBIG after 64 bytes, as a full disk or a kill would) leaves the old files whole,
    never an empty or half one. Before, config.yaml was written in place: a reader saw it empty
    (b''), and this write left 64 bytes of it."""
    cfg = make_cfg({"OUT_DIR": str(tmp_path), "MODEL.ARCH": "resnet50"})
    folder = RunFolder(cfg)
    prepared = {"env": {"start_time": "then"}, "model": "a model table\n" * 50}
    folder.write_record(prepared, seed=1)
    assert config.load_config(str(tmp_path / "config.yaml")) == cfg  # loads back to the same config
    diff = yaml.safe_load((tmp_path / "config_diff.yaml").read_text())
    assert (diff["MODEL"]["ARCH"], diff["OUT_DIR"]) == ("resnet50", str(tmp_path))  # nested as config.yaml
    names = ["config.yaml", "config_diff.yaml", "env.json", "env_history.jsonl", "model.txt"]
    before = {name: (tmp_path / name).read_bytes() for name in names}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))  # Python ignores SIGXFSZ: a write beyond fails
    try:
        with pytest.raises(OSError, match="File too large"):
            folder.write_record({**prepared, "model": "another table\n" * 50}, seed=2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert {name: (tmp_path / name).read_bytes() for name in names} == before
    assert [n for n in os.listdir(tmp_path) if ".tmp." in n] == []  # no temporary left either


@pytest.mark.e2e
def test_auto_resume_false_into_a_finished_run_exits_2_and_keeps_it(tmp_path):
    out = tmp_path / "run"
    check(_train(tmp_path, *SHORT, "OUT_DIR", str(out), "OPTIM.MAX_EPOCH", "1"))
    before = {n: _sha(out / "checkpoints" / n) for n in os.listdir(out / "checkpoints")}
    metrics = (out / "metrics.jsonl").read_bytes()
    proc = _train(tmp_path, *SHORT, "OUT_DIR", str(out), "TRAIN.AUTO_RESUME", "False")
    check_user_error(proc, f"OUT_DIR {out} already holds a run (last.pth at epoch 1 (step 8), best.pth, 1 epoch_*.pth, "
                     "2 metrics records)", "use TRAIN.AUTO_RESUME True", "give another OUT_DIR")
    assert {n: _sha(out / "checkpoints" / n) for n in os.listdir(out / "checkpoints")} == before
    assert (out / "metrics.jsonl").read_bytes() == metrics


@pytest.mark.e2e
def test_records_of_a_run_killed_before_its_first_checkpoint_are_moved_aside(tmp_path):
    out = tmp_path / "run"
    killed = _train(tmp_path, *SHORT, "OUT_DIR", str(out), script=KILL_IN_SAVE, extra_env={"KILL_IN_SAVE": "1"})
    assert killed.returncode == -signal.SIGKILL
    old = (out / "metrics.jsonl").read_text()
    assert [json.loads(x)["epoch"] for x in old.splitlines()] == [1, 1]  # train and val, no checkpoint
    again = check(_train(tmp_path, *SHORT, "OUT_DIR", str(out)))
    assert "held 2 metrics records of an earlier run that left no checkpoint" in again.stdout
    assert "metrics.jsonl -> metrics.jsonl.1, metrics.csv -> metrics.csv.1" in again.stdout
    assert (out / "metrics.jsonl.1").read_text() == old
    assert [(m["epoch"], m["split"]) for m in read_metrics(out)] == [(1, "train"), (1, "val"), (2, "train"),
                                                                     (2, "val")]
    assert _debris(out) == []


# 128 samples / 16 = 8 steps an epoch, a TensorBoard step line at each, a step checkpoint every 4 steps
RECORDED = [*TINY_RUN, "OPTIM.MAX_EPOCH", "2", "TRAIN.SYNTHETIC_SAMPLES", "128", "TRAIN.PRINT_FREQ", "1",
            "TRAIN.CKPT_PERIOD_STEPS", "4"]


def _scalars(tb) -> dict[str, list[int]]:
    """Every scalar tag of the run's TensorBoard folder -> its steps, as TensorBoard shows them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.e2e
def test_after_kill_9_mid_epoch_each_step_and_epoch_is_recorded_once(tmp_path):
    """kill -9 after step 15 (mid epoch 2, the step checkpoint of step 12 on disk), then the same
    command: TensorBoard (read by EventAccumulator) and metrics.jsonl hold each step / epoch once.
    Before: the steps after 12 that reached the events file before the kill appeared twice."""
    out = tmp_path / "run"
    killed = _train(tmp_path, *RECORDED, "OUT_DIR", str(out), script=FAULT_RUN, extra_env={"SIGNAL_AT": "15:0:SIGKILL"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (out / "checkpoints" / "step_00000012.pth").is_file(), os.listdir(out / "checkpoints")
    assert _scalars(out / "tb")["train_step/loss"][-1] > 12  # steps the re-run writes again
    check(_train(tmp_path, *RECORDED, "OUT_DIR", str(out), script=FAULT_RUN))
    scalars = _scalars(out / "tb")
    assert scalars["train_step/loss"] == list(range(1, 17)), scalars
    assert scalars["train/loss"] == [1, 2] and scalars["val/top1"] == [1, 2], scalars
    rows = [(m["split"], m["epoch"]) for m in read_metrics(str(out))]
    assert rows == [("train", 1), ("val", 1), ("train", 2), ("val", 2)], rows


@pytest.mark.e2e
def test_rerunning_a_finished_val_split_run_writes_no_new_record(tmp_path):
    """A finished TRAIN.VAL_SPLIT run, its command again: the test split is not evaluated and
    recorded again (before: one more "test" row in metrics.jsonl and TensorBoard per re-run)."""
    out = tmp_path / "run"
    args = [*TINY_RUN, "OUT_DIR", str(out), "TRAIN.VAL_SPLIT", "0.25"]
    check(_train(tmp_path, *args))
    before = {k: v for k, v in _hashes(out).items() if k.startswith(("metrics", "tb/", "checkpoints/"))}
    assert [m["split"] for m in read_metrics(str(out))].count("test") == 1
    again = check(_train(tmp_path, *args))
    after = {k: v for k, v in _hashes(out).items() if k.startswith(("metrics", "tb/", "checkpoints/"))}
    assert after == before, (sorted(before), sorted(after), again.stdout[-2000:])


# ---------------------------------------------------------------------------------------------
# A refusal changes nothing
# ---------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_a_late_refusal_leaves_the_run_folder_byte_for_byte(tmp_path):
    """A resume refused after the model and the data are built (the training set shrank) exits 2
    (refused by the resume checks) and leaves every file as it was. Before: config.yaml, config_diff.yaml, env.json
    and model.txt were rewritten and log.txt, env_history.jsonl appended to."""
    out = tmp_path / "run"
    check(_train(tmp_path, *TINY_RUN, "OUT_DIR", str(out), "OPTIM.MAX_EPOCH", "2", "TRAIN.CKPT_PERIOD_MIN", "0"))
    os.remove(out / "checkpoints" / "last.pth")  # an unfinished run: the re-run would resume it
    before = _hashes(out)
    assert "config.yaml" in before and "env.json" in before and "log.txt" in before, before
    refused = _train(tmp_path, *TINY_RUN, "OUT_DIR", str(out), "OPTIM.MAX_EPOCH", "3", "TRAIN.SYNTHETIC_SAMPLES", "48")
    check(refused, 2)
    assert "cannot resume" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert _hashes(out) == before


@pytest.mark.e2e
def test_a_refused_command_makes_no_folder(tmp_path):
    """eval with nothing to evaluate, and train (too large a step for the data) into folders that did
    not exist: exit 2, and no folder (before: an empty log.txt in a new one)."""
    fresh = tmp_path / "eval_here"
    check(distribuuuu("eval", *TINY_RUN, "OUT_DIR", str(fresh)), 2)
    assert not fresh.exists(), _hashes(fresh)
    fresh = tmp_path / "train_here"
    check_user_error(_train(tmp_path, *TINY_RUN, "OUT_DIR", str(fresh), "TRAIN.ACCUM_STEPS", "8"), "no step")
    assert not fresh.exists(), _hashes(fresh)


# ---------------------------------------------------------------------------------------------
# The folder's mistakes: exit 2, one line, before any training step
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def shared_tmp():
    """A folder that the unprivileged user can reach (pytest's tmp_path is root's alone)."""
    path = tempfile.mkdtemp(prefix="du_h1_", dir="/tmp")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _unprivileged(cmd_args, cwd):
    """Run `distribuuuu train` so that permission bits bind: as nobody when we are root."""
    if os.geteuid() != 0:
        return _train(cwd, *cmd_args)
    if sys.platform != "linux":
        pytest.skip("dropping root to the user nobody is only set up for Linux here")
    return _train(cwd, "train", *cmd_args, script=AS_NOBODY)


@pytest.mark.e2e
def test_out_dir_that_is_a_file_exits_2(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    check_user_error(_train(tmp_path, *SHORT, "OUT_DIR", "notes.txt"), "OUT_DIR notes.txt is a file, not a folder")
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.e2e
def test_out_dir_not_writable_exits_2_before_training(shared_tmp):
    out = os.path.join(shared_tmp, "theirs")
    os.makedirs(out)
    os.chmod(out, 0o555)  # nobody (or a non-root user) may enter and read, not write
    proc = _unprivileged([*SHORT, "OUT_DIR", out], shared_tmp)
    check_user_error(proc, f"OUT_DIR {out} is not writable (Permission denied)", f"chmod u+w {out}")
    assert os.listdir(out) == []


@pytest.mark.e2e
def test_read_only_checkpoints_folder_exits_2_before_training(shared_tmp):
    out = os.path.join(shared_tmp, "run")
    os.makedirs(os.path.join(out, "checkpoints"))
    os.chmod(out, 0o777)
    os.chmod(os.path.join(out, "checkpoints"), 0o555)
    proc = _unprivileged([*SHORT, "OUT_DIR", out], shared_tmp)
    check_user_error(proc, f"the checkpoints folder {out}/checkpoints is not writable")
    assert "[train]" not in proc.stdout and not os.path.exists(os.path.join(out, "metrics.jsonl"))

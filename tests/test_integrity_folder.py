"""One run per folder, and nothing of an earlier run lost (issue #14 items 1, 3, 5, and the run
folder's part of 8): real processes, a real SIGKILL in a real checkpoint write, real permissions."""

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
from tests.conftest import ROOT, TINY, check, env, make_cfg, read_metrics

KILL_IN_SAVE = os.path.join(ROOT, "tests", "scripts", "kill_in_save.py")
AS_NOBODY = os.path.join(ROOT, "tests", "scripts", "as_nobody.py")
SHORT = ["--cfg", TINY, "TRAIN.PRINT_FREQ", "1000"]  # 2 epochs of 8 steps, seconds


def _train(cwd, *args, extra_env=None, script=None, timeout=120, preexec_fn=None):
    """`python -m distribuuuu train ...` (or `python SCRIPT ...`) from cwd, outside the repo."""
    e = env()
    e.update(extra_env or {})
    cmd = [sys.executable, script] if script else [sys.executable, "-m", "distribuuuu", "train"]
    return subprocess.run(cmd + list(args), cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=preexec_fn)


def _one_error(proc, *fragments):
    """Exit 2, no traceback, exactly one line on stderr, holding every fragment."""
    check(proc, 2)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _debris(out):
    return sorted(n for n in os.listdir(os.path.join(out, "checkpoints")) if ".tmp." in n)


# ---------------------------------------------------------------------------------------------
# 1. one run per folder
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
        _one_error(second, f"OUT_DIR {out} is in use by another training run", f"pid {first.pid}",
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
    _one_error(proc, "another host", "pid 4242 on host node-that-is-not-here", "2026-01-02 03:04:05",
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


# ---------------------------------------------------------------------------------------------
# 5. a killed save leaves nothing behind; a killed run's lock is taken over
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
# 3. AUTO_RESUME False never destroys the previous run; a run without checkpoints is set aside
# ---------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_auto_resume_false_into_a_finished_run_exits_2_and_keeps_it(tmp_path):
    out = tmp_path / "run"
    check(_train(tmp_path, *SHORT, "OUT_DIR", str(out), "OPTIM.MAX_EPOCH", "1"))
    before = {n: _sha(out / "checkpoints" / n) for n in os.listdir(out / "checkpoints")}
    metrics = (out / "metrics.jsonl").read_bytes()
    proc = _train(tmp_path, *SHORT, "OUT_DIR", str(out), "TRAIN.AUTO_RESUME", "False")
    _one_error(proc, f"OUT_DIR {out} already holds a run (last.pth at epoch 1 (step 8), best.pth, 1 epoch_*.pth, "
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


# ---------------------------------------------------------------------------------------------
# 8. the run folder's mistakes: exit 2, one line, before any training step
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
    _one_error(_train(tmp_path, *SHORT, "OUT_DIR", "notes.txt"), "OUT_DIR notes.txt is a file, not a folder")
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.e2e
def test_out_dir_not_writable_exits_2_before_training(shared_tmp):
    out = os.path.join(shared_tmp, "theirs")
    os.makedirs(out)
    os.chmod(out, 0o555)  # nobody (or a non-root user) may enter and read, not write
    proc = _unprivileged([*SHORT, "OUT_DIR", out], shared_tmp)
    _one_error(proc, f"OUT_DIR {out} is not writable (Permission denied)", f"chmod u+w {out}")
    assert os.listdir(out) == []


@pytest.mark.e2e
def test_read_only_checkpoints_folder_exits_2_before_training(shared_tmp):
    out = os.path.join(shared_tmp, "run")
    os.makedirs(os.path.join(out, "checkpoints"))
    os.chmod(out, 0o777)
    os.chmod(os.path.join(out, "checkpoints"), 0o555)
    proc = _unprivileged([*SHORT, "OUT_DIR", out], shared_tmp)
    _one_error(proc, f"the checkpoints folder {out}/checkpoints is not writable")
    assert "[train]" not in proc.stdout and not os.path.exists(os.path.join(out, "metrics.jsonl"))

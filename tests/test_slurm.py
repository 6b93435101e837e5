"""Training under a real Slurm cluster: srun, sbatch, torchrun inside an allocation, Ctrl-C, preemption
and requeue, and the tutorial's Slurm step: every test that uses the cluster, in this one file.

Every test submits real jobs to the controller that `scripts/local_slurm.sh` starts (a one-host
cluster: slurmctld + slurmd + munged on this machine; .ci/run starts it before the tests). They are
skipped, with the reason printed, only when no controller answers.

Jobs are named `dtest-<random>` and limited to 5 minutes (-t 5); a test that fails or times out
cancels its job. `-N 1` keeps each step on one node so that the expected [dist] lines are exact.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from tests import conftest as su
from tests.conftest import ROOT, TINY, check, env, read_metrics, run
from tests.test_tutorial import ARGS, check_ladder_output, script

pytestmark = pytest.mark.e2e  # every test here starts processes

PY = sys.executable
TRAIN_AND_DUMP = os.path.join("tests", "scripts", "train_and_dump.py")
JOB_TIMEOUT = 240  # seconds; a job takes ~10-30 s here, most of it importing torch


@pytest.fixture(autouse=True)
def _slurm():
    su.require_slurm()


@pytest.fixture
def job_name():
    """A unique job name; whatever is left of the job is cancelled after the test."""
    name = f"dtest-{uuid.uuid4().hex[:8]}"
    yield name
    su.cancel(name)


def _report(proc: subprocess.CompletedProcess | None, log: str = "") -> str:
    text = log or f"--- stdout\n{proc.stdout[-5000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    return f"\n{text}"


def srun(name: str, *args: str, timeout: float = JOB_TIMEOUT) -> subprocess.CompletedProcess:
    """`srun -J name -t 5 --kill-on-bad-exit=1 args...` from the repo root; fails the test on timeout.

    --kill-on-bad-exit=1: if one rank crashes, Slurm kills the others at once; without it they would
    wait in a collective until the process-group timeout and the test would hang instead of failing.
    """
    cmd = ["srun", "-J", name, "-t", "5", "--kill-on-bad-exit=1", *args]
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        su.cancel(name)
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s\n{out[-5000:]}")


def sbatch(name: str, script: str, log: str, *args: str, extra_env: dict[str, str]) -> tuple[dict, str]:
    """Submit script, wait for the job to finish; return (scontrol record, job output)."""
    cmd = ["sbatch", "--parsable", "-J", name, "-t", "5", f"--output={log}", script, *args]
    e = env()
    e.update(extra_env, PYTHON=PY)
    sub = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, f"{' '.join(cmd)} failed:{_report(sub)}"
    job_id = sub.stdout.strip().split(";")[0]
    info = su.wait_job(job_id, JOB_TIMEOUT)
    output = open(log).read() if os.path.exists(log) else "(no output file)"
    if info.get("JobState") not in su.FINISHED:
        su.cancel(name)
        pytest.fail(f"job {job_id} not finished after {JOB_TIMEOUT} s (state {info.get('JobState')}):\n{output}")
    return info, output


def dist_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[dist] ")]


def expected_dist_line(rank: int, world: int, master: str, launcher: str) -> str:
    return (f"[dist] rank {rank}/{world} | local rank {rank}/{world} | node 0 | master {master} "
            f"| device cpu | backend gloo | launcher {launcher}")


def slurm_master(job: dict[str, str]) -> str:
    """What launch.launcher.detect should derive: first host of the node list, 10000 + job id % 20000."""
    return f"{su.hostnames(job['nodes'])[0]}:{10000 + int(job['id']) % 20000}"


def assert_same_weights(out_dir: str, world: int) -> None:
    states = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(world)]
    for r, state in enumerate(states[1:], start=1):
        assert state.keys() == states[0].keys(), f"rank {r} saved other tensors than rank 0"
        differ = [k for k in state if not torch.equal(state[k], states[0][k])]
        assert not differ, f"rank {r} ended with other weights than rank 0: {differ[:5]}"


def test_srun_two_ranks(tmp_path, job_name):
    """srun -n 2: two ranks find rank/world/master in Slurm's variables and train to equal weights."""
    out = str(tmp_path / "run")
    proc = srun(job_name, "-N", "1", "-n", "2", PY, "-u", TRAIN_AND_DUMP, "--cfg", TINY, "OUT_DIR", out)
    assert proc.returncode == 0, f"srun failed ({proc.returncode}):{_report(proc)}"
    job = su.job_of(job_name)
    assert job, f"job {job_name} not found in squeue -t all"
    master = slurm_master(job)
    lines = dist_lines(proc.stdout)
    for rank in range(2):
        want = expected_dist_line(rank, 2, master, "slurm")
        assert want in lines, f"missing {want!r}; [dist] lines: {lines}{_report(proc)}"
    assert_same_weights(out, 2)


def test_sbatch_example(tmp_path, job_name):
    """examples/slurm/train.sbatch runs to completion: both ranks under Slurm, the final summary."""
    out, log = str(tmp_path / "run"), str(tmp_path / "job.log")
    info, output = sbatch(job_name, "examples/slurm/train.sbatch", log, "OPTIM.MAX_EPOCH", "1",
                          extra_env={"OUT_DIR": out})
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (
        f"job ended {info['JobState']} (exit {info['ExitCode']}):\n{output}")
    master = slurm_master(su.job_of(job_name))
    for rank in range(2):
        want = expected_dist_line(rank, 2, master, "slurm")
        assert want in output, f"missing {want!r} in the job's output:\n{output}"
    assert re.search(r"done: best val balanced top-1 .* \| 1 epochs \|", output), f"no final summary:\n{output}"
    assert os.path.isfile(os.path.join(out, "checkpoints", "last.pth")), output


def test_sbatch_torchrun_example(tmp_path, job_name):
    """examples/slurm/torchrun.sbatch: one torchrun agent per node, c10d rendezvous, 2 workers."""
    out, log = str(tmp_path / "run"), str(tmp_path / "job.log")
    info, output = sbatch(job_name, "examples/slurm/torchrun.sbatch", log,
                          "--cfg", TINY, "OUT_DIR", out, "OPTIM.MAX_EPOCH", "1", extra_env={})
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (
        f"job ended {info['JobState']} (exit {info['ExitCode']}):\n{output}")
    lines = dist_lines(output)
    assert len(lines) == 2 and all(line.endswith("| launcher torchrun") for line in lines), (
        f"want 2 torchrun ranks, got {lines}:\n{output}")
    assert "done: best val balanced top-1" in output, output


def test_torchrun_inside_srun(tmp_path, job_name):
    """srun -n 1 torchrun --nproc-per-node=2: the workers follow torchrun, not the Slurm variables."""
    out = str(tmp_path / "run")
    proc = srun(job_name, "-N", "1", "-n", "1", "-c", "2", PY, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", TRAIN_AND_DUMP, "--cfg", TINY, "OUT_DIR", out)
    assert proc.returncode == 0, f"srun torchrun failed ({proc.returncode}):{_report(proc)}"
    lines = dist_lines(proc.stdout)
    for rank in range(2):
        want = re.compile(rf"\[dist\] rank {rank}/2 \| local rank {rank}/2 \| node 0 \| master \S+:\d+ "
                          r"\| device cpu \| backend gloo \| launcher torchrun$")
        assert any(want.match(line) for line in lines), f"no torchrun line for rank {rank}: {lines}{_report(proc)}"
    assert_same_weights(out, 2)


def test_srun_distribuuuu_baseline_config(tmp_path, job_name):
    """Distribuuuu's own form, `srun -n 2 python -u train_net.py --cfg config/resnet18.yaml`, shrunk."""
    out = str(tmp_path / "run")
    opts = ["MODEL.ARCH", "resnet_tiny", "MODEL.NUM_CLASSES", "4", "MODEL.SMALL_STEM", "True",
            "TRAIN.DATASET", "synthetic", "TEST.DATASET", "synthetic", "TRAIN.SYNTHETIC_SAMPLES", "64",
            "TEST.SYNTHETIC_SAMPLES", "30", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16",
            "TRAIN.BATCH_SIZE", "16", "TEST.BATCH_SIZE", "16", "TRAIN.TOPK", "2", "TRAIN.WORKERS", "0",
            "OPTIM.MAX_EPOCH", "1", "OPTIM.WARMUP_EPOCHS", "0", "DEVICE", "cpu", "NUM_THREADS", "1",
            "OUT_DIR", out]
    proc = srun(job_name, "-N", "1", "-n", "2", PY, "-u", "train_net.py", "--cfg", "config/resnet18.yaml", *opts)
    assert proc.returncode == 0, f"srun failed ({proc.returncode}):{_report(proc)}"
    lines = dist_lines(proc.stdout)
    assert len(lines) == 2 and all(line.endswith("| launcher slurm") for line in lines), (
        f"want 2 slurm ranks, got {lines}{_report(proc)}")
    val = [m for m in read_metrics(out) if m["split"] == "val"]
    assert val and val[-1]["n"] == 30, f"val must count all 30 samples once: {val}"


def _srun_is_training(proc: subprocess.Popen, ckpt: str, log: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.isfile(ckpt):
        if proc.poll() is not None:
            pytest.fail(f"srun exited ({proc.returncode}) before the first checkpoint:\n{open(log).read()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {ckpt} after {timeout} s:\n{open(log).read()}")
        time.sleep(0.2)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_signal_to_srun_leaves_nothing_behind(tmp_path, job_name, sig):
    """Ctrl-C (SIGINT) or SIGTERM to srun mid-training: every process of the job is gone within 30 s
    and the last checkpoint still loads.

    SIGINT is sent twice, 0.3 s apart: that is Ctrl-C Ctrl-C. Slurm's srun answers a single SIGINT
    only with a status report ("one more within 1 sec to abort"); `srun --quit-on-interrupt` would
    abort on the first. The second makes srun send SIGINT to the tasks, then cancel the step.
    """
    out = str(tmp_path / f"run-{uuid.uuid4().hex}")  # unique: it marks this job's command lines
    log = str(tmp_path / "srun.log")
    cmd = ["srun", "-J", job_name, "-t", "5", "-N", "1", "-n", "2", "--kill-on-bad-exit=1", PY, "-u",
           "train_net.py", "--cfg", TINY, "OPTIM.MAX_EPOCH", "500", "OUT_DIR", out]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=f, stderr=subprocess.STDOUT)
    try:
        ckpt = os.path.join(out, "checkpoints", "last.pth")
        _srun_is_training(proc, ckpt, log, timeout=150)
        job = su.job_of(job_name)
        # srun (and its helper child), the python tasks, and the slurmstepd of the job's steps.
        pids = su.pids_matching(re.escape(out)) + su.pids_matching(rf"slurmstepd: \[{job['id']}\.")
        tasks = [p for p in pids if su.cmdline(p).startswith(PY)]
        assert len(tasks) == 2, f"want 2 python tasks, found {tasks} among:\n{su.describe(pids)}"
        assert proc.pid in pids
        if sig == "SIGINT":  # Ctrl-C twice
            proc.send_signal(signal.SIGINT)
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        try:
            status = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"srun still runs 30 s after {sig}:\n{open(log).read()}")
        left = su.wait_gone(pids, timeout=max(0.0, deadline - time.monotonic()))
        assert not left, f"still running 30 s after {sig}:\n{su.describe(left)}\n{open(log).read()}"
        assert status != 0, f"srun exited 0 after {sig}:\n{open(log).read()}"
        info = su.wait_job(job["id"], timeout=30)
        assert info.get("JobState") in su.FINISHED, f"job {job['id']} still {info.get('JobState')}"
        state = torch.load(ckpt, weights_only=True)
        assert state["epoch"] >= 1 and state["model"], "last.pth holds no trained epoch"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

# ---------------------------------------------------------------------------------------------
# Preemption and requeue (tests/scripts/fault_run.py sends the signal at a chosen step)
# ---------------------------------------------------------------------------------------------
# 2 ranks x batch 16 on 256 samples: 8 steps per epoch, 2 epochs.
FAULTS = ["--cfg", TINY, "TRAIN.SYNTHETIC_SAMPLES", "256", "OPTIM.MAX_EPOCH", "2", "TRAIN.PRINT_FREQ", "1"]
FAULT_RUN = os.path.join("tests", "scripts", "fault_run.py")


def _ckpt(out):
    return torch.load(os.path.join(out, "checkpoints", "last.pth"), map_location="cpu", weights_only=True)


def test_preemption_signal_under_srun_checkpoints_and_the_next_srun_continues(tmp_path):
    """Under the local Slurm cluster: rank 1 of `srun -n 2` gets SIGUSR1 after step 3; both ranks
    agree, checkpoint, and exit; a second srun resumes from that step and finishes."""
    out = str(tmp_path / "run")
    cmd = ["srun", "-N", "1", "-n", "2", "-t", "5", "--kill-on-bad-exit=1", PY, FAULT_RUN, *FAULTS,
           "OUT_DIR", out]
    e = env()
    e["SIGNAL_AT"] = "3:1:SIGUSR1"
    first = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=240)
    assert first.returncode != 0, first.stdout[-2000:]
    assert "launcher slurm" in first.stdout
    ckpt = _ckpt(out)
    assert (ckpt["global_step"], ckpt["samples_in_epoch"], ckpt["world_size"]) == (3, 3 * 32, 2)
    second = check(subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240))
    assert "96 samples into epoch 1, step 3" in second.stdout
    assert _ckpt(out)["epoch"] == 2 and _ckpt(out)["global_step"] == 16


def test_preempted_sbatch_job_requeues_itself_and_the_second_run_finishes(tmp_path):
    """TRAIN.REQUEUE True in a `sbatch --requeue` job: the preempted first run checkpoints at step 3,
    rank 0 runs `scontrol requeue`, Slurm starts the same script again (restart count 1), and that
    run resumes from step 3 and completes the job."""
    out, log, name = str(tmp_path / "run"), str(tmp_path / "job.log"), f"requeue-{os.getpid()}"
    e = env()
    e["PYTHON"] = PY
    cmd = ["sbatch", "--parsable", "-J", name, "-t", "5", f"--output={log}", "tests/scripts/requeue.sbatch",
           *FAULTS, "OUT_DIR", out, "TRAIN.REQUEUE", "True"]
    sub = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 120
        info = su.job_info(job)
        while not (info.get("Restarts") == "1" and info.get("JobState") == "PENDING"):
            assert info.get("JobState") not in su.FINISHED, f"job ended without a requeue: {info}"
            assert time.monotonic() < deadline, f"no requeue after 120 s: {info}"
            time.sleep(0.3)
            info = su.job_info(job)
        # Slurm holds a requeued batch job back for ~2 minutes (the credential lifetime, 120 s by
        # default); starting it now keeps the test short and changes nothing else. Not at once: slurmd
        # revoked the first run's credential with a time in whole seconds and refuses a new one made in
        # that same second ("Killing non-startable batch JobId=N: Job credential revoked" in
        # slurmctld.log, and the job ends FAILED), so the release waits for the next second.
        time.sleep(2)
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True, timeout=30)
        info = su.wait_job(job, 180)
    finally:
        su.cancel(name)
    output = open(log).read() if os.path.exists(log) else "(no output file)"
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", f"{info}\n{output}"
    assert f"[preempt] scontrol requeue {job}: ok" in output, output
    assert f"job {job} starts, restart count 1" in output, output
    assert "96 samples into epoch 1, step 3" in output, output
    assert _ckpt(out)["epoch"] == 2 and _ckpt(out)["global_step"] == 16


# ---------------------------------------------------------------------------------------------
# The tutorial's Slurm step (tutorial/mnmc_ddp_slurm.py)
# ---------------------------------------------------------------------------------------------
def test_tutorial_mnmc_ddp_slurm():
    name = f"tut-{uuid.uuid4().hex[:8]}"
    # MASTER_PORT is unset (conftest.env drops it): the script derives the port from the job id.
    # --kill-on-bad-exit=1: a crashing rank stops the other instead of leaving it in a collective.
    cmd = ["srun", "-J", name, "-t", "5", "-N", "1", "-n", "2", "--kill-on-bad-exit=1",
           PY, "-u", script("mnmc_ddp_slurm.py"), *ARGS]
    try:
        proc = run(cmd, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(cmd)} did not finish within 240 s")
    finally:
        subprocess.run(["scancel", "-n", name], capture_output=True, timeout=30)
    out = check_ladder_output(proc, world=2)
    assert "master: " in out and "backend: gloo" in out

"""Issue 25: faults at the edges of a run, with real processes, real signals and real files.

A whole-group SIGTERM (Slurm, systemd, Kubernetes) to a run with DataLoader workers; records after
a resume; refusals that must leave the run folder as it was.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from tests.conftest import (
    ROOT,
    TINY,
    check,
    env,
    kill_tree,
    read_metrics,
    read_text_or_empty,
    start_until_training,
    wait_gone,
)

pytestmark = pytest.mark.e2e  # every test here starts processes

PY = sys.executable
# 1024 samples / 16 per step: 64 steps (32 per rank under 2 processes), long enough for a signal
# sent at the first progress line to land mid-epoch; the loader pipeline with 2 workers per rank.
WORKERS = ["OPTIM.MAX_EPOCH", "1", "TRAIN.SYNTHETIC_SAMPLES", "1024", "TEST.SYNTHETIC_SAMPLES", "16",
           "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8", "TRAIN.DATA_PIPELINE", "loader", "TRAIN.WORKERS", "2"]
LAUNCH = {
    "plain": [PY, "-m", "distribuuuu", "train"],
    "torchrun": [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "distribuuuu",
                 "train"],
}


def _group_sigterm_mid_epoch(out, cmd: list[str]) -> tuple[int, str, dict]:
    """cmd in a session of its own (setsid); at the first training step, SIGTERM to its whole
    process group (kill -TERM -- -PGID). Returns (status, console, every process seen)."""
    proc, job, console = start_until_training([*cmd, "--cfg", TINY, "OUT_DIR", str(out), *WORKERS], out)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        status = proc.wait(timeout=60)
        left = wait_gone(job, 15)
    finally:
        kill_tree(proc, job)
    text = console.read_text()
    assert not left, f"left behind: {left}\n{text[-4000:]}"
    return status, text, job


@pytest.mark.parametrize("launcher", list(LAUNCH))
def test_whole_group_sigterm_with_loader_workers_checkpoints_and_resumes(tmp_path, launcher):
    """The workers get the group's SIGTERM too: they ignore it, the main process writes its step
    checkpoint, ends its workers, exits 143; nothing is left and the same command finishes the epoch.
    Before: the workers died first, the checkpoint failed on 'DataLoader worker ... killed', exit 1."""
    out = tmp_path / "run"
    status, console, job = _group_sigterm_mid_epoch(out, LAUNCH[launcher])
    assert "killed by signal" not in console and "distribuuuu/" not in console, console[-6000:]
    if launcher == "torchrun":  # its agent reports the group's SIGTERM its own way (SignalException, exit 1)
        assert status != 0 and not re.search(r"\[rank\d\]: Traceback", console), console[-6000:]
    else:
        assert status == 143 and "Traceback" not in console, f"exit {status}\n{console[-6000:]}"
    assert len(job) >= (3 if launcher == "plain" else 7), job  # the ranks' workers were seen, and are gone
    ckpt = torch.load(out / "checkpoints" / "last.pth", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == 0 and 0 < ckpt["samples_in_epoch"] < 1024, ckpt["samples_in_epoch"]
    assert list((out / "checkpoints").glob("step_*.pth")), os.listdir(out / "checkpoints")
    again = subprocess.run([*LAUNCH[launcher], "--cfg", TINY, "OUT_DIR", str(out), *WORKERS], cwd=ROOT, env=env(),
                           capture_output=True, text=True, timeout=240)
    check(again)
    assert f"{ckpt['samples_in_epoch']} samples into epoch 1" in read_text_or_empty(out / "log.txt")
    assert [m["n"] for m in read_metrics(str(out)) if m["split"] == "train"] == [1024]


# ---------------------------------------------------------------------------------------------
# Refusals change nothing
# ---------------------------------------------------------------------------------------------

SHORT = ["OPTIM.MAX_EPOCH", "1", "TRAIN.SYNTHETIC_SAMPLES", "64", "TEST.SYNTHETIC_SAMPLES", "16",
         "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8"]


def _hashes(folder) -> dict[str, str]:
    """Every file under folder: relative path -> sha256 (what a refusal must leave as it was)."""
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_late_refusal_leaves_the_run_folder_byte_for_byte(tmp_path):
    """A resume refused after the model and the data are built (the training set shrank) exits 2
    (refused by the resume checks) and leaves every file as it was. Before: config.yaml, config_diff.yaml, env.json
    and model.txt were rewritten and log.txt, env_history.jsonl appended to."""
    out = tmp_path / "run"
    check(subprocess.run([PY, "-m", "distribuuuu", "train", "--cfg", TINY, "OUT_DIR", str(out), *SHORT,
                          "OPTIM.MAX_EPOCH", "2", "TRAIN.CKPT_PERIOD_MIN", "0"], cwd=ROOT, env=env(),
                         capture_output=True, text=True, timeout=240))
    os.remove(out / "checkpoints" / "last.pth")  # an unfinished run: the re-run would resume it
    before = _hashes(out)
    assert "config.yaml" in before and "env.json" in before and "log.txt" in before, before
    refused = subprocess.run([PY, "-m", "distribuuuu", "train", "--cfg", TINY, "OUT_DIR", str(out), *SHORT,
                              "OPTIM.MAX_EPOCH", "3", "TRAIN.SYNTHETIC_SAMPLES", "48"], cwd=ROOT, env=env(),
                             capture_output=True, text=True, timeout=240)
    check(refused, 2)
    assert "cannot resume" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert _hashes(out) == before


def test_a_refused_command_makes_no_folder(tmp_path):
    """eval with nothing to evaluate, and train
    (too large a step for the data) into folders that did not exist: exit 2, and no folder (before: an empty log.txt in a new one)."""
    fresh = tmp_path / "eval_here"
    refused = subprocess.run([PY, "-m", "distribuuuu", "eval", "--cfg", TINY, "OUT_DIR", str(fresh), *SHORT],
                             cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240)
    check(refused, 2)
    assert not fresh.exists(), _hashes(fresh)
    fresh = tmp_path / "train_here"
    refused = subprocess.run([PY, "-m", "distribuuuu", "train", "--cfg", TINY, "OUT_DIR", str(fresh), *SHORT,
                              "TRAIN.ACCUM_STEPS", "8"], cwd=ROOT, env=env(), capture_output=True, text=True,
                             timeout=240)
    check(refused, 2)
    assert "no step" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert not fresh.exists(), _hashes(fresh)


# ---------------------------------------------------------------------------------------------
# Records after a resume: each step and epoch once
# ---------------------------------------------------------------------------------------------

# 128 samples / 16 = 8 steps an epoch, a TensorBoard step line at each, a step checkpoint every 4 steps
RECORDED = [*SHORT, "OPTIM.MAX_EPOCH", "2", "TRAIN.SYNTHETIC_SAMPLES", "128", "TRAIN.PRINT_FREQ", "1",
            "TRAIN.CKPT_PERIOD_STEPS", "4"]


def _scalars(tb) -> dict[str, list[int]]:
    """Every scalar tag of the run's TensorBoard folder -> its steps, as TensorBoard shows them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_after_kill_9_mid_epoch_each_step_and_epoch_is_recorded_once(tmp_path):
    """kill -9 after step 15 (mid epoch 2, the step checkpoint of step 12 on disk), then the same
    command: TensorBoard (read by EventAccumulator) and metrics.jsonl hold each step / epoch once.
    Before: the steps after 12 that reached the events file before the kill appeared twice."""
    out = tmp_path / "run"
    cmd = [PY, "tests/scripts/fault_run.py", "--cfg", TINY, "OUT_DIR", str(out), *RECORDED]
    killed = subprocess.run(cmd, cwd=ROOT, env={**env(), "SIGNAL_AT": "15:0:SIGKILL"}, capture_output=True,
                            text=True, timeout=240)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (out / "checkpoints" / "step_00000012.pth").is_file(), os.listdir(out / "checkpoints")
    assert _scalars(out / "tb")["train_step/loss"][-1] > 12  # steps the re-run writes again
    check(subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240))
    scalars = _scalars(out / "tb")
    assert scalars["train_step/loss"] == list(range(1, 17)), scalars
    assert scalars["train/loss"] == [1, 2] and scalars["val/top1"] == [1, 2], scalars
    rows = [(m["split"], m["epoch"]) for m in read_metrics(str(out))]
    assert rows == [("train", 1), ("val", 1), ("train", 2), ("val", 2)], rows


def test_rerunning_a_finished_val_split_run_writes_no_new_record(tmp_path):
    """A finished TRAIN.VAL_SPLIT run, its command again: the test split is not evaluated and
    recorded again (before: one more "test" row in metrics.jsonl and TensorBoard per re-run)."""
    out = tmp_path / "run"
    cmd = [PY, "-m", "distribuuuu", "train", "--cfg", TINY, "OUT_DIR", str(out), *SHORT, "TRAIN.VAL_SPLIT", "0.25"]
    check(subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240))
    before = {k: v for k, v in _hashes(out).items() if k.startswith(("metrics", "tb/", "checkpoints/"))}
    assert [m["split"] for m in read_metrics(str(out))].count("test") == 1
    again = check(subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240))
    after = {k: v for k, v in _hashes(out).items() if k.startswith(("metrics", "tb/", "checkpoints/"))}
    assert after == before, (sorted(before), sorted(after), again.stdout[-2000:])

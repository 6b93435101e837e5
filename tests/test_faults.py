"""Fault tolerance, each fault injected for real: signals, killed and failing ranks, bad numbers."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import ROOT, TINY, check, env, read_metrics

pytestmark = pytest.mark.e2e  # every test here starts processes

SCRIPT = "tests/scripts/fault_run.py"
# 2 ranks x batch 16 on 256 samples: 8 steps per epoch; no augmentation, 1 thread: bitwise repeatable.
SMALL = ["--cfg", TINY, "TRAIN.SYNTHETIC_SAMPLES", "256", "OPTIM.MAX_EPOCH", "2", "TRAIN.PRINT_FREQ", "1"]


def _run(args, extra_env=None, nproc=2, timeout=240, launcher="torchrun"):
    e = env()
    e.update(extra_env or {})
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", SCRIPT]
    else:
        cmd = [sys.executable, SCRIPT]
    return subprocess.run(cmd + args, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)


def _losses(prefix, rank):
    with open(f"{prefix}.rank{rank}") as f:
        return [float(line) for line in f]


def _ckpt(out, name="last.pth"):
    return torch.load(os.path.join(out, "checkpoints", name), map_location="cpu", weights_only=True)


def test_step_exact_resume_gives_the_same_losses_on_two_ranks(tmp_path):
    straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
    check(_run(SMALL + ["OUT_DIR", straight], {"LOSS_LOG": f"{straight}/loss"}))
    # Rank 1 receives SIGUSR1 after step 5 (of 16): all ranks agree, checkpoint, exit 128+10.
    first = _run(SMALL + ["OUT_DIR", stopped], {"LOSS_LOG": f"{stopped}/loss", "SIGNAL_AT": "5:1:SIGUSR1"})
    assert first.returncode != 0
    ckpt = _ckpt(stopped)
    assert (ckpt["epoch"], ckpt["global_step"], ckpt["samples_in_epoch"]) == (0, 5, 5 * 32)
    assert len(ckpt["rng"]) == 2  # every rank's RNG states
    check(_run(SMALL + ["OUT_DIR", stopped], {"LOSS_LOG": f"{stopped}/loss"}))
    for rank in (0, 1):
        # Bitwise: the same data order, RNG states and arithmetic (1 thread, gloo sums in rank order).
        assert _losses(f"{stopped}/loss", rank) == _losses(f"{straight}/loss", rank)
    a, b = _ckpt(straight)["model"], _ckpt(stopped)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The interrupted epoch's train metrics cover the whole epoch, before and after the restart.
    train = lambda out: [m for m in read_metrics(out) if m["split"] == "train"]  # noqa: E731
    assert [(m["n"], m["loss"]) for m in train(stopped)] == [(m["n"], m["loss"]) for m in train(straight)]


def test_step_exact_resume_with_loader_workers_on_an_augmented_folder(tmp_path):
    """As above on JPEGs with random crops and flips made by 2 loader workers per rank: the workers
    seed each item by (seed, epoch, index), so the resumed epoch's batches are the straight run's."""
    from tests.conftest import write_image_tree

    write_image_tree(str(tmp_path / "data"), "train", {"a": 40, "b": 40}, ext="jpg", size=(20, 20))
    folder = ["TRAIN.DATASET", str(tmp_path / "data"), "TEST.DATASET", str(tmp_path / "data"), "TEST.SPLIT",
              "train", "MODEL.NUM_CLASSES", "2", "TRAIN.TOPK", "1", "TRAIN.IM_SIZE", "16", "TEST.IM_SIZE", "16",
              "TRAIN.WORKERS", "2", "TRAIN.BATCH_SIZE", "8"]  # 80 images: 5 steps of 2 x 8 per epoch
    straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
    check(_run(SMALL + folder + ["OUT_DIR", straight], {"LOSS_LOG": f"{straight}/loss"}))
    assert _run(SMALL + folder + ["OUT_DIR", stopped], {"LOSS_LOG": f"{stopped}/loss", "SIGNAL_AT": "3:0:SIGUSR1"}
                ).returncode != 0
    assert _ckpt(stopped)["global_step"] == 3
    check(_run(SMALL + folder + ["OUT_DIR", stopped], {"LOSS_LOG": f"{stopped}/loss"}))
    for rank in (0, 1):
        assert _losses(f"{stopped}/loss", rank) == _losses(f"{straight}/loss", rank)
        assert len(_losses(f"{straight}/loss", rank)) == 10


def test_sigterm_to_a_plain_run_checkpoints_and_exits_with_its_status(tmp_path):
    out = str(tmp_path / "run")
    proc = _run(SMALL + ["OUT_DIR", out], {"SIGNAL_AT": "3:0:SIGTERM"}, launcher="plain")
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    ckpt = _ckpt(out)
    assert (ckpt["global_step"], ckpt["samples_in_epoch"]) == (3, 3 * 16)
    resumed = check(_run(SMALL + ["OUT_DIR", out], launcher="plain"))
    assert "48 samples into epoch 1, step 3" in resumed.stdout
    assert _ckpt(out)["epoch"] == 2 and _ckpt(out)["global_step"] == 32


def test_resume_with_another_world_size_continues_the_epoch(tmp_path):
    out = str(tmp_path / "run")
    _run(SMALL + ["OUT_DIR", out], {"SIGNAL_AT": "3:0:SIGUSR1"})  # 2 ranks: 96 samples done
    assert _ckpt(out)["samples_in_epoch"] == 96
    proc = check(_run(SMALL + ["OUT_DIR", out], launcher="plain"))  # 1 rank from here on
    assert "resuming 1 processes from a checkpoint of 2" in proc.stdout + proc.stderr
    train = [m for m in read_metrics(out) if m["split"] == "train"]
    assert train[0]["n"] == 256 and train[0]["epoch"] == 1  # 96 before + 160 after, no sample twice
    assert _ckpt(out)["epoch"] == 2


def test_a_failing_rank_brings_every_rank_down_quickly(tmp_path):
    out = str(tmp_path / "run")
    start = time.monotonic()
    proc = _run(SMALL + ["OUT_DIR", out, "DIST.TIMEOUT_S", "20"], {"RAISE_AT": "4:1"}, timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    assert "injected failure at step 4 on rank 1" in proc.stderr
    log = open(os.path.join(out, "log.txt")).read()
    assert "[rank 1] rank 1 failed: RuntimeError: injected failure at step 4 on rank 1" in log


def test_a_hung_rank_is_bounded_by_the_process_group_timeout(tmp_path):
    out = str(tmp_path / "run")
    start = time.monotonic()
    proc = _run(SMALL + ["OUT_DIR", out, "DIST.TIMEOUT_S", "10"], {"HANG_AT": "3:1"}, timeout=150)
    took = time.monotonic() - start
    assert proc.returncode != 0
    assert took < 90, f"took {took:.0f} s"


def test_elastic_restart_after_kill_9_resumes_from_the_step_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    args = SMALL[:-2] + ["TRAIN.PRINT_FREQ", "4", "OUT_DIR", out, "TRAIN.CKPT_PERIOD_STEPS", "2",
                         "TRAIN.SYNTHETIC_SAMPLES", "1024", "OPTIM.MAX_EPOCH", "2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=1", SCRIPT] + args
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    ckpt_dir = os.path.join(out, "checkpoints")

    def step_checkpoint_exists():
        return os.path.isdir(ckpt_dir) and any(n.startswith("step_") for n in os.listdir(ckpt_dir))

    while time.monotonic() < deadline and not step_checkpoint_exists() and proc.poll() is None:
        time.sleep(0.1)
    assert step_checkpoint_exists(), "no step checkpoint appeared"
    # kill -9 one worker (rank 1) mid-epoch
    pids = subprocess.run(["pgrep", "-f", f"{SCRIPT}.*{out}"], capture_output=True, text=True).stdout.split()
    workers = [p for p in pids if int(p) != proc.pid]
    assert workers, "no worker found"
    os.kill(int(workers[-1]), signal.SIGKILL)
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output[-3000:]
    assert "resumed from" in output
    final = _ckpt(out)
    assert final["epoch"] == 2
    val = [m for m in read_metrics(out) if m["split"] == "val"]
    assert val[-1]["epoch"] == 2 and val[-1]["n"] == 50


@pytest.mark.parametrize("opts", [[], ["DIST.STRATEGY", "fsdp", "OPTIM.OPTIMIZER", "adamw"]], ids=["ddp-sgd", "fsdp-adamw"])
def test_a_nan_on_one_rank_skips_the_step_on_all_ranks(tmp_path, opts):
    """DDP averages the NaN into every rank's gradients; FSDP reduces the device flag (fused AdamW
    skips on the device, read at the next print step)."""
    out = str(tmp_path / "run")
    proc = check(_run(SMALL + ["OUT_DIR", out, "OPTIM.MAX_EPOCH", "1", *opts], {"NAN_AT": "3:1"}))
    assert "step skipped on every rank (1 in a row" in proc.stdout + proc.stderr
    ckpt = _ckpt(out)
    assert ckpt["global_step"] == 8  # 8 steps of the schedule, one of them skipped
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values() if t.is_floating_point())


def test_the_requeues_own_sigterm_neither_kills_scontrol_nor_cuts_its_line(tmp_path, monkeypatch, capsys):
    """Slurm signals the job as soon as it takes `scontrol requeue`, often before scontrol returns (seen
    in CI on a loaded machine: the "requeue ... ok" line was lost). Here a stand-in scontrol sends
    SIGTERM to the process that started it, then finishes: slurm_requeue holds that stop and drops it."""
    from distribuuuu.launch import signals

    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\nkill -TERM $PPID\nsleep 0.3\necho \"$@\" > \"$(dirname \"$0\")/asked\"\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    signals.handle_stop_signals()
    try:
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the stop handler is in place
        try:
            requeued = signals.slurm_requeue()
        except KeyboardInterrupt as stop:  # what the requeue's SIGTERM did before the fix
            pytest.fail(f"the requeue's own SIGTERM interrupted it: {stop!r}")
        time.sleep(0.1)  # a signal still pending would be raised by now
    finally:
        signals.restore_signal_handlers()
    assert requeued and (tmp_path / "asked").read_text().split() == ["requeue", "4242"]
    assert "[preempt] scontrol requeue 4242: ok" in capsys.readouterr().out

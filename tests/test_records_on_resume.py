"""The records are exact across resumes. Real runs of the command, stopped by real
signals at chosen moments (the Faults hook below, named by TRAIN.HOOKS and armed by environment
variables, so that the re-run of the same command runs clean), then the same command again."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from distribuuuu.engine import HookBase
from tests.conftest import ROOT, TINY, check, env, read_metrics, write_image_tree

pytestmark = pytest.mark.e2e

HOOK = "TRAIN.HOOKS", "['tests.test_records_on_resume:Faults']"


class Faults(HookBase):
    """Test instruments in the training process, each switched on by an environment variable:
      FAULT_DELETE=P1,P2   rank 0 deletes these files before the first epoch (after the preflight read them)
      FAULT_NAN_AT=S       the model's output, hence the loss, of optimizer step S is NaN (a skipped step)
      FAULT_TERM_AT=S      SIGTERM after optimizer step S (a step checkpoint, exit 143)
      FAULT_KILL_AFTER=E   SIGKILL once epoch E's train and val records are written, before its checkpoint
    """

    def before_fit(self, trainer) -> None:
        from distribuuuu.launch import comm

        for path in filter(None, os.environ.get("FAULT_DELETE", "").split(",")):
            if trainer.ctx.is_main and os.path.exists(path):
                os.remove(path)
        comm.barrier()  # no rank reads before the files are gone
        nan_at = int(os.environ.get("FAULT_NAN_AT", 0))
        if nan_at:
            def poison(module, args, output):
                return output * float("nan") if module.training and trainer.state.global_step + 1 == nan_at else None
            trainer.model.register_forward_hook(poison)

    def after_step(self, trainer, *args) -> None:  # (*args: the step and the printed numbers)
        if trainer.state.global_step == int(os.environ.get("FAULT_TERM_AT", 0)) and not self.__dict__.get("sent"):
            self.sent = True  # once: the step's micro-batches (accumulation) all end at that global step
            os.kill(os.getpid(), signal.SIGTERM)

    def after_eval(self, trainer, *args) -> None:  # (*args: the split, "val" here, and its records)
        if trainer.state.epoch == int(os.environ.get("FAULT_KILL_AFTER", 0)):
            os.kill(os.getpid(), signal.SIGKILL)


def _run(args: list[str], status: int = 0, **faults: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "distribuuuu", "train", "--cfg", TINY, *HOOK, *args], cwd=ROOT,
                          env={**env(), **{f"FAULT_{k.upper()}": v for k, v in faults.items()}},
                          capture_output=True, text=True, timeout=300)
    return check(proc, status)


def _scalars(tb) -> dict[str, list[int]]:
    """Every scalar tag of the run's TensorBoard folder -> its steps, as TensorBoard shows them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _folder(root: str) -> list[str]:
    """root/train: 2 classes of 20 images of 8 x 8, root/val: 2 x 4; the paths of 6 training images to spoil."""
    write_image_tree(root, "train", {"a": 20, "b": 20}, size=(8, 8))
    write_image_tree(root, "val", {"a": 4, "b": 4}, size=(9, 9))
    return [os.path.join(root, "train", c, f"{i}.png") for c in "ab" for i in (5, 12, 15)]  # none next to another


FOLDER = ["MODEL.NUM_CLASSES", "0", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8", "TRAIN.BATCH_SIZE", "4",
          "TEST.BATCH_SIZE", "4", "TRAIN.DATA_PIPELINE", "loader", "OPTIM.MAX_EPOCH", "1"]


def test_a_kill_between_an_epochs_records_and_its_checkpoint_leaves_each_epoch_once_in_tensorboard(tmp_path):
    """SIGKILL after epoch 2's train and val records, before its checkpoint; the same command resumes from
    epoch 1 and records epoch 2 again. Before: train/* and val/* held epoch 2 twice in TensorBoard (the
    per-step tags were purged, the per-epoch ones not). Now: each tag once per epoch, as metrics.jsonl."""
    out = tmp_path / "run"
    killed = _run(["OUT_DIR", str(out), "TRAIN.PRINT_FREQ", "1"], status=-signal.SIGKILL, kill_after="2")
    assert sorted(os.listdir(out / "checkpoints")) == ["best.pth", "epoch_0001.pth", "last.pth"], killed.stderr[-2000:]
    assert _scalars(out / "tb")["train/loss"] == [1, 2]  # epoch 2's records reached TensorBoard before the kill
    _run(["OUT_DIR", str(out), "TRAIN.PRINT_FREQ", "1"])
    scalars = _scalars(out / "tb")
    epoch_tags = [tag for tag in scalars if not tag.startswith("train_step/")]
    assert "train/loss" in epoch_tags and "val/top1" in epoch_tags, scalars
    assert all(scalars[tag] == [1, 2] for tag in epoch_tags), scalars
    assert scalars["train_step/loss"] == list(range(1, 17)), scalars  # 8 steps an epoch, each once
    assert [(m["split"], m["epoch"]) for m in read_metrics(str(out))] == [("train", 1), ("val", 1), ("train", 2),
                                                                          ("val", 2)]


def test_a_resumed_epoch_counts_its_skipped_steps_and_unreadable_images_from_its_start(tmp_path):
    """One process, 10 steps: 6 training files that do not decode, step 3's loss NaN (skipped), SIGTERM after
    step 6 (the step checkpoint of the next vote, exit 143), then the same command. Before: the epoch's record
    said skipped_steps 0 and counted only the unreadable images met after the resume. Now: 1 and 6."""
    gone = _folder(str(tmp_path / "data"))
    for path in gone:
        with open(path, "wb") as f:
            f.write(b"not an image")
    data, out = str(tmp_path / "data"), str(tmp_path / "run")
    args = ["TRAIN.DATASET", data, "TEST.DATASET", data, *FOLDER, "OUT_DIR", out]
    stopped = _run(args, status=128 + signal.SIGTERM, nan_at="3", term_at="6")
    assert "step_00000007.pth" in os.listdir(os.path.join(out, "checkpoints")), stopped.stderr[-2000:]  # the next vote
    met_before = {p for p in gone if p in stopped.stdout + stopped.stderr}
    assert 0 < len(met_before) < len(gone), met_before  # the epoch's unreadable files lie on both sides of the stop
    _run(args, nan_at="3")  # step 3 lies before the checkpoint: not trained again
    [train] = [m for m in read_metrics(out) if m["split"] == "train"]
    assert (train["skipped_steps"], train["bad_images"]) == (1, len(gone)), train


def test_an_unreadable_file_is_counted_once_however_often_it_is_drawn(tmp_path):
    """Two processes, TRAIN.REPEATED_AUG 3 (each image drawn three times an epoch, on different ranks),
    2 loader workers each, training files deleted mid-run. Before: a deleted file drawn three times was 3
    bad images. Now: the epoch's count is the number of distinct files named in the log."""
    gone = _folder(str(tmp_path / "data"))
    data, out = str(tmp_path / "data"), str(tmp_path / "run")
    proc = _run(["--nproc-per-node", "2", "TRAIN.DATASET", data, "TEST.DATASET", data, *FOLDER, "OUT_DIR", out,
                 "TRAIN.REPEATED_AUG", "3", "TRAIN.WORKERS", "2"], delete=",".join(gone))
    log = open(os.path.join(out, "log.txt")).read()
    named = set(re.findall(r"skipping unreadable image (\S+)", log + proc.stdout + proc.stderr))
    assert named and named <= set(gone), named
    [train] = [m for m in read_metrics(out) if m["split"] == "train"]
    assert train["bad_images"] == len(named), (train, named, proc.stdout[-2000:])
    assert f"{len(named)} unreadable training images skipped in epoch 1" in log

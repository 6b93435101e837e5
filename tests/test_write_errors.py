"""Every OSError while writing the run folder ends the run the same way.

Space (ENOSPC), quota (EDQUOT), a file-size limit (EFBIG), permissions (EACCES), a read-only file
system (EROFS), a folder that vanished (ENOENT): exit 2 and one line naming the file and the cause
(files.write_failure), the previous checkpoint intact, no temporary file left. The faults are real:
a full tmpfs, the kernel's file-size limit, a folder the process may not write to, a remount, a
removal, each from inside the run at an exact point (tests/_faults.py), through the installed
command. Before: a full disk was exit 2 for a checkpoint only; a file-size limit (and so a full
quota) was exit 1 with three tracebacks, a read-only OUT_DIR a logging traceback for every line.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import subprocess
import sys

import pytest
import torch

from distribuuuu import files
from distribuuuu.run_folder import RunFolder
from tests.conftest import ROOT, TINY, env, make_cfg

COMMAND = os.path.join(os.path.dirname(sys.executable), "distribuuuu")  # the console script
TWO_EPOCHS = ["OPTIM.MAX_EPOCH", "2", "TEST.SYNTHETIC_SAMPLES", "16"]
FAULT_HOOK = ["TRAIN.HOOKS", "['tests._faults:WriteFaultAfterFirstEpoch']"]


def _train(out, *opts: str, fault: str | None = None, preexec=None) -> subprocess.CompletedProcess:
    """`distribuuuu train` of two epochs into out, with WRITE_FAULT applied after epoch 1."""
    e = env()
    if fault:
        e["WRITE_FAULT"] = fault
        opts = (*opts, *FAULT_HOOK)
    return subprocess.run([COMMAND, "train", "--cfg", TINY, "OUT_DIR", str(out), *TWO_EPOCHS, *opts], cwd=ROOT,
                          env=e, capture_output=True, text=True, timeout=300, preexec_fn=preexec)


def _one_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, one `error:` line holding every needle, no traceback anywhere; returns the line."""
    text = proc.stdout + proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert proc.returncode == 2 and len(errors) == 1, f"exit {proc.returncode}\n{text[-5000:]}"
    assert "Traceback" not in text and "Logging error" not in text, text[-5000:]
    assert all(n in errors[0] for n in needles), errors[0]
    return errors[0]


def _previous_checkpoint_intact(out) -> None:
    """Epoch 1's checkpoint is what last.pth holds, whole (it loads), and no temporary is left."""
    folder = out / "checkpoints"
    assert set(os.listdir(folder)) <= {"epoch_0001.pth", "last.pth", "best.pth"}, sorted(os.listdir(folder))
    assert torch.load(folder / "last.pth", map_location="cpu", weights_only=True)["epoch"] == 1
    assert os.path.samefile(folder / "last.pth", folder / "epoch_0001.pth")


@contextlib.contextmanager
def _mounted_tmpfs(where, size: str):
    """A tmpfs of size at where (made), unmounted after; the test is skipped where mounting is not allowed."""
    where.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        reason = f"cannot mount a tmpfs here ({done.stderr.strip() or 'mount failed'}): test not run"
        print(reason)
        pytest.skip(reason)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB OUT_DIR: one checkpoint of the tiny model (2.5 MB) and the records fit, two do not."""
    with _mounted_tmpfs(tmp_path / "out", "4m") as where:
        yield where


@pytest.fixture
def checkpoints_disk(tmp_path):
    """OUT_DIR (returned) whose checkpoints/ is a tmpfs of its own, which can be made read-only (a
    file system with a file open for writing, as OUT_DIR's log.txt, refuses that)."""
    with _mounted_tmpfs(tmp_path / "out" / "checkpoints", "64m"):
        yield tmp_path / "out"


def _without_dac_override() -> None:
    """preexec_fn: the command runs without CAP_DAC_OVERRIDE, so that permission bits bind for root too."""
    if ctypes.CDLL(None).prctl(24, 1, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, CAP_DAC_OVERRIDE
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


@pytest.mark.e2e
@pytest.mark.parametrize("limit, refused", [(256 * 1024, "checkpoints/epoch_0002.pth"), (1024, "log.txt")],
                         ids=["checkpoint", "log"])
def test_a_file_size_limit_is_exit_2_naming_the_file(tmp_path, limit, refused):
    """EFBIG: the kernel's limit, set once epoch 1 is saved (Python ignores SIGXFSZ, so the write fails
    instead of killing the process): below a checkpoint's size, epoch 2's checkpoint is refused; below
    log.txt's, its next line. Before: exit 1 and tracebacks (an OSError, not a UserError); for log.txt,
    `--- Logging error ---` and a traceback for every line, the run going on without its log."""
    out = tmp_path / "run"
    proc = _train(out, fault=f"EFBIG:{limit}")
    _one_error(proc, f"cannot write {out}/{refused}: File too large (EFBIG)", "ulimit -f", "run the same command again",
               *(["last.pth, the previous checkpoint, is intact"] if refused.endswith(".pth") else []))
    _previous_checkpoint_intact(out)


@pytest.mark.e2e
def test_a_full_disk_is_exit_2_naming_the_checkpoint_and_keeping_the_previous_one(small_disk):
    """ENOSPC on a real full file system: epoch 2's checkpoint does not fit beside epoch 1's."""
    proc = _train(small_disk)
    _one_error(proc, f"cannot write {small_disk}/checkpoints/epoch_0002.pth: No space left on device (ENOSPC)",
               "last.pth, the previous checkpoint, is intact", "free space there")
    _previous_checkpoint_intact(small_disk)


@pytest.mark.e2e
def test_a_folder_made_read_only_for_the_user_is_exit_2(tmp_path):
    """EACCES: checkpoints/ made read-only after epoch 1, for a process that permission bits bind
    (root without CAP_DAC_OVERRIDE)."""
    out = tmp_path / "run"
    try:
        proc = _train(out, fault="EACCES", preexec=_without_dac_override)
    finally:
        if (out / "checkpoints").exists():
            os.chmod(out / "checkpoints", 0o755)
    _one_error(proc, f"cannot write {out}/checkpoints/epoch_0002.pth: Permission denied (EACCES)",
               "last.pth, the previous checkpoint, is intact", "make its folder writable")
    _previous_checkpoint_intact(out)


@pytest.mark.e2e
def test_a_read_only_file_system_is_exit_2_naming_the_checkpoint(checkpoints_disk):
    """EROFS: the file system of checkpoints/ remounted read-only after epoch 1."""
    out = checkpoints_disk
    proc = _train(out, fault="EROFS")
    _one_error(proc, f"cannot write {out}/checkpoints/epoch_0002.pth: Read-only file system (EROFS)",
               "last.pth, the previous checkpoint, is intact", "remount the file system read-write")
    _previous_checkpoint_intact(out)


@pytest.mark.e2e
def test_a_run_folder_removed_mid_run_is_exit_2(tmp_path):
    """ENOENT: OUT_DIR removed after epoch 1 (log.txt's open file takes lines still); the next record
    of epoch 2 (TensorBoard's or metrics.jsonl) cannot be made, and the run does not recreate the folder."""
    out = tmp_path / "run"
    proc = _train(out, fault="ENOENT")
    line = _one_error(proc, "No such file or directory (ENOENT)", "its folder was removed during the run")
    assert line.startswith(f"error: cannot write {out}/"), line
    assert not out.exists()


def test_a_full_quota_is_the_same_one_line(tmp_path):
    """EDQUOT, which no test machine has to hand: the same mapping, through a checkpoint whose write
    fails with it (the pickler raises while torch.save writes), and through a record's rewrite."""
    def over_quota(*_):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    class OverQuota:
        def __reduce__(self):
            over_quota()

    folder = RunFolder(make_cfg({"OUT_DIR": str(tmp_path)}))
    first = folder.save({"model": {"w": torch.ones(3)}, "epoch": 1}, is_best=False)
    with pytest.raises(files.WriteFailed) as caught:
        folder.save({"model": {}, "epoch": 2, "boom": OverQuota()}, is_best=False)
    assert str(caught.value) == (
        f"cannot write {tmp_path}/checkpoints/epoch_0002.pth: Disk quota exceeded (EDQUOT); last.pth, the previous "
        "checkpoint, is intact; free space within your quota, or give another OUT_DIR, and run the same command again")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["epoch_0001.pth", "last.pth"]
    assert os.path.samefile(first, tmp_path / "checkpoints" / "last.pth")
    with pytest.raises(files.WriteFailed, match=r"cannot write .*metrics.csv: Disk quota exceeded \(EDQUOT\)"):
        files.atomic_write(str(tmp_path / "metrics.csv"), over_quota)
    assert sorted(os.listdir(tmp_path)) == ["checkpoints"]  # no temporary left


def test_an_error_that_is_not_the_users_to_fix_stays_what_it_was(tmp_path):
    """An input/output error (a failing disk) is a crash, with its traceback, not a bad setting."""
    def broken(*_):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with pytest.raises(OSError) as caught:
        files.atomic_write(str(tmp_path / "x"), broken)
    assert not isinstance(caught.value, files.WriteFailed) and caught.value.errno == errno.EIO

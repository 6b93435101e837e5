"""A checkpoint that does not fit on the disk, on a real full file system (a small tmpfs, mounted
for the test): one line naming "No space left on device", the folder, and what
is really kept; no temporary left. Needs mount rights (root); skipped with the reason otherwise."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from distribuuuu.errors import UserError
from distribuuuu.run_folder import RunFolder
from tests.conftest import make_cfg

pytestmark = pytest.mark.e2e  # mount and umount are processes


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs at tmp_path/disk."""
    where = tmp_path / "disk"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        reason = f"cannot mount a small tmpfs here ({done.stderr.strip() or 'mount failed'}): disk-full test not run"
        print(reason)
        pytest.skip(reason)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def _state(numbers: int, samples: int = 0) -> dict:
    return {"model": {"w": torch.ones(numbers)}, "epoch": 1, "samples_in_epoch": samples, "global_step": 4}


def _folder(out_dir: str) -> RunFolder:
    return RunFolder(make_cfg({"OUT_DIR": out_dir, "TRAIN.CKPT_KEEP": 3}))


def test_disk_full_with_no_checkpoint_says_none_is_kept(small_disk):
    """Before: OSError 'writing checkpoint ... failed (RuntimeError: unexpected pos ...); the previous
    checkpoint is intact' when there was none."""
    with pytest.raises(UserError) as caught:
        _folder(str(small_disk)).save(_state(200_000), is_best=False)  # 800 KB > 256 KiB
    message = str(caught.value)
    assert "No space left on device" in message and str(small_disk / "checkpoints") in message, message
    assert "no checkpoint of this run is kept" in message and "\n" not in message, message
    assert os.listdir(small_disk / "checkpoints") == []  # no temporary left behind


def test_disk_full_after_a_checkpoint_keeps_it(small_disk):
    folder = _folder(str(small_disk))
    first = folder.save(_state(1000), is_best=False)
    with pytest.raises(UserError) as caught:
        folder.save(_state(200_000, samples=16), is_best=False)
    assert "No space left on device" in str(caught.value) and "last.pth, the previous checkpoint, is intact" in str(caught.value)
    assert sorted(os.listdir(small_disk / "checkpoints")) == sorted([os.path.basename(first), "last.pth"])
    assert torch.load(small_disk / "checkpoints" / "last.pth", weights_only=True)["model"]["w"].numel() == 1000
    ckpt, path = folder.latest()  # what a re-run resumes from
    assert os.path.samefile(path, first) and ckpt["model"]["w"].numel() == 1000

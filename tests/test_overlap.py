"""Issue 25 item 4: evaluation images that are also training images, and hard links inside a split.

Real files: hard links, symlinks and byte copies of val images put into train; a big file of a
size no val file has (never read: a spy on the digest function counts every read); the installed
command refusing a run under TRAIN.OVERLAP error (exit 2, one line).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest

from distribuuuu import data
from distribuuuu.data import checks, images
from distribuuuu.errors import UserError
from tests.conftest import ROOT, TINY, check, env, make_cfg, write_image_tree


def _tree(root) -> str:
    """root/train (classes 0, 1, 2 of 4 images) and root/val (2 each), every image distinct."""
    write_image_tree(str(root), "train", {"0": 4, "1": 4, "2": 4}, size=(10, 10))
    write_image_tree(str(root), "val", {"0": 2, "1": 2, "2": 2}, size=(9, 11))  # another size: other bytes
    return str(root)


def _cfg(root: str, **extra) -> object:
    return make_cfg({"TRAIN.DATASET": root, "TEST.DATASET": root, "MODEL.NUM_CLASSES": 3, "TRAIN.TOPK": 1,
                     "TRAIN.IM_SIZE": 8, "TEST.IM_SIZE": 8, "TRAIN.BATCH_SIZE": 2, "TEST.BATCH_SIZE": 3,
                     "TRAIN.WORKERS": 0, **extra})


def _leak(root: str) -> None:
    """val/0/0.png hard-linked, val/1/0.png symlinked and val/2/1.png copied into train."""
    val, train = os.path.join(root, "val"), os.path.join(root, "train")
    os.link(os.path.join(val, "0", "0.png"), os.path.join(train, "0", "hard.png"))
    os.symlink(os.path.join(val, "1", "0.png"), os.path.join(train, "1", "soft.png"))
    shutil.copyfile(os.path.join(val, "2", "1.png"), os.path.join(train, "2", "copy.png"))


def test_hard_link_symlink_and_copy_of_val_images_are_each_reported(tmp_path, caplog):
    root = _tree(tmp_path / "ds")
    checks.check_overlap(_cfg(root), is_main=True)  # a clean pair of splits: no warning
    assert not [r for r in caplog.records if "TEST.DATASET" in r.getMessage()]
    _leak(root)
    with caplog.at_level(logging.WARNING, logger="distribuuuu"):
        checks.check_overlap(_cfg(root), is_main=True)
    [line] = [r.getMessage() for r in caplog.records if "also in TEST.DATASET" in r.getMessage()]
    assert line.startswith("3 image(s) of TRAIN.DATASET are also in TEST.DATASET (1 hard link, 1 symlink, "
                           "1 same bytes)"), line
    for example in ("train/0/hard.png is val/0/0.png (hard link)", "train/1/soft.png is val/1/0.png (symlink)",
                    "train/2/copy.png is val/2/1.png (same bytes)"):
        assert example in line, (example, line)
    with pytest.raises(UserError, match=r"^3 image\(s\) of TRAIN.DATASET are also in TEST.DATASET"):
        checks.check_overlap(_cfg(root, **{"TRAIN.OVERLAP": "error"}), is_main=True)
    caplog.clear()
    checks.check_overlap(_cfg(root, **{"TRAIN.OVERLAP": "off"}), is_main=True)
    assert not caplog.records


def test_only_files_of_a_size_the_other_split_has_are_read(tmp_path, monkeypatch):
    root = _tree(tmp_path / "ds")
    _leak(root)
    big = os.path.join(root, "train", "0", "big.png")
    with open(big, "wb") as f:  # a size no val image has: it must never be opened
        f.write(os.urandom(3 << 20))
    near = os.path.join(root, "train", "1", "near.png")  # the size of a val image, other bytes
    val_file = os.path.join(root, "val", "1", "1.png")
    with open(near, "wb") as f:
        f.write(os.urandom(os.path.getsize(val_file)))
    for split in ("train", "val"):  # two empty (unreadable) files: the same bytes, but not a copied image
        open(os.path.join(root, split, "0", "empty.png"), "wb").close()
    read = []
    real_digest = checks.digest
    monkeypatch.setattr(checks, "digest", lambda path: read.append(path) or real_digest(path))
    found = checks.find(*(sorted(p for p, _ in images.list_split(os.path.join(root, s), list("012"))
                                  .samples()) for s in ("train", "val")))
    assert sorted(h for *_, h in found.pairs) == ["hard link", "same bytes", "symlink"]
    assert big not in read and near in read
    # Train images are 10x10, val 9x11: distinct sizes, so only the copy, near.png and the val files
    # of their sizes are read (hard and symbolic links are found by their inode, unread).
    train_read = {p for p in read if os.sep + "train" + os.sep in p}
    assert train_read == {os.path.join(root, "train", "2", "copy.png"), near}, train_read


def test_files_sharing_a_size_and_a_header_are_each_read_once(tmp_path, monkeypatch):
    """Same-size files that share their first 4 KiB (raw images of one format) are grouped by a hash of the
    whole file: each is read once, however many share a size (a pairwise comparison would be quadratic)."""
    header, paths = os.urandom(4096), {"train": [], "val": []}
    for split, n in (("train", 300), ("val", 100)):
        os.makedirs(tmp_path / split)
        for i in range(n):
            path = tmp_path / split / f"{i}.ppm"
            path.write_bytes(header + os.urandom(100))
            paths[split].append(str(path))
    for i in (3, 50):
        shutil.copyfile(paths["val"][i], tmp_path / "train" / f"copy{i}.ppm")
        paths["train"].append(str(tmp_path / "train" / f"copy{i}.ppm"))
    read = []
    real_digest = checks.digest
    monkeypatch.setattr(checks, "digest", lambda path: read.append(path) or real_digest(path))
    found = checks.find(paths["train"], paths["val"])
    assert sorted((os.path.basename(a), os.path.basename(b), how) for a, b, how in found.pairs) == [
        ("copy3.ppm", "3.ppm", "same bytes"), ("copy50.ppm", "50.ppm", "same bytes")]
    assert sorted(read) == sorted(paths["train"] + paths["val"]) and found.read == len(read) == 402


def test_hard_links_inside_train_are_refused_like_symlinks(tmp_path):
    root = _tree(tmp_path / "ds")
    train = os.path.join(root, "train")
    os.link(os.path.join(train, "0", "1.png"), os.path.join(train, "2", "again.png"))
    with pytest.raises(UserError, match=r"1 image file\(s\) in .* symlinks or hard links.*2/again.png is 0/1.png"):
        data.check_datasets(_cfg(root), 1)
    # through a symlink to another hard link of a listed file: the same file too
    os.remove(os.path.join(train, "2", "again.png"))
    outside = tmp_path / "outside.png"
    os.link(os.path.join(train, "0", "1.png"), outside)
    os.symlink(str(outside), os.path.join(train, "1", "via.png"))
    with pytest.raises(UserError, match=r"1 image file\(s\).*1/via.png is 0/1.png"):
        data.check_datasets(_cfg(root), 1)
    data.check_datasets(_cfg(root, **{"TRAIN.DUPLICATE_IMAGES": "keep"}), 1)  # deliberate oversampling


@pytest.mark.e2e
def test_overlap_error_is_exit_2_with_one_line_from_the_installed_command(tmp_path):
    root = _tree(tmp_path / "ds")
    _leak(root)
    command = os.path.join(os.path.dirname(sys.executable), "distribuuuu")  # the console script
    args = [command, "train", "--cfg", TINY, "TRAIN.DATASET", root, "TEST.DATASET", root, "MODEL.NUM_CLASSES", "3",
            "TRAIN.TOPK", "1", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8", "TRAIN.BATCH_SIZE", "4",
            "TEST.BATCH_SIZE", "3", "OPTIM.MAX_EPOCH", "1", "NUM_THREADS", "1"]
    out = tmp_path / "refused"
    proc = subprocess.run([*args, "OUT_DIR", str(out), "TRAIN.OVERLAP", "error"], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=240)
    check(proc, 2)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: 3 image(s) of TRAIN.DATASET are also in TEST.DATASET"), \
        proc.stderr
    assert "TRAIN.OVERLAP error" in lines[0] and not out.exists()  # refused: no run folder left
    # warn (the default): the run goes on, and log.txt says it once with the examples
    out = tmp_path / "warned"
    check(subprocess.run([*args, "OUT_DIR", str(out)], cwd=ROOT, env=env(), capture_output=True, text=True,
                         timeout=240))
    log = (out / "log.txt").read_text()
    assert log.count("3 image(s) of TRAIN.DATASET are also in TEST.DATASET") == 1, log[-3000:]
    assert "train/0/hard.png is val/0/0.png (hard link)" in log


@pytest.mark.e2e
def test_overlap_error_on_two_ranks_ends_both_without_a_hang_and_leaves_no_folder(tmp_path):
    """Rank 0 looks, rank 1 waits for its verdict (a broadcast): both end with exit 2 and their line."""
    root = _tree(tmp_path / "ds")
    _leak(root)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "distribuuuu", "train", "--nproc-per-node", "2", "--cfg", TINY,
                           "TRAIN.DATASET", root, "TEST.DATASET", root, "MODEL.NUM_CLASSES", "3", "TRAIN.TOPK", "1",
                           "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8", "TRAIN.BATCH_SIZE", "2", "TEST.BATCH_SIZE", "3",
                           "OPTIM.MAX_EPOCH", "1", "NUM_THREADS", "1", "OUT_DIR", str(out), "TRAIN.OVERLAP", "error"],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240)
    check(proc, 2)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert sorted(ln.split(":")[0] for ln in lines) == ["error", "error (rank 1)"], proc.stderr
    assert all("3 image(s) of TRAIN.DATASET are also in TEST.DATASET" in ln for ln in lines), lines
    assert not out.exists(), os.listdir(out)  # the spawner's preflight made it; the refusal took it away

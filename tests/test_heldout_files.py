"""The held-out split on disk (issue #47): a run with TRAIN.VAL_SPLIT lists the held-out files in
OUT_DIR/heldout.txt, exactly those its val records count, and `distribuuuu data split RUN_DIR DEST` lays
the same split out as DEST/train/<class>/ and DEST/val/<class>/ of symlinks, for a folder of class folders
and for a label file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torchvision.datasets import ImageFolder

from distribuuuu import data, run_folder
from distribuuuu.data import holdout, split_files
from distribuuuu.errors import UserError
from tests.conftest import check, check_user_error, env, make_cfg, read_metrics, write_image


def linked(dest, part: str) -> dict[str, str]:
    """{the real file: its class} of every link under dest/part/<class>/."""
    found = {}
    for cls in sorted(os.listdir(dest / part)):
        for name in os.listdir(dest / part / cls):
            link = dest / part / cls / name
            assert os.path.islink(link) and os.path.isabs(os.readlink(link))
            found[os.readlink(link)] = cls
    return found


# ---------------------------------------------------------------------------------------------
# A label file (in-process)
# ---------------------------------------------------------------------------------------------
def test_a_label_files_held_out_rows_are_listed_and_split_into_class_folders(tmp_path):
    rows = ["file_name,label"]
    for i in range(30):  # images/sub0, images/sub1: nested, as a Kaggle folder may be
        write_image(str(tmp_path / "set" / "images" / f"sub{i % 2}" / f"{i}.png"), (12, 12), "RGB", i)
        rows.append(f"images/sub{i % 2}/{i}.png,{'xyz'[i % 3]}")
    (tmp_path / "set" / "labels.csv").write_text("\n".join(rows) + "\n")
    run = tmp_path / "run"
    cfg = make_cfg("TRAIN.DATASET", tmp_path / "set" / "labels.csv", "TRAIN.WORKERS", 0, "TRAIN.IM_SIZE", 32,
                   "OUT_DIR", run)
    assert cfg.TRAIN.VAL_SPLIT == 0.1
    val = data.build_val_loader(cfg, 0, 1, torch.device("cpu")).dataset
    listed = split_files.heldout_files(cfg, val)
    labels = [row.split(",")[1] for row in rows[1:]]
    held = holdout.holdout_indices(np.unique(labels, return_inverse=True)[1], 0.1)[1]
    assert listed == [rows[1 + i].split(",")[0] for i in held] and 0 < len(listed) < 30
    os.makedirs(run)
    (run / "config.yaml").write_text(cfg.dump())
    run_folder.RunFolder(cfg).write_heldout(listed)
    assert (run / run_folder.HELDOUT).read_text() == "".join(f"{p}\n" for p in listed)
    counts = split_files.split_out(str(run), str(tmp_path / "dest"))
    assert counts == {"train": 30 - len(held), "val": len(held), "classes": 3}
    val_links = linked(tmp_path / "dest", "val")
    assert val_links == {str(tmp_path / "set" / p): labels[i] for p, i in zip(listed, held)}
    assert os.listdir(tmp_path / "dest" / "val" / labels[held[0]])[0].startswith("images_sub")  # one level
    from timm.data import create_dataset  # what a timm user loads: `train.py --data-dir dest`

    for split, n in (("train", 30 - len(held)), ("validation", len(held))):
        loaded = create_dataset("", root=str(tmp_path / "dest"), split=split)
        assert len(loaded) == n and loaded.reader.class_to_idx == {"x": 0, "y": 1, "z": 2}


def test_split_out_refuses_what_it_cannot_split(tmp_path):
    os.makedirs(tmp_path / "dest" / "x")
    with pytest.raises(UserError, match="not empty"):
        split_files.split_out(str(tmp_path), str(tmp_path / "dest"))
    with pytest.raises(UserError, match="not a run folder"):
        split_files.split_out(str(tmp_path), str(tmp_path / "new"))


# ---------------------------------------------------------------------------------------------
# e2e: a run on a flat folder, its list, `data split`, and eval of the split's val/
# ---------------------------------------------------------------------------------------------
def user_command(*args: str, cwd) -> subprocess.CompletedProcess:
    """The installed console script, run from cwd (a folder outside the checkout)."""
    exe = os.path.join(os.path.dirname(sys.executable), "distribuuuu")
    return subprocess.run([exe, *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=300)


@pytest.mark.e2e
def test_a_flat_folder_run_lists_its_held_out_files_and_data_split_lays_them_out(tmp_path):
    for c, n in {"ant": 20, "bee": 14, "cat": 9}.items():
        for i in range(n):
            write_image(str(tmp_path / "photos" / c / f"{i:02d}.png"), (16, 16), "RGB", 100 * len(c) + i)
    check(user_command("train", "TRAIN.DATASET", "photos", "OPTIM.MAX_EPOCH", "1", "TRAIN.BATCH_SIZE", "8",
                       "TRAIN.WORKERS", "0", "NUM_THREADS", "1", "OUT_DIR", "run", "--nproc-per-node", "2",
                       cwd=tmp_path))  # rank 0 lists the whole part, not its shard of it
    lines = (tmp_path / "run" / "heldout.txt").read_text().splitlines()
    val = [r for r in read_metrics(str(tmp_path / "run")) if r["split"] == "val"]
    samples = ImageFolder(str(tmp_path / "photos")).samples  # the listing, independently of distribuuuu
    held = holdout.holdout_indices(np.array([t for _, t in samples]), 0.1)[1]
    assert val[0]["n"] == len(lines) == len(held) > 0
    assert set(lines) == {os.path.relpath(samples[i][0], tmp_path / "photos") for i in held}

    proc = check(user_command("data", "split", "run", "split", cwd=tmp_path))
    assert proc.stdout.strip() == f"wrote the split of run to split: train {43 - len(held)}, val {len(held)} " \
                                  "images of 3 classes (symlinks to the run's images)"
    val_links, train_links = linked(tmp_path / "split", "val"), linked(tmp_path / "split", "train")
    assert set(val_links) == {str(tmp_path / "photos" / p) for p in lines}
    assert len(train_links) == 43 - len(held) and not set(train_links) & set(val_links)
    assert all(cls == os.path.basename(os.path.dirname(p)) for p, cls in {**val_links, **train_links}.items())
    check_user_error(user_command("data", "split", "run", "split", cwd=tmp_path), "split", "not empty")

    # the split's val/ is the part the run held out: eval scores it as the run's val record did
    check(user_command("eval", "--checkpoint", "run/checkpoints/best.pth", "TEST.DATASET", "split/val",
                       cwd=tmp_path))
    with open(tmp_path / "run" / "eval.jsonl") as f:
        record = json.loads(f.readline())
    assert (record["n"], record["top1"]) == (val[0]["n"], val[0]["top1"])

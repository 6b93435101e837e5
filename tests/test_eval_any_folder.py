"""Scoring a labelled folder, whatever split the model was trained with (issue #47): a TEST.DATASET of
class folders without the TEST.SPLIT sub-folder is scored whole, classes the model lacks are one line
and exit 2, and `predict` on such a folder names the `eval` command that scores it. The e2e tests run
the installed command from a folder outside the checkout."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from distribuuuu import data, inferred
from distribuuuu.errors import UserError
from tests.conftest import check, check_user_error, env, make_cfg, write_image_tree


def _decided(cfg) -> dict[str, inferred.Decision]:
    return {d.key: d for d in inferred.decisions(cfg)}


def split_tree(root) -> str:
    """root/train and root/val: what a run trained on train/ + val/ stores TEST.SPLIT 'val' for."""
    write_image_tree(str(root), "train", {"a": 8, "b": 8, "c": 8}, size=(16, 16))
    write_image_tree(str(root), "val", {"a": 2, "b": 2, "c": 2}, size=(16, 16))
    return str(root)


# ---------------------------------------------------------------------------------------------
# The decision (in-process)
# ---------------------------------------------------------------------------------------------
def test_a_test_folder_of_class_folders_without_the_split_is_scored_whole(tmp_path):
    train = split_tree(tmp_path / "data")
    write_image_tree(str(tmp_path / "new"), "", {"a": 2, "c": 3})
    cfg = make_cfg("TRAIN.DATASET", train, "TEST.DATASET", tmp_path / "new")
    assert cfg.TEST.SPLIT == ""
    line = _decided(cfg)["TEST.SPLIT"].line()
    assert line == f"TEST.SPLIT '' (from the folder: {tmp_path / 'new'} holds 2 class folders and no val/, " \
                   "so it is scored whole)"
    assert len(data.build_test_loader(cfg, 0, 1, torch.device("cpu")).dataset) == 5


def test_a_split_folder_is_scored_by_its_val_when_test_split_is_empty(tmp_path):
    write_image_tree(str(tmp_path / "flat"), "", {"a": 10, "b": 10})
    split = split_tree(tmp_path / "split")
    cfg = make_cfg("TRAIN.DATASET", tmp_path / "flat", "TEST.DATASET", split, "TEST.SPLIT", "''")
    assert cfg.TEST.SPLIT == "val" and "holds val/" in _decided(cfg)["TEST.SPLIT"].origin


def test_the_split_is_kept_where_it_exists_or_the_folder_has_no_class_folders(tmp_path):
    train = split_tree(tmp_path / "data")
    cfg = make_cfg("TRAIN.DATASET", train)
    assert cfg.TEST.SPLIT == "val" and "TEST.SPLIT" not in _decided(cfg)
    os.makedirs(tmp_path / "loose")
    write_image_tree(str(tmp_path), "loose", {"x": 1})
    os.rename(tmp_path / "loose" / "x" / "0.png", tmp_path / "loose" / "0.png")
    os.rmdir(tmp_path / "loose" / "x")  # images, no class folders: nothing to score as classes
    cfg = make_cfg("TRAIN.DATASET", train, "TEST.DATASET", tmp_path / "loose")
    assert cfg.TEST.SPLIT == "val"
    with pytest.raises(UserError, match=r"no folder .*loose/val.*TEST.SPLIT '' reads <DATASET>/<class>/<image>"):
        data.check_datasets(cfg, 1, train=False)


# ---------------------------------------------------------------------------------------------
# e2e: a run on train/ + val/, then eval and predict of other folders
# ---------------------------------------------------------------------------------------------
def user_command(*args: str, cwd) -> subprocess.CompletedProcess:
    """The installed console script, run from cwd (a folder outside the checkout)."""
    exe = os.path.join(os.path.dirname(sys.executable), "distribuuuu")
    return subprocess.run([exe, *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-epoch run on data/train + data/val (its stored TEST.SPLIT is 'val'), in a user's folder."""
    home = tmp_path_factory.mktemp("user")
    split_tree(home / "data")
    check(user_command("train", "TRAIN.DATASET", "data", "OPTIM.MAX_EPOCH", "1", "TRAIN.BATCH_SIZE", "8",
                       "TRAIN.WORKERS", "0", "NUM_THREADS", "1", "OUT_DIR", "run", cwd=home))
    return home


@pytest.mark.e2e
def test_eval_of_another_class_folder_scores_every_image_and_predict_names_the_command(trained):
    home = trained
    write_image_tree(str(home / "new"), "", {"a": 3, "c": 4}, mode="glyph", size=(20, 20))  # not the run's bytes
    predicted = check(user_command("predict", "--checkpoint", "run/checkpoints/best.pth", "new", cwd=home))
    hint = predicted.stdout.strip().splitlines()[-1]
    assert hint.startswith("new holds class folders, 2 of the model's 3 classes: `"), predicted.stdout[-2000:]
    command = shlex.split(re.search(r"`(.*)`", hint).group(1))
    assert command == ["distribuuuu", "eval", "--checkpoint", "run/checkpoints/best.pth", "TEST.DATASET", "new"]
    proc = check(user_command(*command[1:], cwd=home))  # the command as printed
    log = proc.stdout + proc.stderr
    assert "setup: TEST.SPLIT '' (from the folder: new holds 2 class folders and no val/" in log
    assert "RNG_SEED is None" not in log  # an evaluation draws nothing that matters
    with open(home / "run" / "eval.jsonl") as f:
        record = json.loads(f.readlines()[-1])
    assert record["n"] == 7


@pytest.mark.e2e
def test_eval_of_a_folder_with_a_class_the_model_lacks_is_one_line(trained):
    write_image_tree(str(trained / "odd"), "", {"a": 2, "zebra": 2}, mode="glyph")
    proc = user_command("eval", "--checkpoint", "run/checkpoints/best.pth", "TEST.DATASET", "odd", cwd=trained)
    line = check_user_error(proc, "not classes of the model", "zebra")
    assert "a, b, c" in line

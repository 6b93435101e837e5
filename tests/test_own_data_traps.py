"""One's own folder with a shipped config, a checkpoint used from elsewhere, small data: what would mislead
without a word. A shipped config's TEST.DATASET follows a TRAIN.DATASET the command line replaced; the
dataset paths are stored absolute, so eval finds the held-out part from any folder; evaluating the whole
training folder counts its training images; a small evaluation set and a top-k that would always be 100%
get a line; the first progress line comes after the first step; a fine-tune's shape error names the
architecture the checkpoint's card records."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import sys
import time

import pytest
import yaml

from distribuuuu import api, data, inference, inferred, logger, models, weights
from distribuuuu.errors import UserError
from distribuuuu.inferred.data import training_data_is_test_data
from tests.conftest import make_cfg, write_image_tree

CLASSES = {"ant": 20, "bee": 20, "cat": 20}  # a fifth of a class under 25 held out: 12 images
HELD = 12


def decisions(cfg) -> dict[str, inferred.Decision]:
    return {d.key: d for d in inferred.decisions(cfg)}


def own_folder(root) -> str:
    """A folder of class folders (no train/ or val/), as a user writes one."""
    write_image_tree(str(root), "", CLASSES, mode="L", size=(8, 8))
    return str(root)


# ---------------------------------------------------------------------------------------------
# A shipped config with one's own TRAIN.DATASET
# ---------------------------------------------------------------------------------------------
def test_a_config_files_test_dataset_follows_the_train_dataset_the_command_line_gives(tmp_path):
    faces = own_folder(tmp_path / "faces")
    cfg = make_cfg("TRAIN.DATASET", faces, "MODEL.NUM_CLASSES", 0, base="mnist5k_fast")
    # not mnist5k (the file's): the folder's own held-out tenth
    assert (cfg.TEST.DATASET, cfg.TEST.SPLIT, cfg.TRAIN.VAL_SPLIT) == (faces, "", 0.1)
    assert training_data_is_test_data(cfg)
    line = decisions(cfg)["TEST.DATASET"].line()
    assert line.startswith("TEST.DATASET follows TRAIN.DATASET") and "'mnist5k'" in line, line

    # What the user states is kept: a TEST.DATASET on the command line, and a file's TRAIN.DATASET left alone
    kept = make_cfg("TRAIN.DATASET", faces, "TEST.DATASET", "mnist5k", "MODEL.NUM_CLASSES", 0, base="mnist5k_fast",
                    resolve=False)
    assert kept.TEST.DATASET == "mnist5k"
    assert make_cfg(base="mnist5k_fast", resolve=False).TEST.DATASET == "mnist5k"


def test_a_folder_with_a_val_folder_follows_with_its_val_split(tmp_path):
    root = tmp_path / "own"
    write_image_tree(str(root), "train", {"a": 4, "b": 4}, size=(8, 8))
    write_image_tree(str(root), "val", {"a": 2, "b": 2}, size=(8, 8))
    cfg = make_cfg("TRAIN.DATASET", root, "MODEL.NUM_CLASSES", 0, "TRAIN.DATA_PIPELINE", "auto", base="mnist5k_fast")
    assert (cfg.TEST.DATASET, cfg.TEST.SPLIT) == (str(root), "val")


# ---------------------------------------------------------------------------------------------
# A trained checkpoint, used from another folder
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of the shipped mnist5k_fast (resnet_tiny, 1 channel) on ./faces (a relative path), trained
    from its parent folder: (that folder, best.pth)."""
    work = tmp_path_factory.mktemp("user")
    own_folder(work / "faces")
    before = os.getcwd()
    os.chdir(work)
    try:
        cfg = make_cfg("TRAIN.DATASET", "faces", "MODEL.NUM_CLASSES", 0, "TRAIN.DATA_PIPELINE", "auto",
                       "TRAIN.IM_SIZE", 8, "TEST.IM_SIZE", 8, "TRAIN.BATCH_SIZE", 18, "TEST.BATCH_SIZE", 18,
                       "OPTIM.MAX_EPOCH", 1, "OUT_DIR", "runs/faces", base="mnist5k_fast")
        api.train(cfg)
    finally:
        os.chdir(before)
    return work, str(work / "runs" / "faces" / "checkpoints" / "best.pth")


def test_a_shipped_configs_run_on_ones_own_folder_validates_on_its_held_out_part(trained):
    work, _ = trained
    rows = [json.loads(line) for line in open(work / "runs" / "faces" / "metrics.jsonl")]
    assert [r["n"] for r in rows if r.get("split") == "val"] == [HELD]  # not mnist5k's 1,000 digits


def test_dataset_paths_are_stored_absolute_and_eval_finds_the_held_out_part_from_elsewhere(trained, tmp_path,
                                                                                            monkeypatch):
    work, best = trained
    with open(work / "runs" / "faces" / "config.yaml") as f:
        stored = yaml.safe_load(f)
    assert stored["TRAIN"]["DATASET"] == stored["TEST"]["DATASET"] == str(work / "faces")
    monkeypatch.chdir(tmp_path)  # a folder without faces/
    record = api.evaluate(inference.load_config(None, ["MODEL.WEIGHTS", best, "OUT_DIR", str(tmp_path / "ev")]))
    assert record["n"] == HELD
    # The same folder spelled otherwise (a trailing slash) is still the training data: its held-out part
    again = inference.load_config(None, ["MODEL.WEIGHTS", best, "OUT_DIR", str(tmp_path / "ev"),
                                         "TEST.DATASET", str(work / "faces") + "/"])
    assert api.evaluate(again)["n"] == HELD


def test_evaluating_a_copy_of_the_training_folder_counts_its_training_images(trained, tmp_path):
    work, best = trained
    shutil.copytree(work / "faces", tmp_path / "faces_copy")
    cfg = inference.load_config(None, ["MODEL.WEIGHTS", best, "OUT_DIR", str(tmp_path / "ev"),
                                       "TEST.DATASET", str(tmp_path / "faces_copy")])
    record = api.evaluate(cfg)
    assert record["n"] == sum(CLASSES.values())
    log = (tmp_path / "ev" / "log.txt").read_text()
    trained_on = sum(CLASSES.values()) - HELD  # the held-out images are not training images
    assert f"{trained_on} image(s) of TRAIN.DATASET are also in TEST.DATASET ({trained_on} same bytes)" in log, log
    with pytest.raises(UserError, match=f"{trained_on} image"):  # TRAIN.OVERLAP error refuses it
        api.evaluate(inference.load_config(None, ["MODEL.WEIGHTS", best, "OUT_DIR", str(tmp_path / "ev2"),
                                                  "TEST.DATASET", str(tmp_path / "faces_copy"),
                                                  "TRAIN.OVERLAP", "error"]))


def test_a_fine_tunes_shape_error_names_the_architecture_of_the_checkpoints_card(trained):
    _, best = trained
    cfg = make_cfg("MODEL.ARCH", "resnet18", "MODEL.IN_CHANS", 3, "MODEL.NUM_CLASSES", 3, "MODEL.WEIGHTS", best, resolve=False)
    model = models.build_model(cfg, with_weights=False)
    with pytest.raises(UserError, match="trained as MODEL.ARCH resnet_tiny MODEL.IN_CHANS 1 MODEL.NUM_CLASSES 3"):
        weights.load_file(model, best, "MODEL.WEIGHTS", new_head=True, adapt_stem=False)


# ---------------------------------------------------------------------------------------------
# Small data: a small evaluation set, a top-k of every class
# ---------------------------------------------------------------------------------------------
def test_a_small_evaluation_set_gets_a_line_saying_how_uncertain_top1_is(tmp_path):
    faces = own_folder(tmp_path / "faces")
    cfg = make_cfg("TRAIN.DATASET", faces, "MODEL.NUM_CLASSES", 0, "TRAIN.BATCH_SIZE", 4)
    (note,) = data.check_datasets(cfg, 1)
    assert note.startswith(f"evaluation set {HELD} images (the part TRAIN.VAL_SPLIT holds out)"), note
    assert "+-28 points" in note  # 1.96 x 50% / sqrt(12)
    assert data.check_datasets(cfg, 1, train=False)[0] == note  # eval scores the same part

    big = tmp_path / "big"
    write_image_tree(str(big), "", {"a": 250, "b": 250}, mode="L", size=(4, 4))
    assert data.check_datasets(make_cfg("TRAIN.DATASET", big, "MODEL.NUM_CLASSES", 0, "TRAIN.BATCH_SIZE", 4), 1) == []


def test_top_k_stays_below_the_class_count(tmp_path):
    write_image_tree(str(tmp_path / "two"), "", {"a": 3, "b": 3}, size=(8, 8))
    cfg = make_cfg("TRAIN.DATASET", tmp_path / "two", "MODEL.NUM_CLASSES", 0)
    assert cfg.TRAIN.TOPK == 1  # top-2 of 2 classes would be 100% whatever the model
    assert decisions(cfg)["TRAIN.TOPK"].line() == (
        "TRAIN.TOPK 1 (clamped from 5: top-5 of 2 classes would always be 100%, saying nothing)")
    assert make_cfg("MODEL.NUM_CLASSES", 10, "TRAIN.DATASET", "synthetic").TRAIN.TOPK == 5


def test_lines_show_top_1_once_where_top_k_is_1():
    """Two classes clamp TRAIN.TOPK to 1: the lines show top-1, not top-1 twice."""
    assert logger.accuracies(90.0, 1, 90.0) == "acc@1 90.00"
    assert logger.accuracies(90.0, 5, 99.5, "top-", "%") == "top-1 90.00% | top-5 99.50%"


# ---------------------------------------------------------------------------------------------
# The first progress line
# ---------------------------------------------------------------------------------------------
def _lines(monkeypatch, tmp_path, epoch: int, sleep: float = 0.0) -> list[str]:
    monkeypatch.setenv(logger.PROGRESS_ENV, "lines")
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    logger.setup_logging(str(tmp_path), is_main=True)
    cfg = make_cfg("TRAIN.PRINT_FREQ", 1000, resolve=False)
    progress = logger.Progress(cfg, True, 1, epoch=epoch, iters=4)
    for it in range(4):
        time.sleep(sleep)
        progress.step(it, 0.0, 8, 0.1, lambda: {"loss": 1.0, "top1": 50.0, "topk_acc": 75.0})
    progress.close()
    logging.getLogger(logger.LOGGER_NAME).handlers[-1].flush()
    text = sys.stdout.getvalue()
    return [line for line in text.splitlines() if "[train]" in line]


def test_the_first_step_prints_a_line_and_then_the_clock_does(monkeypatch, tmp_path):
    first = _lines(monkeypatch, tmp_path / "a", epoch=0)
    assert ["iter 1/4" in first[0], "iter 4/4" in first[1], len(first)] == [True, True, 2], first  # not 1000 iters
    assert len(_lines(monkeypatch, tmp_path / "b", epoch=1)) == 1  # a later epoch: the end only
    monkeypatch.setattr(logger, "PRINT_SECONDS", 0.05)
    assert len(_lines(monkeypatch, tmp_path / "c", epoch=1, sleep=0.06)) == 4  # each step past the interval


def test_eval_says_when_the_training_folder_is_not_here_to_compare(trained, tmp_path):
    work, best = trained  # a checkpoint of another machine: its TRAIN.DATASET is not on this one
    cfg = inference.load_config(None, ["MODEL.WEIGHTS", best, "OUT_DIR", str(tmp_path / "ev"), "TRAIN.DATASET",
                                       str(tmp_path / "gone"), "TEST.DATASET", str(work / "faces")])
    assert api.evaluate(cfg)["n"] == sum(CLASSES.values())
    log = (tmp_path / "ev" / "log.txt").read_text()
    assert f"TRAIN.DATASET '{tmp_path / 'gone'}' is not here, so whether TEST.DATASET" in log, log


def test_a_run_stored_with_a_relative_dataset_path_still_resumes(tmp_path, monkeypatch):
    from distribuuuu.run_folder import resume_check

    monkeypatch.chdir(tmp_path)
    own_folder(tmp_path / "faces")
    write_image_tree(str(tmp_path / "other"), "", CLASSES, mode="L", size=(8, 8))
    cfg = make_cfg("TRAIN.DATASET", "faces", "MODEL.NUM_CLASSES", 0)
    assert cfg.TRAIN.DATASET == str(tmp_path / "faces")
    older = cfg.clone()
    older.defrost()
    older.TRAIN.DATASET = older.TEST.DATASET = "faces"  # as a version before absolute paths stored it
    assert resume_check.config_changes(older.dump(), cfg) == []
    older.TRAIN.DATASET = older.TEST.DATASET = "other"  # another folder is still another folder
    assert {k for k, *_ in resume_check.config_changes(older.dump(), cfg)} == {"TRAIN.DATASET", "TEST.DATASET"}

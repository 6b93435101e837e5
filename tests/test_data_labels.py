"""Label files as a source (distribuuuu/data/sources/labels.py): a Kaggle-style images/ + labels.csv,
Hugging Face ImageFolder's metadata.jsonl, 'path label' lines, a split column; every guarantee of an
image folder (held-out part, exact evaluation, step-exact resume, the preflight) and one-line refusals
naming the row."""

from __future__ import annotations

import csv
import json
import os
import sys

import pytest
import torch

from distribuuuu import data
from distribuuuu.data import sources
from distribuuuu.data.sources import labels
from distribuuuu.errors import UserError
from tests.conftest import (
    TINY,
    check,
    check_user_error,
    cli_main,
    logged,
    make_cfg,
    read_metrics,
    read_text_or_empty,
    run,
    start_until,
    stop_and_wait,
    write_glyph,
    write_image,
)

NAMES = ["cat", "dog", "owl"]


def kaggle(root, per_class: int = 12, size: tuple[int, int] = (12, 12)) -> str:
    """root/images/<id>.png and root/labels.csv (id without extension, label as a name)."""
    rows = []
    for c, name in enumerate(NAMES):
        for i in range(per_class):
            ident = f"{c}{i:03d}"
            write_glyph(str(root / "images" / f"{ident}.png"), size, seed=100 * c + i)
            rows.append((ident, name))
    with open(root / "labels.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "label"])
        writer.writerows(rows)
    return str(root / "labels.csv")


def test_a_kaggle_label_file_reads_ids_by_stem_and_names_as_sorted_classes(tmp_path):
    files = labels.label_files(kaggle(tmp_path), "", "", "")
    assert files.classes == sorted(NAMES) and len(files) == 36 and files.paths is not None
    assert all(p.endswith(".png") and os.path.isfile(p) for p in files.paths)
    assert [files.classes[t] for t in files.targets][:12] == ["cat"] * 12
    assert files.read(0) == open(files.paths[0], "rb").read()


def test_metadata_jsonl_paths_ints_and_a_split_column(tmp_path):
    """HF ImageFolder's metadata.jsonl (file_name relative to its folder), class indices named by
    classes.txt, the rows of one split."""
    for i in range(6):
        write_image(str(tmp_path / "imgs" / f"{i}.png"), (8, 8), "L", seed=i)
    with open(tmp_path / "metadata.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"file_name": f"imgs/{i}.png", "label": i % 2,
                                "split": "train" if i < 4 else "validation"}) + "\n")
    (tmp_path / "classes.txt").write_text("even\nodd\n")
    assert labels.find(str(tmp_path)) == str(tmp_path / "metadata.jsonl")
    train = labels.label_files(str(tmp_path / "metadata.jsonl"), "train", "", "")
    val = labels.label_files(str(tmp_path / "metadata.jsonl"), "val", "", "")
    assert train.classes == ["even", "odd"] and train.targets == [0, 1, 0, 1] and len(val) == 2
    assert labels.splits(str(tmp_path / "metadata.jsonl")) == {"train", "val"}


def test_path_label_lines_and_columns_named_by_the_keys(tmp_path):
    for i in range(4):
        write_image(str(tmp_path / "a" / f"{i}.jpg"), (8, 8), "RGB", seed=i)
    (tmp_path / "ann.txt").write_text("".join(f"a/{i}.jpg {i % 2}\n" for i in range(4)))
    assert labels.label_files(str(tmp_path / "ann.txt"), "", "", "").targets == [0, 1, 0, 1]
    (tmp_path / "t.csv").write_text("picture,kind\n" + "".join(f"a/{i}.jpg,k{i % 2}\n" for i in range(4)))
    with pytest.raises(UserError, match="has no image column .* its columns are picture, kind; name the image "
                                        "column with TRAIN.IMAGE_FIELD"):
        labels.label_files(str(tmp_path / "t.csv"), "", "", "")
    assert labels.label_files(str(tmp_path / "t.csv"), "", "picture", "kind").classes == ["k0", "k1"]


@pytest.mark.parametrize("row,message", [
    ("9999,dog", "line 38: no image file named '9999' with an image extension"),
    ("images/9999.png,dog", "line 38: no file"),
    ("0000,", "line 38: an empty 'label'"),
    ("0000,dog", "lines 2 and 38 give"),
])
def test_a_bad_row_is_exit_2_naming_the_file_and_line(tmp_path, row, message):
    path = kaggle(tmp_path)
    with open(path, "a") as f:
        f.write(row + "\n")
    check_user_error(cli_main("train", "--cfg", TINY, "TRAIN.DATASET", path, "TEST.DATASET", "",
                              "OUT_DIR", str(tmp_path / "run")), path, message)
    assert not (tmp_path / "run").exists()


def test_the_defaults_hold_out_a_tenth_and_the_loaders_read_the_file(tmp_path):
    cfg = make_cfg("TRAIN.DATASET", kaggle(tmp_path, per_class=20), "DEVICE", "cpu", "TRAIN.BATCH_SIZE", 4)
    assert sources.kind_of(cfg, "TRAIN") == "labels" and cfg.TRAIN.SPLIT == "" and cfg.TRAIN.VAL_SPLIT == 0.1
    assert (cfg.MODEL.NUM_CLASSES, cfg.MODEL.ARCH, cfg.MODEL.IN_CHANS, cfg.TRAIN.FLIP_PROB) == (3, "resnet_tiny", 1, 0.0)
    data.check_datasets(cfg, 1)
    train = data.build_train_loader(cfg, 0, 1, torch.device("cpu"))
    val = data.build_val_loader(cfg, 0, 1, torch.device("cpu"))
    assert (len(train.dataset), len(val.dataset)) == (48, 12)  # 4 of each class's 20 held out (a fifth)
    images, target = next(iter(train))
    assert images.shape == (4, 1, 32, 32) and target.dtype == torch.int64


@pytest.mark.e2e
def test_a_label_file_trains_on_2_processes_and_a_sigterm_resumes_to_the_straight_run(tmp_path):
    """The issue's Done-when: a flat folder with labels.csv, TRAIN.DATASET folder/labels.csv and nothing
    else but a short run; val n is the held-out rows; SIGTERM mid-epoch, the same command again: the
    straight run's metrics rows."""
    path = kaggle(tmp_path / "kag", per_class=40)
    train = [sys.executable, "-m", "distribuuuu", "train", "--nproc-per-node", "2", "TRAIN.DATASET", path,
             "OPTIM.MAX_EPOCH", "2", "TRAIN.BATCH_SIZE", "4", "TRAIN.PRINT_FREQ", "2",
             "TRAIN.CKPT_PERIOD_STEPS", "3", "RNG_SEED", "0"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    check(run([*train, "OUT_DIR", str(straight)], timeout=300))
    rows = read_metrics(str(straight))
    assert [r["n"] for r in rows if r["split"] == "val"] == [15, 15]  # 5 of each class of 40, each image once
    stop_and_wait(*start_until([*train, "OUT_DIR", str(stopped)], stopped, logged("[train] epoch 1/2 iter")))
    check(run([*train, "OUT_DIR", str(stopped)], timeout=300))
    assert "samples into epoch 1" in read_text_or_empty(stopped / "log.txt")
    measured = ("img_per_s", "time_s", "data_frac", "peak_mem_mb")

    def numbers(out) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in measured} for r in read_metrics(str(out))]

    assert numbers(stopped) == numbers(straight)

"""A run knows what it trains on. Each case is done for real, through the command: a class folder
renamed between two runs, TEST data numbering its classes otherwise than the training data, evaluation on the training split itself, an OUT_DIR inside the dataset."""

from __future__ import annotations

import hashlib
import os

import pytest

from distribuuuu.errors import UserError
from distribuuuu.run_folder import RunFolder, resume_check
from tests.conftest import TINY, check, distribuuuu, make_cfg, write_image_tree

# 16 training images of 8 x 8 in 4 classes, 2 x 4 val images; 2 steps an epoch on one process
SMALL = ["MODEL.NUM_CLASSES", "0", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8", "TRAIN.BATCH_SIZE", "8",
         "TEST.BATCH_SIZE", "8", "TRAIN.DATA_PIPELINE", "loader"]


def _data(root: str) -> str:
    write_image_tree(root, "train", {c: 4 for c in "0123"}, size=(8, 8))
    write_image_tree(root, "val", {c: 2 for c in "0123"}, size=(9, 9))  # other bytes: no overlap warning
    return root


def _train(data: str, out: str, *opts: str, status: int = 0):
    return check(distribuuuu("train", "--cfg", TINY, "TRAIN.DATASET", data, "TEST.DATASET", data, *SMALL,
                             "OUT_DIR", out, *opts), status)


def _hashes(folder: str) -> dict[str, str]:
    return {os.path.relpath(os.path.join(d, n), folder): hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest()
            for d, _, names in os.walk(folder) for n in names}


@pytest.mark.e2e
def test_a_class_renamed_between_two_runs_is_refused_on_resume(tmp_path):
    """`0` -> `zz0` in both splits: still 4 classes and 16 images, every label moved by one. Before: the
    run resumed with the labels shifted, exit 0. Now: exit 2 naming the first label that differs and
    the two ways out, the run folder byte for byte as it was."""
    data, out = _data(str(tmp_path / "data")), str(tmp_path / "run")
    _train(data, out, "OPTIM.MAX_EPOCH", "1")
    before = _hashes(out)
    for split in ("train", "val"):
        os.rename(os.path.join(data, split, "0"), os.path.join(data, split, "zz0"))
    proc = _train(data, out, "OPTIM.MAX_EPOCH", "2", status=2)
    assert "the training classes are not the checkpoint's: label 0 is '1' now, '0' when it was written" \
        in proc.stderr, proc.stderr
    assert f"OUT_DIR {out}_2 MODEL.WEIGHTS {out}/checkpoints/last.pth" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert _hashes(out) == before


def test_a_checkpoint_without_class_names_still_resumes():
    """An older checkpoint's facts hold the sizes only: it resumes; the classes are checked once recorded."""
    cfg = make_cfg({"OUT_DIR": "run"})
    now = RunFolder.data_identity(16, 8, ["0", "1", "2", "3"])
    resume_check.check_data({"train_samples": 16, "val_samples": 8}, now, cfg, "last.pth")
    resume_check.check_data({**now, "classes": ["0", "1", "2", "3"]}, now, cfg, "last.pth")
    with pytest.raises(UserError, match="label 2 is '2' now, '3' when it was written"):  # reordered
        resume_check.check_data({**now, "classes": ["0", "1", "3", "2"]}, now, cfg, "last.pth")


@pytest.mark.e2e
def test_test_data_numbering_its_classes_otherwise_is_refused(tmp_path):
    """mnist5k trains on the digits 0-9; a TEST folder without a `3` folder numbers `4` as label 3 (a folder
    is read in its own order unless the training data is a folder too). Before: evaluated against the
    wrong labels, exit 0. Now: exit 2 before anything starts, naming the first label that differs."""
    data = str(tmp_path / "digits")
    write_image_tree(data, "val", {str(d): 2 for d in range(10) if d != 3}, mode="L", size=(8, 8))
    out = tmp_path / "run"
    proc = check(distribuuuu("train", "--cfg", TINY, "TRAIN.DATASET", "mnist5k", "TEST.DATASET", data,
                             "MODEL.NUM_CLASSES", "0", "MODEL.IN_CHANS", "1", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8",
                             "TRAIN.BATCH_SIZE", "64", "OPTIM.MAX_EPOCH", "1", "OUT_DIR", str(out)), 2)
    assert (f"TEST.DATASET '{data}' numbers its classes otherwise than TRAIN.DATASET 'mnist5k': label 3 is '4' "
            "there, '3' in training") in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.e2e
def test_evaluating_on_the_training_split_is_a_warning_or_under_overlap_error_a_refusal(tmp_path):
    """TEST.SPLIT train on the TRAIN.DATASET, nothing held out. Before: "train: 16 - val: 16" and no word
    of it (the overlap check returned early for the same split). Now: one warning with the count in log.txt;
    under TRAIN.OVERLAP error, exit 2 with that line and no run folder."""
    data = _data(str(tmp_path / "data"))
    out = tmp_path / "warned"
    _train(data, str(out), "OPTIM.MAX_EPOCH", "1", "TEST.SPLIT", "train")
    line = (f"TEST.DATASET '{data}', split 'train', is the training split itself and TRAIN.VAL_SPLIT holds nothing "
            "out: all 16 evaluation images are training images")
    assert (out / "log.txt").read_text().count(line) == 1, (out / "log.txt").read_text()[-3000:]
    out = tmp_path / "refused"
    proc = _train(data, str(out), "OPTIM.MAX_EPOCH", "1", "TEST.SPLIT", "train", "TRAIN.OVERLAP", "error", status=2)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {line}"), proc.stderr
    assert not out.exists()


@pytest.mark.e2e
@pytest.mark.parametrize("key", ["TRAIN", "TEST"])
def test_an_out_dir_inside_a_dataset_is_refused_before_anything_is_written(tmp_path, key):
    """Before: accepted; the run's folder became a class of the next run on that data (`run`, with the plots
    of `distribuuuu plot` as its images). Now: exit 2 naming both, nothing written into the dataset."""
    data, other = _data(str(tmp_path / "data")), _data(str(tmp_path / "other"))
    inside = os.path.join(data if key == "TRAIN" else other, "train", "run")
    before = _hashes(str(tmp_path))
    proc = check(distribuuuu("train", "--cfg", TINY, "TRAIN.DATASET", data, "TEST.DATASET", other, *SMALL,
                             "OPTIM.MAX_EPOCH", "1", "OUT_DIR", inside), 2)
    assert f"OUT_DIR {inside} is inside {key}.DATASET" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not os.path.exists(inside)
    assert _hashes(str(tmp_path)) == before

"""A Hugging Face dataset on disk as TRAIN.DATASET (#43): a folder written by `save_to_disk` and the
same rows as Parquet files (the Hub's data/<split>-*.parquet), read by distribuuuu/data/sources/hf.py
with the real `datasets` library. In process: the reader (bytes, classes from the ClassLabel, splits,
pickling), the decisions (a Dataset without splits holds out a tenth), the checks (overlap by content,
unreadable images), the refusals. e2e (Done when): both trained with the defaults on 2 processes,
stopped by SIGTERM mid-epoch and resumed to the straight run's metrics rows, evaluated on 1 and 2
processes to the same top-1 and n."""

from __future__ import annotations

import io
import os
import pickle
import sys

import numpy as np
import pytest
import torch

from distribuuuu import data, inferred
from distribuuuu.data import sources
from distribuuuu.data.checks import overlap
from distribuuuu.data.loading import items
from distribuuuu.data.sources import hf
from tests.conftest import (
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
)

datasets = pytest.importorskip("datasets")  # the hf extra (in the dev install)
datasets.disable_progress_bars()  # save_to_disk's and to_parquet's

CLASSES = ["zebra", "ant", "bee"]  # a ClassLabel's order, not sorted: the classes must keep it
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Parquet files become Arrow files in the datasets cache: a folder of the test's own, for this
    process (the library read it at import) and the commands it starts."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def png(label: int, seed: int, size: int = 16) -> bytes:
    """A small RGB image whose colour follows its class, with noise of its own."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 96, (size, size, 3), dtype=np.uint8)
    pixels[..., label] += 150
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def rows(per_class: int, seed: int) -> dict[str, list]:
    """per_class images of each class, classes interleaved: {"image": [...], "label": [...]}."""
    labels = [i % len(CLASSES) for i in range(per_class * len(CLASSES))]
    images = [{"bytes": png(c, seed + i), "path": f"{seed + i}.png"} for i, c in enumerate(labels)]
    return {"image": images, "label": labels}


def dataset(columns: dict[str, list], names: list[str] = CLASSES):
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    return datasets.Dataset.from_dict(columns, features=features)


def write_saved(root, train: int = 100, val: int = 20) -> str:
    """A DatasetDict of train and validation (train x 3 and val x 3 rows) saved with save_to_disk."""
    splits = datasets.DatasetDict(train=dataset(rows(train, 0)), validation=dataset(rows(val, 10_000)))
    splits.save_to_disk(str(root))
    return str(root)


def write_parquet(root, train: int = 100, val: int = 20) -> str:
    """The same rows as write_saved as Parquet files, where the Hub keeps them."""
    os.makedirs(root / "data")
    dataset(rows(train, 0)).to_parquet(str(root / "data" / "train-00000-of-00001.parquet"))
    dataset(rows(val, 10_000)).to_parquet(str(root / "data" / "validation-00000-of-00001.parquet"))
    return str(root)


FORMATS = {"saved": write_saved, "parquet": write_parquet}


def decisions(cfg) -> dict[str, inferred.Decision]:
    return {d.key: d for d in inferred.decisions(cfg)}


# ---------------------------------------------------------------------------------------------
# The reader
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_split_reads_the_encoded_images_with_the_classlabels_classes(tmp_path, fmt):
    root = FORMATS[fmt](tmp_path / "ds", train=4, val=2)
    assert sources.source_kind(root) == "hf" and hf.splits(root) == ["train", "val"]
    cfg = make_cfg("TRAIN.DATASET", root, "TEST.DATASET", root, resolve=False)
    train, val = sources.image_files(cfg, "TRAIN"), sources.image_files(cfg, "TEST")
    assert train.classes == CLASSES and val.classes == CLASSES  # the ClassLabel's order, not sorted
    assert train.paths is None and len(train) == 12 and len(val) == 6
    expected = rows(4, 0)
    assert train.targets == expected["label"]
    assert [train.read(i) for i in range(12)] == [image["bytes"] for image in expected["image"]]
    assert train.size(5) == len(expected["image"][5]["bytes"])
    assert val.read(1) == png(1, 10_001) and val.targets[:3] == [0, 1, 2]
    where = {"saved": os.path.join(root, "train"), "parquet": os.path.join(root, "data", "train-00000-of-00001.parquet")}
    assert train.name(7) == where[fmt] + " row 7"


def test_a_reader_pickles_by_its_files_not_its_bytes(tmp_path):
    """A loader worker gets the reader pickled (spawn, forkserver): the Dataset's files, not the images."""
    root = write_saved(tmp_path / "ds", train=200, val=2)
    files = sources.image_files(make_cfg("TRAIN.DATASET", root, resolve=False), "TRAIN")
    first = files.read(0)  # the column mapped in this process
    image_bytes = sum(files.size(i) for i in range(len(files)))
    blob = pickle.dumps(files)
    assert len(blob) < 16_000 < image_bytes, (len(blob), image_bytes)
    again = pickle.loads(blob)
    assert again.column is None and again.read(0) == first and again.read(599) == files.read(599)


def test_names_and_whole_numbers_as_labels_and_a_test_split_matched_by_name(tmp_path):
    """Labels that are not a ClassLabel: names (sorted as folders are) or class indices; a val split
    whose ClassLabel orders the names otherwise is read in the training numbering."""
    images = [{"bytes": png(i % 3, i), "path": None} for i in range(6)]
    named = datasets.Dataset.from_dict({"img": images, "labels": ["cat", "ant", "bee"] * 2},
                                       features=datasets.Features({"img": datasets.Image(), "labels": datasets.Value("string")}))
    named.save_to_disk(str(tmp_path / "named"))
    files = hf.hf_files(str(tmp_path / "named"), "", "", "", "TRAIN")  # img / labels: the usual names too
    assert (files.classes, files.targets) == (["ant", "bee", "cat"], [2, 0, 1, 2, 0, 1])
    numbered = datasets.Dataset.from_dict({"image": images, "label": [4, 0, 2] * 2},
                                          features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")}))
    numbered.save_to_disk(str(tmp_path / "numbered"))
    files = hf.hf_files(str(tmp_path / "numbered"), "train", "", "", "TRAIN")  # one Dataset: every split
    assert (files.classes, files.targets) == (["0", "1", "2", "3", "4"], [4, 0, 2, 4, 0, 2])
    other = dataset({"image": images[:3], "label": [0, 1, 2]}, names=["bee", "zebra", "ant"])
    datasets.DatasetDict(validation=other).save_to_disk(str(tmp_path / "other"))
    val = hf.hf_files(str(tmp_path / "other"), "val", "", "", "TEST", train=CLASSES)
    assert (val.classes, val.targets) == (CLASSES, [2, 0, 1])


# ---------------------------------------------------------------------------------------------
# The decisions and the checks
# ---------------------------------------------------------------------------------------------
def test_the_defaults_follow_the_dataset_and_sample_its_images(tmp_path):
    root = write_saved(tmp_path / "ds", train=10, val=3)
    cfg = make_cfg("TRAIN.DATASET", root, "TRAIN.WORKERS", "0", "TRAIN.BATCH_SIZE", "8")
    f = decisions(cfg)
    assert (cfg.MODEL.NUM_CLASSES, cfg.TEST.DATASET, cfg.TEST.SPLIT, cfg.TRAIN.VAL_SPLIT) == (3, root, "val", 0.0)
    assert f["MODEL.NUM_CLASSES"].origin == "from the dataset's label feature"
    assert f["TRAIN.IM_SIZE"].origin.startswith("from the images: 30 sampled, median shorter side 16 px")
    assert f["MODEL.IN_CHANS"].line() == "MODEL.IN_CHANS 3 (from the images: 0 of 30 sampled are gray)"
    data.check_datasets(cfg, 2)
    labels = [int(y) for _, ys in data.build_val_loader(cfg, 0, 1, CPU) for y in ys]
    assert labels == [0, 1, 2] * 3


def test_one_dataset_without_splits_holds_out_a_tenth(tmp_path):
    dataset(rows(20, 0)).save_to_disk(str(tmp_path / "ds"))  # a Dataset: state.json, no splits
    root = str(tmp_path / "ds")
    assert sources.source_kind(root) == "hf" and hf.splits(root) is None
    cfg = make_cfg("TRAIN.DATASET", root, "TRAIN.WORKERS", "0", "TEST.BATCH_SIZE", "64")
    assert (cfg.TRAIN.SPLIT, cfg.TEST.DATASET, cfg.TEST.SPLIT, cfg.TRAIN.VAL_SPLIT) == ("", root, "", 0.1)
    f = decisions(cfg)
    assert "is one Dataset without splits, so all its rows are the training split" in f["TRAIN.SPLIT"].origin
    # A tenth, at least 5 of a class of 25 or more and a fifth of a smaller one: 4 of each 20
    assert "12 of its 60 images are held out as the val set, chosen by a fixed seed" in f["TRAIN.VAL_SPLIT"].origin
    assert "per class zebra 4, ant 4, bee 4" in f["TRAIN.VAL_SPLIT"].origin
    data.check_datasets(cfg, 1)
    val = sorted(int(y) for _, ys in data.build_val_loader(cfg, 0, 1, CPU) for y in ys)
    assert val == [0] * 4 + [1] * 4 + [2] * 4
    assert len(data.build_train_loader(cfg, 0, 1, CPU).dataset) == 48


def test_parquet_files_without_split_names_are_one_dataset(tmp_path):
    os.makedirs(tmp_path / "pq")
    dataset(rows(10, 0)).to_parquet(str(tmp_path / "pq" / "part-0.parquet"))
    dataset(rows(10, 100)).to_parquet(str(tmp_path / "pq" / "part-1.parquet"))
    root = str(tmp_path / "pq")
    assert hf.parquet_files(root) == {"": [f"{root}/part-0.parquet", f"{root}/part-1.parquet"]}
    cfg = make_cfg("TRAIN.DATASET", root, "TRAIN.WORKERS", "0")
    assert (cfg.TRAIN.SPLIT, cfg.TRAIN.VAL_SPLIT, cfg.MODEL.NUM_CLASSES) == ("", 0.1, 3)
    assert len(sources.image_files(cfg, "TRAIN")) == 60
    # One file named as TRAIN.DATASET: that file's rows
    assert len(hf.hf_files(f"{root}/part-1.parquet", "", "", "", "TRAIN")) == 30


def test_a_val_image_that_is_a_training_image_is_found_by_its_bytes(tmp_path):
    train = rows(4, 0)
    val = rows(2, 500)
    val["image"][3] = dict(train["image"][5])  # the same bytes, another path
    val["label"][3] = train["label"][5]
    datasets.DatasetDict(train=dataset(train), validation=dataset(val)).save_to_disk(str(tmp_path / "ds"))
    cfg = make_cfg("TRAIN.DATASET", str(tmp_path / "ds"), "TRAIN.WORKERS", "0")
    found = overlap.find(sources.image_files(cfg, "TRAIN"), sources.image_files(cfg, "TEST"))
    pairs = [(a.rsplit(os.sep, 1)[1], b.rsplit(os.sep, 1)[1], how) for a, b, how in found.pairs]
    assert pairs == [("train row 5", "validation row 3", "same bytes")]
    message = overlap.overlap_message(cfg, found)
    assert "1 image(s) of TRAIN.DATASET are also in TEST.DATASET (1 same bytes)" in message, message


def test_an_unreadable_image_is_left_out_of_n_and_class_balance_reads_the_labels(tmp_path):
    """An image that does not decode is skipped (evaluation counts the others); TRAIN.CLASS_BALANCE
    sampler evens out classes from the labels the dataset holds (30, 6 and 3 rows)."""
    train = {"image": [], "label": []}
    for label, count in enumerate((30, 6, 3)):
        train["image"] += [{"bytes": png(label, 100 * label + i), "path": None} for i in range(count)]
        train["label"] += [label] * count
    val = rows(4, 500)
    val["image"][2] = {"bytes": b"not an image", "path": None}
    datasets.DatasetDict(train=dataset(train), validation=dataset(val)).save_to_disk(str(tmp_path / "ds"))
    cfg = make_cfg("TRAIN.DATASET", str(tmp_path / "ds"), "TRAIN.WORKERS", "0", "TRAIN.BATCH_SIZE", "3",
                   "TRAIN.CLASS_BALANCE", "sampler", "RNG_SEED", "0")
    data.check_datasets(cfg, 1)
    loader = data.build_val_loader(cfg, 0, 1, CPU)
    assert len([y for _, ys in loader for y in ys]) == 11
    assert items.take_unreadable(loader.dataset) == [2]
    drawn = np.bincount([int(y) for _, ys in data.build_train_loader(cfg, 0, 1, CPU) for y in ys], minlength=3)
    assert drawn.sum() == 39 and drawn.min() >= 8, drawn  # a third each, about 13; unbalanced: 30, 6, 3


def test_a_class_of_unreadable_images_is_refused_naming_a_row(tmp_path):
    train = rows(3, 0)
    for i in (1, 4, 7):  # every "ant"
        train["image"][i] = {"bytes": b"not an image", "path": None}
    datasets.DatasetDict(train=dataset(train), validation=dataset(rows(1, 50))).save_to_disk(str(tmp_path / "ds"))
    root = str(tmp_path / "ds")
    line = check_user_error(cli_main("train", "TRAIN.DATASET", root, "OUT_DIR", str(tmp_path / "run")),
                            "every image of 1 class(es)", "ant (3 images;", os.path.join(root, "train") + " row 1")
    assert "UnidentifiedImageError" in line or "cannot identify" in line, line


# ---------------------------------------------------------------------------------------------
# Bad input: exit 2, one line naming the file or feature and what would be right
# ---------------------------------------------------------------------------------------------
def _plain(tmp_path, name: str, columns: dict, features: dict) -> str:
    split = datasets.Dataset.from_dict(columns, features=datasets.Features(features))
    datasets.DatasetDict(train=split, validation=split).save_to_disk(str(tmp_path / name))
    return str(tmp_path / name)


def _train(tmp_path, root: str, *opts: str):
    return cli_main("train", "TRAIN.DATASET", root, "OUT_DIR", str(tmp_path / "run"), *opts)


def test_a_dataset_without_an_image_or_a_label_feature_is_refused_naming_its_features(tmp_path):
    images = [{"bytes": png(0, i), "path": None} for i in range(4)]
    root = _plain(tmp_path, "pics", {"picture": images, "label": [0, 1, 0, 1]},
                  {"picture": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    check_user_error(_train(tmp_path, root), os.path.join(root, "train"),
                     "has no image feature (named image, img): its features are picture, label", "TRAIN.IMAGE_FIELD NAME")
    check(cli_main("config", "TRAIN.DATASET", root, "TRAIN.IMAGE_FIELD", "picture"))  # named: found
    check_user_error(_train(tmp_path, root, "TRAIN.IMAGE_FIELD", "photo"), "has no feature 'photo': its features are")
    root = _plain(tmp_path, "unlabelled", {"image": images, "kind": [0, 1, 0, 1]},
                  {"image": datasets.Image(), "kind": datasets.Value("int64")})
    check_user_error(_train(tmp_path, root), "has no label feature (named label, labels): its features are image, kind",
                     "TRAIN.LABEL_FIELD NAME")
    root = _plain(tmp_path, "words", {"image": ["a.png", "b.png"], "label": [0, 1]},
                  {"image": datasets.Value("string"), "label": datasets.Value("int64")})
    check_user_error(_train(tmp_path, root),
                     "the feature 'image' is Value('string'), not an image (an Image feature, or encoded image bytes)")


@pytest.mark.parametrize("missing", [None, -1], ids=["None", "ClassLabel -1"])
def test_a_row_without_a_label_is_refused_naming_the_row(tmp_path, missing):
    labelled = rows(2, 0)
    labelled["label"][4] = missing  # -1: a ClassLabel's "no label", as the Hub's unlabelled test splits
    datasets.DatasetDict(train=dataset(labelled), validation=dataset(rows(1, 9))).save_to_disk(str(tmp_path / "ds"))
    check_user_error(_train(tmp_path, str(tmp_path / "ds")), os.path.join(str(tmp_path / "ds"), "train"),
                     f"feature 'label', row 4: no label ({missing!r}); give every image a label")


def test_a_parquet_file_without_an_image_column_is_refused_naming_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(tmp_path / "pq" / "data")
    table = pa.table({"photo": [png(0, 1), png(1, 2)], "label": [0, 1]})
    for split in ("train", "validation"):
        pq.write_table(table, str(tmp_path / "pq" / "data" / f"{split}-00000-of-00001.parquet"))
    check_user_error(_train(tmp_path, str(tmp_path / "pq")),
                     "train-00000-of-00001.parquet has no image feature (named image, img): its features are photo, label",
                     "TRAIN.IMAGE_FIELD NAME")
    # A plain Parquet file of encoded bytes (not an Image feature) is read once the column is named
    files = hf.hf_files(str(tmp_path / "pq"), "train", "photo", "", "TRAIN")
    assert files.read(1) == png(1, 2) and files.classes == ["0", "1"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_split_that_the_dataset_lacks_is_refused_naming_its_splits(tmp_path, fmt):
    root = FORMATS[fmt](tmp_path / "ds", train=2, val=1)
    check_user_error(_train(tmp_path, root, "TEST.DATASET", root, "TEST.SPLIT", "test"), "TEST.DATASET",
                     "has no split 'test': its splits are train, validation; set TEST.SPLIT to one of train, val "
                     "(the Hub's 'validation' is 'val')")


def test_without_the_datasets_library_the_refusal_says_what_to_install(tmp_path, monkeypatch):
    root = write_saved(tmp_path / "ds", train=2, val=1)
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    check_user_error(_train(tmp_path, root), 'pip install "distribuuuu[hf]"')


# ---------------------------------------------------------------------------------------------
# Done when: trains with the defaults; evaluation on 1 and 2 processes gives identical top-1 and
# n; stopped and resumed step-exactly (both formats)
# ---------------------------------------------------------------------------------------------
MEASURED = ("img_per_s", "time_s", "data_frac", "peak_mem_mb")  # how fast and how big, not what was learnt


def _numbers(out) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in MEASURED} for row in read_metrics(str(out))]


def _stopped_and_resumed(train: list[str], out) -> None:
    """SIGTERM once training shows in log.txt: every rank writes a step checkpoint mid-epoch and
    exits 143; the same command again resumes from it."""
    stop_and_wait(*start_until([*train, "OUT_DIR", str(out)], out, logged("[train] epoch 1/2 iter")))
    ckpt = torch.load(out / "checkpoints" / "last.pth", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == 0 and 0 < ckpt["samples_in_epoch"] < 300, ckpt["samples_in_epoch"]
    check(run([*train, "OUT_DIR", str(out)], timeout=300))
    assert f"{ckpt['samples_in_epoch']} samples into epoch 1" in read_text_or_empty(out / "log.txt")


def _top1_and_n(proc) -> tuple[str, str]:
    line = next(ln for ln in (proc.stdout + proc.stderr).splitlines() if "[eval]" in ln and "top-1" in ln)
    return line.split("top-1 ")[1].split()[0], line.split("| n ")[1].split()[0]


@pytest.mark.e2e
def test_both_formats_train_with_the_defaults_resume_step_exactly_and_evaluate_alike(tmp_path):
    """The same rows saved with save_to_disk and as Parquet files make the same run: the Parquet run,
    stopped and resumed, ends with the straight save_to_disk run's metrics rows (bit for bit), as the
    save_to_disk run stopped and resumed does; the checkpoints evaluate on 1 and 2 processes to the
    2-process training's top-1 and n. Eight commands, 2 minutes of CPU time (most of it imports)."""
    saved, parquet = write_saved(tmp_path / "data" / "saved"), write_parquet(tmp_path / "data" / "parquet")
    command = [sys.executable, "-m", "distribuuuu"]
    opts = ["--nproc-per-node", "2", "OPTIM.MAX_EPOCH", "2", "TRAIN.BATCH_SIZE", "4", "RNG_SEED", "1"]  # 37 steps an epoch
    straight = tmp_path / "straight"
    check(run([*command, "train", "TRAIN.DATASET", saved, *opts, "OUT_DIR", str(straight)], timeout=300))
    log = read_text_or_empty(straight / "log.txt")
    assert "MODEL.NUM_CLASSES 3 (from the dataset's label feature)" in log and "300 train / 60 val" in log, log[-3000:]
    metrics = _numbers(straight)
    assert [(r["epoch"], r["split"]) for r in metrics] == [(1, "train"), (1, "val"), (2, "train"), (2, "val")]

    for name, root in (("saved", saved), ("parquet", parquet)):
        _stopped_and_resumed([*command, "train", "TRAIN.DATASET", root, *opts], tmp_path / name)
        assert _numbers(tmp_path / name) == metrics, name

    val = (f"{metrics[-1]['top1']:.2f}%", "60")
    for out, nproc in (("straight", "1"), ("straight", "2"), ("parquet", "1")):
        last = str(tmp_path / out / "checkpoints" / "last.pth")
        proc = check(run([*command, "eval", "--nproc-per-node", nproc, "--checkpoint", last], timeout=300))
        assert _top1_and_n(proc) == val, (out, nproc, proc.stdout[-2000:])

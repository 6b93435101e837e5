"""Decisions from the data's layout: a folder of class folders as the
training split with a held-out part, TEST.DATASET following
TRAIN.DATASET, MODEL.NUM_CLASSES and TRAIN.TOPK from the classes, the
evaluation size, and the paths made absolute (the datasets, IMPORTS)
so that config.yaml and the checkpoints find them from any folder."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
from yacs.config import CfgNode

from distribuuuu.config.reading import TEST_FOLLOWED
from distribuuuu.data import holdout, sources
from distribuuuu.data.shards.index import load_shard_set
from distribuuuu.data.sources import cifar, folder, labels, registry
from distribuuuu.errors import UserError
from distribuuuu.inferred.decision import Decision

FALLBACK_CLASSES = 1000  # ImageNet's: synthetic and dummy data, data not readable here
EVAL_CROP_PCT = 0.875  # 224 / 256, Distribuuuu's (and torchvision's) eval resize
HOLDOUT_FRACTION = 0.1  # a folder of class folders: the share held out as the val set
SPLIT_NAMES = ("train", "val", "test")  # folders that make a split layout, not classes


def _class_dirs(path: str) -> list[str]:
    """The class folders of path, [] when it is not a folder."""
    try:
        return folder.folder_classes(path)
    except OSError:
        return []


def layout(cfg: CfgNode) -> list[Decision]:
    """A config file's TEST.DATASET that the command line's TRAIN.DATASET
    replaced; a folder of class folders as the training split (held out
    from, with TEST.DATASET unset); TEST.DATASET '' as TRAIN.DATASET."""
    decided = []
    if TEST_FOLLOWED in cfg.__dict__:
        test, train = cfg.__dict__[TEST_FOLLOWED]
        why = f"the config file's {test!r} goes with its TRAIN.DATASET {train!r}, which the "
        why += "command line replaced"
        decided.append(Decision("TEST.DATASET", "follows TRAIN.DATASET", why))
    t, kind = cfg.TRAIN, sources.kind_of(cfg, "TRAIN")
    flat = (
        t.SPLIT and os.path.isdir(t.DATASET) and not os.path.isdir(os.path.join(t.DATASET, t.SPLIT))
    )
    if kind == "labels":
        decided += _label_files(cfg)
    elif kind == "folder" and flat:
        decided += _flat_folder(cfg)
    if cfg.TEST.DATASET == "":
        cfg.TEST.DATASET = t.DATASET
        why = f"TRAIN.DATASET, split {cfg.TEST.SPLIT or '(itself)'!r}"
        decided.append(Decision("TEST.DATASET", cfg.TEST.DATASET, why))
    if cfg.TEST.DATASET != t.DATASET:  # a folder of its own, whose layout may be another
        decided += _test_folder(cfg)
    return decided


def _test_folder(cfg: CfgNode) -> list[Decision]:
    """A TEST.DATASET folder of its own whose split layout differs from
    the one TEST.SPLIT names, e.g. new class folders scored by a model
    trained on train/ and val/ (TEST.SPLIT 'val'): the folder is scored
    whole (TEST.SPLIT ''); a folder holding val/ scored by a model of a
    flat folder (TEST.SPLIT ''): its val/."""
    test = cfg.TEST
    if sources.kind_of(cfg, "TEST") != "folder":
        return []
    classes = _class_dirs(test.DATASET)
    splits = set(SPLIT_NAMES) & set(classes)
    if test.SPLIT == "" and "val" in splits and _class_dirs(os.path.join(test.DATASET, "val")):
        test.SPLIT = "val"
        why = f"from the folder: {test.DATASET} holds val/ and no class folders, so its val/ "
        return [Decision("TEST.SPLIT", "val", why + "is scored")]
    if not test.SPLIT or os.path.isdir(os.path.join(test.DATASET, test.SPLIT)):
        return []
    if not classes or splits:
        return []  # no class folders, or a split layout: the preflight names what is missing
    why = f"from the folder: {test.DATASET} holds {len(classes)} class folders and no "
    why += f"{test.SPLIT}/, so it is scored whole"
    test.SPLIT = ""
    return [Decision("TEST.SPLIT", "''", why)]


def _flat_folder(cfg: CfgNode) -> list[Decision]:
    """A folder of class folders: the folder is the training split, and,
    when no TEST.DATASET is given, a held-out part of it the val set."""
    t = cfg.TRAIN
    classes = _class_dirs(t.DATASET)
    if not classes:
        return []  # no class folders: the preflight says what it lacks
    if {"train", "val", "test"} & set(classes):
        return []  # a split layout with another split name
    why = f"from the folder: {t.DATASET} holds {len(classes)} class folders and no {t.SPLIT}/, "
    decided = [Decision("TRAIN.SPLIT", "''", why + "so it is the training split")]
    t.SPLIT = ""
    if cfg.TEST.DATASET == "":
        decided += _hold_out(cfg, "from the folder: no val/ folder, so ")
    return decided


def _label_files(cfg: CfgNode) -> list[Decision]:
    """Label files: all the rows are the training split when the file has
    no rows of TRAIN.SPLIT (no split column, no <SPLIT> file); when
    TEST.DATASET is not given and there are no 'val' rows, a held-out
    part of them is the val set."""
    t = cfg.TRAIN
    path = labels.find(t.DATASET, t.SPLIT)
    if path is None:
        return []  # the preflight names what is missing
    values, whole = labels.splits(path), labels.find(t.DATASET)
    decided = []
    if path == whole and (values is None or t.SPLIT not in values):
        why = f"from the label file: {path} has no {t.SPLIT!r} rows, so all its rows are the "
        decided.append(Decision("TRAIN.SPLIT", "''", why + "training split"))
        t.SPLIT = ""
    val = (
        "val" in values
        if values is not None
        else labels.find(t.DATASET, "val") not in (None, whole)
    )
    if cfg.TEST.DATASET == "" and not val:
        decided += _hold_out(cfg, f"from the label file: no val rows in {path}, so ")
    return decided


def _hold_out(cfg: CfgNode, why: str) -> list[Decision]:
    """TEST.DATASET unset and no val split: TEST is the training split,
    and TRAIN.VAL_SPLIT (unless set) holds a tenth of it out; the line
    says how many images of each class."""
    t = cfg.TRAIN
    cfg.TEST.DATASET, cfg.TEST.SPLIT = t.DATASET, t.SPLIT
    if t.VAL_SPLIT:
        return []
    t.VAL_SPLIT = HOLDOUT_FRACTION
    try:
        files = sources.image_files(cfg, "TRAIN")
        indices, sizes = np.unique(files.targets, return_counts=True)
        counts = {files.classes[i]: int(n) for i, n in zip(indices, sizes)}
        holdout.check_holdout(counts, HOLDOUT_FRACTION)
    except (UserError, OSError, ValueError):  # the preflight says what is wrong
        why += "a tenth of each class is held out as the val set"
        return [Decision("TRAIN.VAL_SPLIT", t.VAL_SPLIT, why)]
    held = holdout.held_per_class(counts, HOLDOUT_FRACTION)
    why += (
        f"{sum(held.values())} of its {sum(counts.values())} images are held out as the val set, "
    )
    why += f"chosen by a fixed seed: a tenth of each class, at least {holdout.MIN_HELD} of a class "
    why += f"of {5 * holdout.MIN_HELD} or more (a fifth of a smaller one); {_per_class(held)}"
    return [Decision("TRAIN.VAL_SPLIT", t.VAL_SPLIT, why)]


def _per_class(held: dict[str, int]) -> str:
    """'per class cat 12, dog 5' for up to 20 classes, else the range
    and the classes under MIN_HELD (too small to spare more)."""
    if len(held) <= 20:
        return "per class " + ", ".join(f"{c} {n}" for c, n in held.items())
    text = f"{min(held.values())} to {max(held.values())} per class"
    few = [f"{c} {n}" for c, n in held.items() if n < holdout.MIN_HELD]
    if few:
        more = f" and {len(few) - 10} more" if len(few) > 10 else ""
        text += f"; under {holdout.MIN_HELD} in the classes too small to spare more: "
        text += ", ".join(few[:10]) + more
    return text


def training_data_is_test_data(cfg: CfgNode) -> bool:
    """TEST names the TRAIN data itself (a folder of class folders): the
    held-out part is the only evaluation set, and there is no separate
    test set."""
    return (cfg.TEST.DATASET, cfg.TEST.SPLIT) == (cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT)


def train_classes(cfg: CfgNode) -> tuple[list[str] | None, str]:
    """(class names of the TRAIN data, where they were found), or (None,
    why not): no class count to follow (synthetic, dummy input), or data
    not readable here."""
    t, kind = cfg.TRAIN, sources.kind_of(cfg, "TRAIN")
    if kind == "dummy":
        return None, "MODEL.DUMMY_INPUT has no classes"
    if t.DATASET == "synthetic":
        return None, "synthetic data makes MODEL.NUM_CLASSES classes"
    unreadable = None, "TRAIN.DATASET is not readable here"
    try:
        if kind == "folder":
            classes = _class_dirs(os.path.join(t.DATASET, t.SPLIT))
            return (classes, "from the folder") if classes else unreadable
        if kind == "labels":
            return sources.image_files(cfg, "TRAIN").classes, "from the label file"
        if kind == "cifar":
            return cifar.cifar_classes(*cifar.find_cifar(t.DATASET)), "from the CIFAR folder"
        if kind == "shards":
            shard_set = load_shard_set(t.DATASET, t.SPLIT, "TRAIN")
            return list(shard_set.classes), "from the shard index"
        source = registry.get_source(t.DATASET)
        if source.classes is not None:
            return list(source.classes), f"stated by the source {t.DATASET!r}"
        return list(registry.build_source(cfg, "TRAIN").classes), f"from the source {t.DATASET!r}"
    except (UserError, OSError):
        return unreadable


def classes(cfg: CfgNode) -> list[Decision]:
    """MODEL.NUM_CLASSES (train_classes, else FALLBACK_CLASSES), then
    TRAIN.TOPK below it (top-k of k classes is always 100%)."""
    origin = "config"
    if not cfg.MODEL.NUM_CLASSES:
        found, origin = train_classes(cfg)
        cfg.MODEL.NUM_CLASSES = len(found) if found else FALLBACK_CLASSES
        if not found:
            origin += ": the fallback"
    num, asked = cfg.MODEL.NUM_CLASSES, cfg.TRAIN.TOPK
    topk = Decision("TRAIN.TOPK", asked, "config")
    if asked > max(1, num - 1):
        cfg.TRAIN.TOPK = max(1, num - 1)
        why = f"clamped from {asked}: top-{asked} of {num} classes would always be 100%, "
        topk = Decision("TRAIN.TOPK", cfg.TRAIN.TOPK, why + "saying nothing")
    return [Decision("MODEL.NUM_CLASSES", num, origin), topk]


def eval_size(cfg: CfgNode) -> Decision:
    """TEST.IM_SIZE 0: TRAIN.IM_SIZE / (TEST.CROP_PCT or 0.875), floored."""
    size, pct = cfg.TRAIN.IM_SIZE, cfg.TEST.CROP_PCT
    origin = "config"
    if not cfg.TEST.IM_SIZE:
        cfg.TEST.IM_SIZE = int(math.floor(size / (pct or EVAL_CROP_PCT)))
        origin = f"follows TRAIN.IM_SIZE: {size} / {pct or EVAL_CROP_PCT:g}"
    if sources.kind_of(cfg, "TEST") not in (*sources.IMAGE_FILES, "shards"):
        why = f"TRAIN.IM_SIZE; {cfg.TEST.DATASET} images are resized whole"
        return Decision("eval size", f"{size} px", why)
    resize = int(math.floor(size / pct)) if pct else cfg.TEST.IM_SIZE
    why = f"TEST.CROP_PCT {pct:g}" if pct else f"TEST.IM_SIZE {cfg.TEST.IM_SIZE}, {origin}"
    return Decision("eval size", f"resize to {resize}, center crop {size} px", why)


def absolute_datasets(cfg: CfgNode) -> None:
    """TRAIN.DATASET and TEST.DATASET that name a path here (not a
    registered source) as absolute paths."""
    for key in ("TRAIN", "TEST"):  # (a shard set's brace pattern names no file itself)
        group = cfg[key]
        here = os.path.exists(group.DATASET) or "{" in group.DATASET
        if here and sources.kind_of(cfg, key) in (*sources.IMAGE_FILES, "cifar", "shards"):
            group.DATASET = os.path.abspath(group.DATASET)


def absolute_imports(cfg: CfgNode) -> list[Decision]:
    """IMPORTS entries that only this folder finds (a .py path, or a
    module beside it), and the file of a MODEL.ARCH registered with
    register_model, as absolute paths: eval, predict, export and
    load_model import them from any folder."""
    from distribuuuu.config.user_modules import is_path

    models = sys.modules.get("distribuuuu.models")  # not imported: nothing registered with it
    model_file = models.user_model_file(cfg.MODEL.ARCH) if models is not None else None
    entries = []
    for entry in cfg.IMPORTS:
        module = sys.modules.get(entry) if "." not in entry else None
        file = os.path.abspath(getattr(module, "__file__", None) or "")
        if is_path(entry):
            entry = os.path.abspath(entry)
        elif (
            module is not None and os.path.dirname(file) == os.getcwd()
        ):  # beside us, not on sys.path
            entry = file
        entries.append(entry)
    files = {getattr(sys.modules.get(e), "__file__", None) for e in entries}
    if model_file and model_file not in entries and model_file not in files:
        entries.append(model_file)
    if entries == list(cfg.IMPORTS):
        return []
    cfg.IMPORTS = entries
    why = "as absolute paths: eval, predict and export find them from any folder"
    return [Decision("IMPORTS", entries, why)]

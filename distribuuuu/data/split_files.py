"""The held-out split as files, for other tools: the list of the images
TRAIN.VAL_SPLIT held out (OUT_DIR/heldout.txt, paths relative to the
training data's folder), and ``distribuuuu data split RUN_DIR DEST``,
which lays the run's split out as DEST/train/<class>/ and
DEST/val/<class>/ of symlinks to the original files (absolute links: DEST
may move, the data may not), a tree that torchvision's and timm's
ImageFolder read, and distribuuuu's train/ + val/ layout."""

from __future__ import annotations

import os
import shutil

import numpy as np
from torch.utils.data import Dataset
from yacs.config import CfgNode

from distribuuuu import config
from distribuuuu.data import sources
from distribuuuu.data.holdout import SplitPart
from distribuuuu.errors import UserError
from distribuuuu.run_folder import HELDOUT

PARTS = ("train", "val")  # DEST's folders: the part trained on, the part held out


def data_root(cfg: CfgNode) -> str:
    """The folder the listed paths are relative to: TRAIN.DATASET, or
    the folder of its label file."""
    dataset = cfg.TRAIN.DATASET
    return dataset if os.path.isdir(dataset) else os.path.dirname(dataset)


def heldout_files(cfg: CfgNode, dataset: Dataset) -> list[str] | None:
    """The files of the held-out part that the val loader reads
    (dataset: its items), relative to data_root; None when they are
    not image files (a built-in or registered source)."""
    files = getattr(getattr(dataset, "dataset", None), "files", None)
    if not isinstance(dataset, SplitPart) or files is None or files.paths is None:
        return None
    root = data_root(cfg)
    return [os.path.relpath(files.paths[i], root) for i in dataset.indices]


def split_out(run_dir: str, dest: str) -> dict[str, int]:
    """Write the split of the run in run_dir (its config.yaml and
    heldout.txt) to dest as links; returns the images per part and the
    classes. Written under a temporary name beside dest and renamed when
    complete, as `data export` does."""
    if os.path.lexists(dest) and not (os.path.isdir(dest) and not os.listdir(dest)):
        raise UserError(f"DEST {dest} already exists and is not empty; remove it or give another")
    cfg, held = _run_split(run_dir)
    files, root = sources.image_files(cfg, "TRAIN"), data_root(cfg)
    listed = {os.path.relpath(path, root) for path in files.paths}
    gone = sorted(held - listed)
    if gone:
        raise UserError(
            f"{os.path.join(run_dir, HELDOUT)} lists {len(gone)} file(s) that TRAIN.DATASET "
            f"{cfg.TRAIN.DATASET} no longer holds (e.g. {gone[0]}): the data changed since the run"
        )
    partial = dest.rstrip(os.sep) + ".partial"
    shutil.rmtree(partial, ignore_errors=True)  # an earlier split that was killed
    labelled = sources.kind_of(cfg, "TRAIN") == "labels"
    counts = dict.fromkeys(PARTS, 0)
    for path, target in zip(files.paths, files.targets):
        part = "val" if os.path.relpath(path, root) in held else "train"
        name = files.classes[target]
        below = root if labelled else os.path.join(files.root, name)
        link = os.path.join(partial, part, name, _flat(os.path.relpath(path, below)))
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if os.path.lexists(link):
            raise UserError(f"two images of class {name} would be linked as {link}; rename one")
        os.symlink(os.path.abspath(path), link)
        counts[part] += 1
    if os.path.isdir(dest):
        os.rmdir(dest)
    os.rename(partial, dest)
    return {**counts, "classes": len(np.unique(files.targets))}


def _flat(relative: str) -> str:
    """A path as one file name, its folders joined by '_': ImageFolder
    readers (timm's) take a nested folder for a class."""
    return relative.replace(os.sep, "_")


def _run_split(run_dir: str) -> tuple[CfgNode, set[str]]:
    """(the run's config, its held-out paths), or a UserError saying
    why run_dir has none."""
    cfg_path, held_path = os.path.join(run_dir, "config.yaml"), os.path.join(run_dir, HELDOUT)
    if not os.path.isfile(cfg_path):
        raise UserError(
            f"{run_dir} is not a run folder (no config.yaml); give the OUT_DIR of a training run"
        )
    cfg = config.load_config(cfg_path)
    if not os.path.isfile(held_path):
        why = "TRAIN.VAL_SPLIT is 0: its val set is TEST.DATASET, a split on disk already"
        if cfg.TRAIN.VAL_SPLIT:
            why = f"its TRAIN.DATASET {cfg.TRAIN.DATASET!r} is not image files, or the run is older"
        raise UserError(f"{run_dir} has no {HELDOUT}: {why}")
    with open(held_path, encoding="utf-8") as f:
        return cfg, {line.rstrip("\n") for line in f if line.strip()}

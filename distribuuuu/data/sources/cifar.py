"""CIFAR-10/100, the python pickle version, from a local folder
(never downloaded): a folder holding cifar-10-batches-py/ or
cifar-100-python/, or being one."""

from __future__ import annotations

import os
import pickle

import numpy as np
import torch
from yacs.config import CfgNode

from distribuuuu.data.sources.builtin import TensorSource, check_split_name
from distribuuuu.data.transforms import CIFAR10_STATS, CIFAR100_STATS
from distribuuuu.errors import UserError

CIFAR_SUBDIRS = {"cifar-10-batches-py": "cifar10", "cifar-100-python": "cifar100"}


def find_cifar(path: str) -> tuple[str, str] | None:
    """(folder holding the pickles, 'cifar10' | 'cifar100') if path is
    or holds a CIFAR folder."""
    for sub, variant in CIFAR_SUBDIRS.items():
        if os.path.isdir(os.path.join(path, sub)):
            return os.path.join(path, sub), variant
    if any(os.path.isfile(os.path.join(path, name)) for name in ("test_batch", "data_batch_1")):
        return path, "cifar10"
    if os.path.isfile(os.path.join(path, "meta")) and any(
        os.path.isfile(os.path.join(path, n)) for n in ("train", "test")
    ):
        return path, "cifar100"
    return None


CIFAR_SPLITS = ("train", "val", "test")  # val and test both mean the test batch


def cifar_files(root: str, variant: str, split: str) -> list[str]:
    """The pickles of a split: CIFAR-10's five data batches or test
    batch, CIFAR-100's train or test."""
    if variant == "cifar10":
        return [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    return ["train" if split == "train" else "test"]


def _unpickle(path: str) -> dict:
    # CIFAR's python version is a pickle by design (unpickling runs
    # code: use files you trust).
    try:
        with open(path, "rb") as f:
            return pickle.load(f, encoding="latin1")
    except (pickle.UnpicklingError, EOFError, ValueError, AttributeError, ImportError) as e:
        raise UserError(f"{path} is not a readable CIFAR python pickle ({e})") from None


def cifar_classes(root: str, variant: str) -> list[str]:
    """Class names from batches.meta / meta, or '0'.. when the meta file
    is absent."""
    meta, key, n = (
        ("batches.meta", "label_names", 10)
        if variant == "cifar10"
        else ("meta", "fine_label_names", 100)
    )
    path = os.path.join(root, meta)
    return list(_unpickle(path)[key]) if os.path.isfile(path) else [str(i) for i in range(n)]


def load_cifar(
    root: str, variant: str, split: str, key: str
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """uint8 images [N, 3, 32, 32], int64 labels [N] and class names of
    one split.

    Read by hand: torchvision's CIFAR10/CIFAR100 check the md5 sums of
    the official files, which the tiny fixtures of the tests (and any
    subset a user makes) cannot match.
    """
    check_split_name(split, CIFAR_SPLITS, key, variant)
    names = cifar_files(root, variant, split)
    missing = [n for n in names if not os.path.isfile(os.path.join(root, n))]
    if missing:
        raise UserError(
            f"{key}.DATASET: the {variant} folder {root} lacks {', '.join(missing)} (the files of "
            f"split {split!r})"
        )
    label_key = "labels" if variant == "cifar10" else "fine_labels"
    batches = [_unpickle(os.path.join(root, n)) for n in names]
    try:
        data = np.concatenate([np.asarray(b["data"], dtype=np.uint8) for b in batches])
        labels = np.concatenate([np.asarray(b[label_key], dtype=np.int64) for b in batches])
    except (KeyError, TypeError) as e:
        raise UserError(
            f"{key}.DATASET: {root} holds pickles without the CIFAR keys data/{label_key} ({e!r})"
        ) from None
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32))  # rows are R plane, G plane, B plane
    return images, torch.from_numpy(labels), cifar_classes(root, variant)


def cifar_source(cfg: CfgNode, key: str) -> TensorSource:
    """The split of the CIFAR folder cfg[key].DATASET, with CIFAR's
    recipe (4 px pad-and-crop, flips) and statistics."""
    root, variant = find_cifar(cfg[key].DATASET)
    images, labels, classes = load_cifar(root, variant, cfg[key].SPLIT, key)
    stats = CIFAR10_STATS if variant == "cifar10" else CIFAR100_STATS
    return TensorSource(images, labels, classes, stats, pad=4, flip=True)

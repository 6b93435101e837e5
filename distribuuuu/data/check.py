"""The preflight check of TRAIN.DATASET / TEST.DATASET, run before any process group starts.

Every rank runs it on the same config and files, so a bad path ends every rank with exit status 2
instead of one rank failing while the others wait in a collective. It decodes no image: folders
are scanned up to the first image of each class (all of TRAIN's images when TRAIN.VAL_SPLIT is set,
whose per-class counts decide whether every class keeps training samples).
"""

from __future__ import annotations

import os

import numpy as np
from yacs.config import CfgNode

from distribuuuu.data import sources, split
from distribuuuu.data.loaders import require_image_chans, val_folder_classes
from distribuuuu.errors import UserError

_NAMED = 5  # how many offending class folders a message names


def _scan_folder(cfg: CfgNode, key: str, count_up_to: int) -> tuple[int, int]:
    """Number of classes and of images (exact below count_up_to, else >= count_up_to)."""
    group = cfg[key]
    split_dir = sources.folder_split_dir(group.DATASET, group.SPLIT, key)
    classes = sources.folder_classes(split_dir)
    if not classes:
        raise UserError(f"{key}.DATASET: {split_dir} holds no class folders; expected {sources.LAYOUT} "
                        f"(e.g. {os.path.join(split_dir, 'cat', '0001.jpg')})")
    counts = {c: sources.count_images(os.path.join(split_dir, c), 1) for c in classes}
    empty = [c for c, n in counts.items() if n == 0]
    if empty:
        more = f" and {len(empty) - _NAMED} more" if len(empty) > _NAMED else ""
        raise UserError(f"{key}.DATASET: {len(empty)} class folder(s) in {split_dir} hold no image file "
                        f"({', '.join(empty[:_NAMED])}{more}); put images in them or remove them")
    total = len(classes)  # one image per class so far; count on only when more are needed
    if total < count_up_to:
        total = 0
        for c in classes:
            total += sources.count_images(os.path.join(split_dir, c), count_up_to - total)
            if total >= count_up_to:
                break
    if key == "TEST":
        val_folder_classes(cfg, classes)  # val classes must be train classes
        if cfg.TEST.IM_SIZE < cfg.TRAIN.IM_SIZE:
            raise UserError(f"TEST.IM_SIZE ({cfg.TEST.IM_SIZE}) must be >= TRAIN.IM_SIZE "
                            f"({cfg.TRAIN.IM_SIZE}): val images are resized to TEST.IM_SIZE, then "
                            "center-cropped to TRAIN.IM_SIZE")
    return len(classes), total


def _scan(cfg: CfgNode, key: str, count_up_to: int) -> tuple[int, int]:
    """(number of classes, number of samples) of cfg[key].DATASET, with the source's own checks."""
    group = cfg[key]
    kind = sources.source_kind(group.DATASET)
    if kind == "synthetic":
        return cfg.MODEL.NUM_CLASSES, group.SYNTHETIC_SAMPLES
    require_image_chans(cfg, key)
    if kind == "mnist5k":
        sources.check_split_name(group.SPLIT, sources.MNIST_SPLITS, key, "mnist5k")
        return len(sources.MNIST_CLASSES), len(sources.mnist5k_split_indices()[group.SPLIT])
    if kind == "cifar":
        root, variant = sources.find_cifar(group.DATASET)
        _, labels, classes = sources.load_cifar(root, variant, group.SPLIT, key)
        return len(classes), len(labels)
    return _scan_folder(cfg, key, count_up_to)


def _train_class_counts(cfg: CfgNode) -> dict[str, int]:
    """{class: number of samples} of TRAIN.DATASET (after _scan has checked it)."""
    group = cfg.TRAIN
    kind = sources.source_kind(group.DATASET)
    if kind == "synthetic":  # label i mod NUM_CLASSES
        n, c = group.SYNTHETIC_SAMPLES, cfg.MODEL.NUM_CLASSES
        return {str(k): n // c + (k < n % c) for k in range(c) if n // c + (k < n % c)}
    if kind in ("mnist5k", "cifar"):
        if kind == "mnist5k":
            labels = sources.mnist5k_arrays()[1][sources.mnist5k_split_indices()[group.SPLIT]]
            names = sources.MNIST_CLASSES
        else:
            _, targets, names = sources.load_cifar(*sources.find_cifar(group.DATASET), group.SPLIT, "TRAIN")
            labels = targets.numpy()
        classes, counts = np.unique(labels, return_counts=True)
        return {(names[k] if k < len(names) else str(k)): int(n) for k, n in zip(classes, counts)}
    split_dir = os.path.join(group.DATASET, group.SPLIT)
    return {c: sources.count_images(os.path.join(split_dir, c), 2**62) for c in sources.folder_classes(split_dir)}


def _check_val_split(cfg: CfgNode) -> tuple[int, int]:
    """(training samples, of which TRAIN.VAL_SPLIT holds out) (UserError if it cannot work)."""
    if sources.source_kind(cfg.TRAIN.DATASET) == "folder" and cfg.TEST.IM_SIZE < cfg.TRAIN.IM_SIZE:
        raise UserError(f"TEST.IM_SIZE ({cfg.TEST.IM_SIZE}) must be >= TRAIN.IM_SIZE ({cfg.TRAIN.IM_SIZE}): "
                        "the images TRAIN.VAL_SPLIT holds out are resized to TEST.IM_SIZE, then "
                        "center-cropped to TRAIN.IM_SIZE")
    counts = _train_class_counts(cfg)
    return sum(counts.values()), split.check_holdout(counts, cfg.TRAIN.VAL_SPLIT)


def check_datasets(cfg: CfgNode, world_size: int, train: bool = True) -> None:
    """Raise UserError when the data of cfg cannot work; train=False checks TEST only (eval)."""
    if cfg.MODEL.DUMMY_INPUT:
        return  # random tensors: nothing on disk to check
    for key in (("TRAIN", "TEST") if train else ("TEST",)):
        n_classes, n = _scan(cfg, key, count_up_to=world_size if key == "TRAIN" else 1)
        if n_classes > cfg.MODEL.NUM_CLASSES:
            raise UserError(f"{key}.DATASET {cfg[key].DATASET!r} has {n_classes} classes but "
                            f"MODEL.NUM_CLASSES is {cfg.MODEL.NUM_CLASSES}; set MODEL.NUM_CLASSES {n_classes}")
        if key == "TRAIN" and cfg.TRAIN.VAL_SPLIT:
            n, held = _check_val_split(cfg)  # n: all of them, where _scan may have stopped counting
            n, kept = n - held, f" left after TRAIN.VAL_SPLIT holds out {held}"
        else:
            kept = ""
        if key == "TRAIN" and n < world_size:
            raise UserError(f"world size {world_size} is larger than the {n} training samples{kept} of "
                            f"TRAIN.DATASET {cfg.TRAIN.DATASET!r}; use at most {n} processes or more data")

"""The preflight check of TRAIN.DATASET / TEST.DATASET, run before any process group starts.

Every rank runs it on the same config and files, so a bad path ends every rank with exit status 2
instead of one rank failing while the others wait in a collective. Image folders are listed whole,
in one walk (integrity.list_split, the listing the datasets use): a symlink loop or (unless
TRAIN.DUPLICATE_IMAGES keep) the same real file listed twice is refused, and so is a class folder
with no image that decodes (files are opened until one does: about one open per class). The
training set must hold at least one optimizer step, TRAIN.BATCH_SIZE x processes x ACCUM_STEPS
samples: an epoch drops its last partial step, so a smaller set would train on nothing.
"""

from __future__ import annotations

import os

import numpy as np
from yacs.config import CfgNode

from distribuuuu.data import integrity, registry, sources, split
from distribuuuu.data.datasets import require_image_chans, tensor_source, val_folder_classes
from distribuuuu.data.pipeline import data_pipeline
from distribuuuu.data.shards import plan
from distribuuuu.data.shards.index import load_shard_set
from distribuuuu.errors import UserError

_NAMED = 5  # how many offending class folders a message names


def _scan_folder(cfg: CfgNode, key: str) -> dict[str, int]:
    """{class: number of images} of a folder split, after refusing what cannot work."""
    group = cfg[key]
    split_dir = sources.folder_split_dir(group.DATASET, group.SPLIT, key)
    classes = sources.folder_classes(split_dir)
    if not classes:
        raise UserError(f"{key}.DATASET: {split_dir} holds no class folders; expected {sources.LAYOUT} "
                        f"(e.g. {os.path.join(split_dir, 'cat', '0001.jpg')})")
    listing = integrity.list_split(split_dir, classes)
    integrity.require_no_loop(listing, key)
    if cfg.TRAIN.DUPLICATE_IMAGES == "fail":
        integrity.require_no_duplicates(listing, key)
    counts = {c: listing.count(c) for c in classes}
    empty = [c for c, n in counts.items() if n == 0]
    if empty:
        more = f" and {len(empty) - _NAMED} more" if len(empty) > _NAMED else ""
        raise UserError(f"{key}.DATASET: {len(empty)} class folder(s) in {split_dir} hold no image file "
                        f"({', '.join(empty[:_NAMED])}{more}); put images in them or remove them")
    _require_readable_classes(listing, key)
    if key == "TEST":
        val_folder_classes(cfg, classes)  # val classes must be train classes
        if cfg.TEST.IM_SIZE < cfg.TRAIN.IM_SIZE:
            raise UserError(f"TEST.IM_SIZE ({cfg.TEST.IM_SIZE}) must be >= TRAIN.IM_SIZE "
                            f"({cfg.TRAIN.IM_SIZE}): val images are resized to TEST.IM_SIZE, then "
                            "center-cropped to TRAIN.IM_SIZE")
    return counts


def _require_readable_classes(listing: integrity.SplitListing, key: str) -> None:
    """UserError naming the class folders none of whose files decodes (they would never be trained
    on, or evaluated); a class costs one open when its first file is good."""
    dead = []
    for c in listing.classes:
        path, why = integrity.first_readable(listing.files(c))
        if path is None:
            dead.append(f"{c} ({listing.count(c)} files; {why})")
    if dead:
        more = f" and {len(dead) - _NAMED} more" if len(dead) > _NAMED else ""
        raise UserError(f"{key}.DATASET: every image file of {len(dead)} class folder(s) in {listing.split_dir} "
                        f"is unreadable: {'; '.join(dead[:_NAMED])}{more}. Replace them with images that open, "
                        "or remove the class folder(s)")


def _scan(cfg: CfgNode, key: str) -> tuple[int, int, dict[str, int] | None]:
    """(number of classes, number of samples, {class: samples} of a folder else None) of
    cfg[key].DATASET, with the source's own checks."""
    group = cfg[key]
    kind = sources.source_kind(group.DATASET)
    if kind == "shards":  # counts and classes from the index; every shard present at its size
        require_image_chans(cfg, key)
        shard_set = load_shard_set(group.DATASET, group.SPLIT, key)
        return len(shard_set.classes), shard_set.num_samples, None
    if kind not in ("cifar", "folder"):  # a registered source: mnist5k, synthetic or a user's
        data = registry.build_source(cfg, key)
        tensor_source(cfg, key, data)  # the channel checks of a TensorSource
        return len(data.classes), len(data.targets), None
    require_image_chans(cfg, key)
    if kind == "cifar":
        root, variant = sources.find_cifar(group.DATASET)
        _, labels, classes = sources.load_cifar(root, variant, group.SPLIT, key)
        return len(classes), len(labels), None
    counts = _scan_folder(cfg, key)
    return len(counts), sum(counts.values()), counts


def _train_class_counts(cfg: CfgNode, folder_counts: dict[str, int] | None) -> dict[str, int]:
    """{class: number of samples} of TRAIN.DATASET (folder_counts: _scan's, for a folder)."""
    group = cfg.TRAIN
    kind = sources.source_kind(group.DATASET)
    if kind != "folder":
        if kind == "cifar":
            _, targets, names = sources.load_cifar(*sources.find_cifar(group.DATASET), group.SPLIT, "TRAIN")
        else:  # a registered source (synthetic's targets are i mod NUM_CLASSES, made without images)
            data = registry.build_source(cfg, "TRAIN")
            targets, names = data.targets, data.classes
        labels = np.asarray(targets)
        classes, counts = np.unique(labels, return_counts=True)
        return {(names[k] if k < len(names) else str(k)): int(n) for k, n in zip(classes, counts)}
    return dict(folder_counts or {})


def _check_val_split(cfg: CfgNode, folder_counts: dict[str, int] | None) -> tuple[int, int]:
    """(training samples, of which TRAIN.VAL_SPLIT holds out) (UserError if it cannot work)."""
    if sources.source_kind(cfg.TRAIN.DATASET) == "folder" and cfg.TEST.IM_SIZE < cfg.TRAIN.IM_SIZE:
        raise UserError(f"TEST.IM_SIZE ({cfg.TEST.IM_SIZE}) must be >= TRAIN.IM_SIZE ({cfg.TRAIN.IM_SIZE}): "
                        "the images TRAIN.VAL_SPLIT holds out are resized to TEST.IM_SIZE, then "
                        "center-cropped to TRAIN.IM_SIZE")
    counts = _train_class_counts(cfg, folder_counts)
    return sum(counts.values()), split.check_holdout(counts, cfg.TRAIN.VAL_SPLIT)


def _require_one_step(cfg: CfgNode, n: int, kept: str, world_size: int) -> None:
    """UserError when n training samples make no whole optimizer step (an epoch would run none)."""
    batch, accum = cfg.TRAIN.BATCH_SIZE, cfg.TRAIN.ACCUM_STEPS
    step = batch * world_size * accum
    if n >= step:
        return
    per_rank = n // world_size
    fix = (f"set TRAIN.BATCH_SIZE {per_rank // accum} or less" if per_rank >= accum
           else f"set TRAIN.ACCUM_STEPS {per_rank} or less and TRAIN.BATCH_SIZE 1")
    raise UserError(f"TRAIN.DATASET {cfg.TRAIN.DATASET!r} has {n} training samples{kept}, {per_rank} per process, "
                    f"but one optimizer step takes TRAIN.BATCH_SIZE {batch} x {world_size} process(es) x "
                    f"TRAIN.ACCUM_STEPS {accum} = {step}: an epoch would run no step; {fix}, or use more data")


def check_datasets(cfg: CfgNode, world_size: int, train: bool = True) -> None:
    """Raise UserError when the data of cfg cannot work; train=False checks TEST only (eval)."""
    if cfg.MODEL.DUMMY_INPUT:
        return  # random tensors: nothing on disk to check
    for key in (("TRAIN", "TEST") if train else ("TEST",)):
        if cfg.TRAIN.DATA_PIPELINE == "memory":  # refused here, before any process starts, if impossible
            data_pipeline(cfg, key)
        n_classes, n, folder_counts = _scan(cfg, key)
        _require_class_count(cfg, key, n_classes)
        if key == "TRAIN" and cfg.TRAIN.VAL_SPLIT and sources.source_kind(cfg.TRAIN.DATASET) == "shards":
            raise UserError("TRAIN.VAL_SPLIT holds out random samples, which a shard set (read as a stream) cannot "
                            "give; shard a val split too (`distribuuuu data shard` writes one per folder) and set "
                            "TEST.DATASET to it, with TRAIN.VAL_SPLIT 0")
        if key == "TRAIN" and cfg.TRAIN.VAL_SPLIT:
            n, held = _check_val_split(cfg, folder_counts)
            n, kept = n - held, f" left after TRAIN.VAL_SPLIT holds out {held}"
        else:
            kept = ""
        if key == "TRAIN" and n < world_size:
            raise UserError(f"world size {world_size} is larger than the {n} training samples{kept} of "
                            f"TRAIN.DATASET {cfg.TRAIN.DATASET!r}; use at most {n} processes or more data")
        if key == "TRAIN":
            train_n, train_kept = n, kept
    if train:  # after TEST's checks: a wrong path or layout is the first thing to hear about
        _require_one_step(cfg, train_n, train_kept, world_size)
        if sources.source_kind(cfg.TRAIN.DATASET) == "shards":
            _require_no_empty_step(cfg, train_n, world_size)


def _require_class_count(cfg: CfgNode, key: str, n_classes: int) -> None:
    """The model has one output per training class: MODEL.NUM_CLASSES must be the TRAIN data's count
    (outputs without a class would appear in the model card as made-up names), and the TEST data may
    hold no more classes than that."""
    num = cfg.MODEL.NUM_CLASSES
    if n_classes == num or (key == "TEST" and n_classes < num):
        return
    fix = "leave MODEL.NUM_CLASSES unset (0) to follow the data" if key == "TRAIN" else \
        f"evaluate on data of at most {num} classes"
    raise UserError(f"{key}.DATASET {cfg[key].DATASET!r} has {n_classes} classes but MODEL.NUM_CLASSES is {num}; "
                    f"{fix}, or set MODEL.NUM_CLASSES {n_classes}")


def _require_no_empty_step(cfg: CfgNode, n: int, world_size: int) -> None:
    """Shards run every sample in equal step counts (shards/plan.py): refuse a plan where a rank has an empty step."""
    batch, accum = cfg.TRAIN.BATCH_SIZE, cfg.TRAIN.ACCUM_STEPS
    if plan.smallest_train_batch(n, world_size, batch, accum) < 1:
        raise UserError(f"TRAIN.DATASET {cfg.TRAIN.DATASET!r}: {n} samples over {world_size} process(es) in "
                        f"{plan.train_steps(n, world_size, batch, accum)} steps (TRAIN.BATCH_SIZE {batch}, ACCUM_STEPS "
                        f"{accum}) would leave a step without a sample on some process; raise TRAIN.BATCH_SIZE to 2 "
                        "or more, or lower TRAIN.ACCUM_STEPS")

"""The per-sample dataset of one split (cfg[key]) with its transforms, which every pipeline starts from.

mnist5k, CIFAR and any registered TensorSource are uint8 tensors (tensor_source); image folders are
listed and decoded per item (sources.ImageFolderWithClasses); synthetic data, a registered Dataset and
MODEL.DUMMY_INPUT are ready tensors, never transformed. The crop, flip, interpolation and mean/std
follow the data recipe (recipe.py). With batched=True (TRAIN.IMAGE_DECODE fast) folder items are uint8
crops (transforms.FastTrainDecode / FastEvalDecode), normalized per batch on the device by the loader.

TRAIN.VAL_SPLIT > 0 cuts the TRAIN data in two (split.holdout_indices, the same on every rank and
run): each part is a SplitPart of the full dataset (part_of).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

import numpy as np
from torch.utils.data import Dataset, Subset
from torchvision.transforms import v2
from yacs.config import CfgNode

from distribuuuu.data import registry, sources, split, transforms
from distribuuuu.data.recipe import recipe_of
from distribuuuu.data.registry import TensorSource
from distribuuuu.errors import UserError


def require_image_chans(cfg: CfgNode, key: str) -> None:
    """Image files become 1 (gray) or 3 (RGB) channels; other counts only exist for synthetic data."""
    chans = cfg.MODEL.IN_CHANS
    if chans not in (1, 3):
        raise UserError(f"MODEL.IN_CHANS is {chans}, but {key}.DATASET {cfg[key].DATASET!r} holds images, "
                        "which become 1 (gray) or 3 (RGB) channels; set MODEL.IN_CHANS 1 or 3 "
                        "(only the synthetic source makes any channel count)")


def val_folder_classes(cfg: CfgNode, val_classes: list[str]) -> list[str]:
    """Label order for a val folder: the train folder's, when there is one.

    ImageFolder numbers the classes it finds, so a val split lacking a class folder would shift
    every later label; the model's labels are the train split's, so those are used.
    """
    if sources.source_kind(cfg.TRAIN.DATASET) != "folder":
        return val_classes
    train_dir = os.path.join(cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT)
    if not os.path.isdir(train_dir):
        return val_classes  # e.g. evaluating on a machine without the training images
    train_classes = sources.folder_classes(train_dir)
    known = set(train_classes)
    extra = [c for c in val_classes if c not in known]
    if extra:
        raise UserError(f"TEST.DATASET has class folders that the training split {train_dir} lacks: "
                        f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}; val classes must be "
                        "a subset of the train classes")
    return train_classes


def registered_data(cfg: CfgNode, key: str) -> TensorSource | Dataset | None:
    """What the registered source cfg[key].DATASET (mnist5k, synthetic or a user's) builds for
    cfg[key].SPLIT; None for CIFAR, folders and MODEL.DUMMY_INPUT."""
    if cfg.MODEL.DUMMY_INPUT or sources.source_kind(cfg[key].DATASET) in ("cifar", "folder", "shards"):
        return None
    return registry.build_source(cfg, key)


def tensor_source(cfg: CfgNode, key: str, data: TensorSource | Dataset | None = None) -> TensorSource | None:
    """The split of cfg[key] as a TensorSource whose channels and stats match MODEL.IN_CHANS:
    CIFAR, or a registered source that builds one (data: registered_data's, if already built);
    None for other sources."""
    group, chans = cfg[key], cfg.MODEL.IN_CHANS
    kind = sources.source_kind(group.DATASET)
    if cfg.MODEL.DUMMY_INPUT or kind in ("folder", "shards"):
        return None
    if kind == "cifar":
        require_image_chans(cfg, key)
        root, variant = sources.find_cifar(group.DATASET)
        images, labels, classes = sources.load_cifar(root, variant, group.SPLIT, key)
        stats = transforms.CIFAR10_STATS if variant == "cifar10" else transforms.CIFAR100_STATS
        return TensorSource(transforms.match_channels(images, chans), labels, classes,
                            transforms.stats_for_channels(stats, chans), pad=4, flip=True)
    src = registry.build_source(cfg, key) if data is None else data
    if not isinstance(src, TensorSource):
        return None
    have = src.images.shape[1]
    if have != chans:
        require_image_chans(cfg, key)
        if have not in (1, 3):
            raise UserError(f"MODEL.IN_CHANS is {chans}, but {key}.DATASET {group.DATASET!r} has {have}-channel "
                            f"images; set MODEL.IN_CHANS {have}")
    return dataclasses.replace(src, images=transforms.match_channels(src.images, chans),
                               stats=transforms.stats_for_channels(src.stats, chans))


def build_dataset(cfg: CfgNode, train: bool) -> Dataset:
    """The whole TRAIN (train=True, augmented) or TEST dataset, with its transforms; see the package
    docstring. Items are (float32 [C, H, W] normalized, int label), one at a time."""
    return build_split_dataset(cfg, "TRAIN" if train else "TEST", train, batched=False)


def augment_policy(cfg: CfgNode) -> v2.Transform | None:
    """TRAIN.AUTO_AUGMENT's policy of one uint8 image (None for 'none')."""
    return transforms.augment_policy(cfg.TRAIN.AUTO_AUGMENT, cfg.TRAIN.RANDAUG_MAGNITUDE)


def build_split_dataset(cfg: CfgNode, key: str, train: bool, batched: bool) -> Dataset:
    """The data of cfg[key], with the training transforms (train) or the eval ones.

    batched=True (the loaders, with TRAIN.IMAGE_DECODE fast): folder items stay uint8, to be
    normalized (and erased) per batch on the device (see batches.NormalizedBatches)."""
    group, chans, size = cfg[key], cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE  # val crops TRAIN.IM_SIZE too
    if cfg.MODEL.DUMMY_INPUT:
        return sources.RandomTensorDataset(group.SYNTHETIC_SAMPLES, cfg.MODEL.NUM_CLASSES,
                                           (chans, size, size), seed=0 if key == "TRAIN" else 1)
    data = registered_data(cfg, key)
    if data is not None and not isinstance(data, TensorSource):
        return data  # synthetic or a user's Dataset: items are ready, not transformed
    policy, erase = (augment_policy(cfg), cfg.TRAIN.RANDOM_ERASE) if train else (None, 0.0)
    src, recipe = tensor_source(cfg, key, data), recipe_of(cfg)
    if src is not None:
        native, stats = src.images.shape[-1], transforms.stats_for_channels(recipe.stats or src.stats, chans)
        tf = transforms.small_image_transform(train, size, native, pad=src.pad, flip=src.flip, stats=stats,
                                              policy=policy, erase=erase, recipe=recipe)
        return sources.TensorImageDataset(src.images, src.targets, src.classes, tf)
    require_image_chans(cfg, key)
    split_dir = sources.folder_split_dir(group.DATASET, group.SPLIT, key)
    classes = sources.folder_classes(split_dir)
    if key == "TEST":
        classes = val_folder_classes(cfg, classes)
    mode = "L" if chans == 1 else "RGB"
    if batched:  # decode + geometry in the loader callable, so its errors meet the bad-image handling
        load: Callable = (transforms.FastTrainDecode(size, mode, recipe) if train else
                          transforms.FastEvalDecode(recipe.eval_resize(size, cfg.TEST.IM_SIZE), size, mode, recipe))
        # The policy runs per item here, in the worker processes; erasing follows the batch normalization.
        return sources.ImageFolderWithClasses(split_dir, classes, cfg.TRAIN.BAD_IMAGES, loader=load,
                                              transform=policy, replace_bad=train, key=key)
    tf = transforms.folder_transform(train, size, cfg.TEST.IM_SIZE, chans, policy=policy, erase=erase, recipe=recipe)
    load = functools.partial(sources.open_image, mode=mode)
    return sources.ImageFolderWithClasses(split_dir, classes, cfg.TRAIN.BAD_IMAGES, transform=tf, loader=load,
                                          replace_bad=train, key=key)


class SplitPart(Subset):
    """The part of a dataset that TRAIN.VAL_SPLIT keeps for training or holds out: item i is
    dataset[indices[i]]. Keeps the dataset's classes and its count of unreadable images."""

    def __init__(self, dataset: Dataset, indices: np.ndarray) -> None:
        super().__init__(dataset, indices.tolist())
        self.classes = dataset.classes

    def take_bad_count(self) -> int:
        take = getattr(self.dataset, "take_bad_count", None)
        return take() if take else 0


def part_of(cfg: CfgNode, dataset: Dataset, part: str | None) -> Dataset:
    """dataset itself (part None), or its 'train' / 'val' part under TRAIN.VAL_SPLIT."""
    if part is None:
        return dataset
    kept, held = split.holdout_indices(np.asarray(dataset.targets), cfg.TRAIN.VAL_SPLIT)
    return SplitPart(dataset, kept if part == "train" else held)

"""Datasets with their transforms, and the train / val DataLoaders of one rank."""

from __future__ import annotations

import functools
import os
import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from yacs.config import CfgNode

from distribuuuu.data import sources, transforms
from distribuuuu.data.samplers import ResumableDistributedSampler, ShardedEvalSampler
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


def build_dataset(cfg: CfgNode, train: bool) -> Dataset:
    """The TRAIN (train=True) or TEST dataset, with its transforms; see the package docstring."""
    key = "TRAIN" if train else "TEST"
    group, chans, size = cfg[key], cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE  # val crops TRAIN.IM_SIZE too
    if cfg.MODEL.DUMMY_INPUT:
        return sources.RandomTensorDataset(group.SYNTHETIC_SAMPLES, cfg.MODEL.NUM_CLASSES,
                                           (chans, size, size), seed=0 if train else 1)
    kind = sources.source_kind(group.DATASET)
    if kind == "synthetic":
        return sources.SyntheticDataset(group.SYNTHETIC_SAMPLES, cfg.MODEL.NUM_CLASSES, chans, size,
                                        group.SPLIT)
    require_image_chans(cfg, key)
    if kind == "mnist5k":
        images, labels = sources.load_mnist5k(group.SPLIT, key)
        stats = transforms.stats_for_channels(transforms.MNIST_STATS, chans)
        # Digits are not mirror-symmetric, so no flip; 2 px padding (of 28) as CIFAR's 4 (of 32).
        tf = transforms.small_image_transform(train, size, 28, pad=2, flip=False, stats=stats)
        return sources.TensorImageDataset(transforms.match_channels(images, chans), labels,
                                          list(sources.MNIST_CLASSES), tf)
    if kind == "cifar":
        root, variant = sources.find_cifar(group.DATASET)
        images, labels, classes = sources.load_cifar(root, variant, group.SPLIT, key)
        stats = transforms.CIFAR10_STATS if variant == "cifar10" else transforms.CIFAR100_STATS
        stats = transforms.stats_for_channels(stats, chans)
        tf = transforms.small_image_transform(train, size, 32, pad=4, flip=True, stats=stats)
        return sources.TensorImageDataset(transforms.match_channels(images, chans), labels, classes, tf)
    split_dir = sources.folder_split_dir(group.DATASET, group.SPLIT, key)
    classes = sources.folder_classes(split_dir)
    if not train:
        classes = val_folder_classes(cfg, classes)
    tf = transforms.folder_transform(train, size, cfg.TEST.IM_SIZE, chans)
    loader = functools.partial(sources.open_image, mode="L" if chans == 1 else "RGB")
    return sources.ImageFolderWithClasses(split_dir, classes, cfg.TRAIN.BAD_IMAGES, transform=tf, loader=loader)


def seed_worker(worker_id: int) -> None:
    """torch seeds each worker itself (base seed + worker id); numpy and random need it too.
    From torch's reproducibility notes."""
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def _loader(cfg: CfgNode, dataset: Dataset, sampler: Sampler, batch_size: int, drop_last: bool,
            rank: int, device: torch.device, stream: int) -> DataLoader:
    workers = cfg.TRAIN.WORKERS
    # The generator draws the workers' base seed: fixed by RNG_SEED (or the seed torch was given
    # when RNG_SEED is None), different per rank and per loader so augmentations differ.
    base = cfg.RNG_SEED if cfg.RNG_SEED is not None else torch.initial_seed()
    generator = torch.Generator()
    generator.manual_seed(int(np.random.SeedSequence([base % 2**64, rank, stream]).generate_state(1)[0]))
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
        num_workers=workers, persistent_workers=workers > 0,
        pin_memory=cfg.TRAIN.PIN_MEMORY and device.type == "cuda",
        worker_init_fn=seed_worker, generator=generator,
    )


def build_train_loader(cfg: CfgNode, rank: int, world_size: int, device: torch.device) -> DataLoader:
    """Shuffled by a ResumableDistributedSampler even for one process, so the engine can always
    call loader.sampler.set_epoch(epoch, start); the same seed on every rank gives disjoint shards."""
    dataset = build_dataset(cfg, train=True)
    seed = cfg.RNG_SEED or 0
    sampler = ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=seed)
    # Drop the last partial batch (a BatchNorm batch of 1 fails) unless that would leave nothing.
    drop_last = len(sampler) >= cfg.TRAIN.BATCH_SIZE
    return _loader(cfg, dataset, sampler, cfg.TRAIN.BATCH_SIZE, drop_last, rank, device, stream=0)


def build_val_loader(cfg: CfgNode, rank: int, world_size: int, device: torch.device) -> DataLoader:
    """Exact evaluation: each val sample is seen by exactly one rank (a rank may get none)."""
    dataset = build_dataset(cfg, train=False)
    sampler = ShardedEvalSampler(dataset, num_replicas=world_size, rank=rank)
    return _loader(cfg, dataset, sampler, cfg.TEST.BATCH_SIZE, False, rank, device, stream=1)


def take_bad_image_count(loader: DataLoader) -> int:
    """Unreadable images this process's loader skipped since the last call (0 for tensor sources)."""
    take = getattr(loader.dataset, "take_bad_count", None)
    return take() if take else 0

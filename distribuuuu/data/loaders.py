"""Datasets with their transforms, and the train / val / test loaders of one rank.

Which loader (TRAIN.DATA_PIPELINE): mnist5k, CIFAR and any registered TensorSource go through the
in-memory MemoryLoader (memory.py: the split on the device, batched augmentation) under 'auto', unless
the split would take more than MEMORY_PIPELINE_BUDGET_BYTES there (CIFAR training above ~80 px: the log
says so) or TRAIN.CROP_SCALE asks for resized crops (the in-memory path only pads and crops); image
folders, synthetic data (and a registered Dataset) and MODEL.DUMMY_INPUT through a DataLoader; shard
sets through shards/loader.py (every sample once per epoch, equal steps on every rank). With
TRAIN.IMAGE_DECODE fast, folder items are uint8 crops (transforms.FastTrainDecode / FastEvalDecode)
normalized per batch on the device. The crop, flip, interpolation and mean/std follow the data recipe
(recipe.py) on every path.
Every train loader has len(), .dataset, .sampler.set_epoch(epoch, start) and yields (images, target).
An unreadable folder image (TRAIN.BAD_IMAGES skip) is replaced by the next readable one in training
(every rank keeps its batch size); in evaluation it is left out of its batch (collate_readable), so
evaluation counts distinct readable images; both count it (take_bad_image_count).

TRAIN.VAL_SPLIT > 0 cuts the TRAIN data in two (split.holdout_indices, the same on every rank and
run): the train loader reads the kept part, the val loader the held-out part with the eval
transforms, each a SplitPart of the full dataset; the test loader always reads TEST.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset
from torchvision.transforms import v2
from yacs.config import CfgNode

from distribuuuu.data import registry, sources, split, transforms
from distribuuuu.data.batches import NormalizedBatches, ReadableBatches, collate_readable, seed_worker, track_workers
from distribuuuu.data.memory import MemoryLoader
from distribuuuu.data.recipe import log_recipe, recipe_of
from distribuuuu.data.registry import TensorSource
from distribuuuu.data.samplers import ResumableDistributedSampler, ShardedEvalSampler
from distribuuuu.data.shards.loader import build_shard_loader
from distribuuuu.errors import UserError

PIPELINES = ("auto", "memory", "loader")  # TRAIN.DATA_PIPELINE
# 'auto' keeps a split in memory only while it fits this budget (per rank, in host memory and again on
# the device): CIFAR's 50,000 training images are ~0.4 GB at 32 px but ~15 GB at 224 px.
MEMORY_PIPELINE_BUDGET_BYTES = 2 * 2**30
IMAGE_DECODERS = ("fast", "pil")  # TRAIN.IMAGE_DECODE

log = logging.getLogger("distribuuuu")


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
    return _build_dataset(cfg, "TRAIN" if train else "TEST", train, batched=False)


def _policy(cfg: CfgNode) -> v2.Transform | None:
    return transforms.augment_policy(cfg.TRAIN.AUTO_AUGMENT, cfg.TRAIN.RANDAUG_MAGNITUDE)


def _build_dataset(cfg: CfgNode, key: str, train: bool, batched: bool) -> Dataset:
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
    policy, erase = (_policy(cfg), cfg.TRAIN.RANDOM_ERASE) if train else (None, 0.0)
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


def _part(cfg: CfgNode, dataset: Dataset, part: str | None) -> Dataset:
    """dataset itself (part None), or its 'train' / 'val' part under TRAIN.VAL_SPLIT."""
    if part is None:
        return dataset
    kept, held = split.holdout_indices(np.asarray(dataset.targets), cfg.TRAIN.VAL_SPLIT)
    return SplitPart(dataset, kept if part == "train" else held)


def _loader(cfg: CfgNode, dataset: Dataset, sampler: Sampler, batch_size: int, drop_last: bool,
            rank: int, device: torch.device, stream: int, collate_fn: Callable | None = None) -> DataLoader:
    """TRAIN.WORKERS processes per training process (Distribuuuu's 4 by default; see
    docs/performance.md for sizing them from the cores), kept alive between epochs; pinned
    batches only when they go to a GPU; torch's prefetch_factor (2 batches per worker)."""
    workers = cfg.TRAIN.WORKERS
    # The generator draws the workers' base seed: fixed by RNG_SEED (or the seed torch was given
    # when RNG_SEED is None), different per rank and per loader so augmentations differ.
    base = cfg.RNG_SEED if cfg.RNG_SEED is not None else torch.initial_seed()
    generator = torch.Generator()
    generator.manual_seed(int(np.random.SeedSequence([base % 2**64, rank, stream]).generate_state(1)[0]))
    return track_workers(DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
        num_workers=workers, persistent_workers=workers > 0,
        pin_memory=cfg.TRAIN.PIN_MEMORY and device.type == "cuda",
        worker_init_fn=seed_worker, generator=generator, collate_fn=collate_fn,
    ))


def data_pipeline(cfg: CfgNode, key: str) -> str:
    """'memory' or 'loader' for cfg[key].DATASET under TRAIN.DATA_PIPELINE (UserError if impossible)."""
    choice = cfg.TRAIN.DATA_PIPELINE
    if choice not in PIPELINES:
        raise UserError(f"TRAIN.DATA_PIPELINE must be one of {', '.join(PIPELINES)}, got {choice!r}")
    if cfg.TRAIN.IMAGE_DECODE not in IMAGE_DECODERS:
        raise UserError(f"TRAIN.IMAGE_DECODE must be one of {', '.join(IMAGE_DECODERS)}, "
                        f"got {cfg.TRAIN.IMAGE_DECODE!r}")
    if cfg.MODEL.DUMMY_INPUT:
        return "loader"
    kind = sources.source_kind(cfg[key].DATASET)
    if choice == "memory" and kind in ("folder", "shards"):
        raise UserError(f"TRAIN.DATA_PIPELINE memory holds mnist5k, CIFAR or synthetic data, but {key}.DATASET "
                        f"{cfg[key].DATASET!r} is {'an image folder' if kind == 'folder' else 'a shard set'}; "
                        "use TRAIN.DATA_PIPELINE auto or loader")
    if kind in ("folder", "shards"):
        return "loader"
    if key == "TRAIN" and cfg.TRAIN.CROP_SCALE:  # the in-memory path only pads and crops
        if choice == "memory":
            raise UserError("TRAIN.DATA_PIPELINE memory pads and crops only; TRAIN.CROP_SCALE needs "
                            "TRAIN.DATA_PIPELINE auto or loader (auto then uses the DataLoader)")
        return "loader"
    if choice == "auto":
        if kind != "cifar" and not isinstance(registered_data(cfg, key), TensorSource):
            return "loader"
        need = memory_pipeline_bytes(cfg, key)
        if need > MEMORY_PIPELINE_BUDGET_BYTES:
            log.warning("TRAIN.DATA_PIPELINE auto: %s.DATASET at %d px would take %.1f GB per process in memory "
                        "(more than %.1f GB): using the DataLoader instead (TRAIN.DATA_PIPELINE memory forces it)",
                        key, cfg.TRAIN.IM_SIZE, need / 1e9, MEMORY_PIPELINE_BUDGET_BYTES / 1e9)
            return "loader"
        return "memory"
    return choice


def memory_pipeline_bytes(cfg: CfgNode, key: str) -> int:
    """An upper bound of the bytes the in-memory pipeline holds for cfg[key] (CIFAR or a registered
    TensorSource such as mnist5k): the uint8 split at TRAIN.IM_SIZE plus its padded copy (MemoryLoader).
    A CIFAR split is counted from its files' sizes, unread (3,072 bytes per image and a little more)."""
    if sources.source_kind(cfg[key].DATASET) != "cifar":  # a registered TensorSource: built, so counted
        src = registry.build_source(cfg, key)
        samples, pad = len(src.images), src.pad
    else:
        root, variant = sources.find_cifar(cfg[key].DATASET)
        train = cfg[key].SPLIT == "train"
        if variant == "cifar10":
            names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
        else:
            names = ["train" if train else "test"]
        paths = [os.path.join(root, n) for n in names]
        samples, pad = sum(os.path.getsize(p) for p in paths if os.path.isfile(p)) // (32 * 32 * 3), 4
    side = cfg.TRAIN.IM_SIZE
    return samples * cfg.MODEL.IN_CHANS * (side * side + (side + 2 * pad) ** 2)


def _memory_loader(cfg: CfgNode, key: str, train: bool, part: str | None,
                   sampler_of: Callable[[Sized], Sampler], batch_size: int, device: torch.device) -> MemoryLoader:
    """The MemoryLoader of cfg[key] (or its VAL_SPLIT part), augmented when train."""
    # The per-sample twin: len, classes, items for inspection (and the split's labels).
    dataset = _part(cfg, _build_dataset(cfg, key, train, batched=False), part)
    src = tensor_source(cfg, key)
    policy = erase = None
    if src is None:  # synthetic or a user's Dataset: generated once, already normalized, no augmentation
        images = torch.stack([dataset[i][0] for i in range(len(dataset))])
        targets = torch.tensor([dataset[i][1] for i in range(len(dataset))])
        pad, flip, normalize = 0, 0.0, None
    else:
        images, targets, pad, flip = src.images, src.targets, src.pad, src.flip
        if part is not None:  # the rows of the part, in its order: row i is dataset[i]
            rows = torch.as_tensor(dataset.indices, dtype=torch.long)
            images, targets = images[rows], targets[rows]
        recipe = recipe_of(cfg)  # the user's mean/std and flip probability, else the source's
        stats = transforms.stats_for_channels(recipe.stats or src.stats, cfg.MODEL.IN_CHANS)
        flip = recipe.flip_prob(flip)
        normalize = transforms.BatchNormalize(stats, device)
        if images.shape[-1] != cfg.TRAIN.IM_SIZE:  # resized once, as the per-sample recipe resizes first
            images = v2.functional.resize(images, [cfg.TRAIN.IM_SIZE] * 2, interpolation=recipe.mode, antialias=True)
        if train:
            policy = _policy(cfg)
            erase = transforms.BatchRandomErasing(cfg.TRAIN.RANDOM_ERASE) if cfg.TRAIN.RANDOM_ERASE > 0 else None
    sampler = sampler_of(dataset)
    drop_last = train and len(sampler) >= batch_size
    return MemoryLoader(dataset, images.to(device), targets.to(device), sampler, batch_size, drop_last,
                        pad=pad, flip=flip, train=train, normalize=normalize, policy=policy, erase=erase)


def build_train_loader(cfg: CfgNode, rank: int, world_size: int, device: torch.device) -> Any:
    """Shuffled by a ResumableDistributedSampler even for one process, so the engine can always
    call loader.sampler.set_epoch(epoch, start); the same seed on every rank gives disjoint shards
    (of the order with each index TRAIN.REPEATED_AUG times). With TRAIN.VAL_SPLIT, the kept part only.

    A DataLoader, or (TRAIN.DATA_PIPELINE) a MemoryLoader with the same order and interface.
    """
    # The engine passes a cfg whose RNG_SEED is the run's seed (drawn when the user gave None:
    # engine.state.seeded_cfg), so the logged seed repeats the shuffle; a tool without one gets 0.
    seed = cfg.RNG_SEED if cfg.RNG_SEED is not None else 0
    part = "train" if cfg.TRAIN.VAL_SPLIT else None
    _note_unaugmented(cfg, rank)
    if rank == 0:
        registry.warn_unstated_stats(cfg)
        log_recipe(cfg)
    pipeline = data_pipeline(cfg, "TRAIN")
    if _is_shards(cfg, "TRAIN"):
        return build_shard_loader(cfg, "TRAIN", True, rank, world_size, device, seed)

    def sampler_of(dataset: Sized) -> Sampler:
        return ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=seed,
                                           repeats=cfg.TRAIN.REPEATED_AUG)

    if pipeline == "memory":
        return _memory_loader(cfg, "TRAIN", True, part, sampler_of, cfg.TRAIN.BATCH_SIZE, device)
    batched = _fast_folder(cfg, "TRAIN")
    dataset = _part(cfg, _build_dataset(cfg, "TRAIN", True, batched=batched), part)
    sampler = sampler_of(dataset)
    folder = getattr(dataset, "dataset", dataset)  # (a VAL_SPLIT part's whole folder)
    if cfg.TRAIN.REPEATED_AUG == 1 and isinstance(folder, sources.ImageFolderWithClasses):  # copies need their own draws
        sampler.on_epoch = folder.seed_items
    # Drop the last partial batch (a BatchNorm batch of 1 fails) unless that would leave nothing.
    drop_last = len(sampler) >= cfg.TRAIN.BATCH_SIZE
    loader = _loader(cfg, dataset, sampler, cfg.TRAIN.BATCH_SIZE, drop_last, rank, device, stream=0)
    return _normalized(cfg, loader, device, erase=cfg.TRAIN.RANDOM_ERASE) if batched else loader


def build_val_loader(cfg: CfgNode, rank: int, world_size: int, device: torch.device) -> Any:
    """The validation data: with TRAIN.VAL_SPLIT > 0 the part of the TRAIN data held out from
    training, with the eval transforms; else the TEST data (as build_test_loader). Sharded exactly."""
    if not cfg.TRAIN.VAL_SPLIT:
        return build_test_loader(cfg, rank, world_size, device)
    return _eval_loader(cfg, "TRAIN", "val", rank, world_size, device)


def build_test_loader(cfg: CfgNode, rank: int, world_size: int, device: torch.device) -> Any:
    """The TEST data, whatever TRAIN.VAL_SPLIT is. Sharded exactly."""
    return _eval_loader(cfg, "TEST", None, rank, world_size, device)


def _eval_loader(cfg: CfgNode, key: str, part: str | None, rank: int, world_size: int,
                 device: torch.device) -> Any:
    """Exact evaluation: each sample is seen by exactly one rank (a rank may get none)."""
    pipeline = data_pipeline(cfg, key)
    if _is_shards(cfg, key):  # (TRAIN.VAL_SPLIT with shards is refused by check_datasets)
        return build_shard_loader(cfg, key, False, rank, world_size, device, 0)

    def sampler_of(dataset: Sized) -> Sampler:
        return ShardedEvalSampler(dataset, num_replicas=world_size, rank=rank)

    if pipeline == "memory":
        return _memory_loader(cfg, key, False, part, sampler_of, cfg.TEST.BATCH_SIZE, device)
    batched = _fast_folder(cfg, key)
    dataset = _part(cfg, _build_dataset(cfg, key, False, batched=batched), part)
    loader = ReadableBatches(_loader(cfg, dataset, sampler_of(dataset), cfg.TEST.BATCH_SIZE, False, rank, device,
                                      stream=1, collate_fn=collate_readable))
    return _normalized(cfg, loader, device) if batched else loader


def _note_unaugmented(cfg: CfgNode, rank: int) -> None:
    """Synthetic data, a registered Dataset and dummy input are never augmented (no crops either): say so once."""
    asked = cfg.TRAIN.AUTO_AUGMENT != "none" or cfg.TRAIN.RANDOM_ERASE > 0
    if not asked or rank != 0:
        return
    if cfg.MODEL.DUMMY_INPUT:
        what = "MODEL.DUMMY_INPUT"
    else:
        data, name = registered_data(cfg, "TRAIN"), cfg.TRAIN.DATASET
        if data is None or isinstance(data, TensorSource):
            return
        what = "synthetic data" if name == "synthetic" else f"the {name} source's items"
    log.warning("TRAIN.AUTO_AUGMENT and TRAIN.RANDOM_ERASE have no effect on %s: those images are "
                "not augmented", what)


def _is_shards(cfg: CfgNode, key: str) -> bool:
    return not cfg.MODEL.DUMMY_INPUT and sources.source_kind(cfg[key].DATASET) == "shards"


def _fast_folder(cfg: CfgNode, key: str) -> bool:
    """Whether cfg[key] is an image folder read by the fast path (uint8 items, batch normalization)."""
    return (cfg.TRAIN.IMAGE_DECODE == "fast" and not cfg.MODEL.DUMMY_INPUT
            and sources.source_kind(cfg[key].DATASET) == "folder")


def _normalized(cfg: CfgNode, loader: DataLoader, device: torch.device, erase: float = 0.0) -> NormalizedBatches:
    stats = transforms.stats_for_channels(recipe_of(cfg).stats or transforms.IMAGENET_STATS, cfg.MODEL.IN_CHANS)
    return NormalizedBatches(loader, stats, device, erase)


def take_bad_image_count(loader: DataLoader) -> int:
    """Unreadable images this process's loader skipped since the last call (0 for tensor sources)."""
    take = getattr(loader.dataset, "take_bad_count", None)
    return take() if take else 0

"""The in-memory input pipeline for small datasets (TRAIN.DATA_PIPELINE
memory; auto for mnist5k, CIFAR).

MemoryPipeline reads mnist5k, CIFAR and any registered TensorSource
under 'auto', unless the split would take more than
MEMORY_PIPELINE_BUDGET_BYTES on the device (CIFAR training above ~80 px:
the log says so) or TRAIN.CROP_SCALE asks for resized crops (this path
only pads and crops); forced, it also holds synthetic data and a
registered Dataset (stacked once, not augmented).

The whole split is one tensor on the training device (uint8 images, or
the synthetic source's floats). A batch is one indexing operation: the
pad-and-crop offsets and the horizontal flips of all its images are
folded into one gather, then the batch is normalized in two in-place
ops. No DataLoader, no worker processes, no per-sample Python or PIL: on
28-32 px images the per-sample path spends far more time in Python than
in arithmetic.

The loader keeps the interface the engine relies on: ``len(loader)``
batches, ``loader.dataset`` (the per-sample dataset, for its length and
classes), ``loader.sampler.set_epoch(epoch, start)``, and iteration
yielding ``(images, target)`` already on the device. The order is the
sampler's: a ResumableDistributedSampler for training (one seeded
permutation per epoch, ``start`` samples skipped, every W-th of the
rest, the tail of fewer than W dropped) and a ShardedEvalSampler for
validation, so a rank sees exactly the samples the DataLoader path would
give it. The random crops and flips come from the device's default
generator, seeded by the engine (RNG_SEED + rank) and saved in
checkpoints, as the augmentations of a DataLoader without workers.

TRAIN.AUTO_AUGMENT and TRAIN.RANDOM_ERASE are drawn per image too.
Erasing is batched (transforms.BatchRandomErasing, after the
normalization). A policy is a torchvision transform of one image, so it
runs in a Python loop over the batch, after the crop. That loop is the
price: on mnist5k with one CPU thread the path fell from ~178,000 to
~2,400 img/s with RandAugment (docs/recipes.md, Augmentation);
TRAIN.DATA_PIPELINE loader spreads that work over worker processes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sized

import torch
import torch.nn.functional as F
from torch.utils.data import Sampler
from torchvision.transforms import v2
from yacs.config import CfgNode

from distribuuuu.data import holdout, sources
from distribuuuu.data.loading.batches import BatchNormalize
from distribuuuu.data.loading.items import split_dataset
from distribuuuu.data.loading.pipeline import Pipeline, Place
from distribuuuu.data.sources import builtin, cifar, registry
from distribuuuu.data.transforms import (
    BatchRandomErasing,
    augment_policy,
    per_image,
    recipe_of,
    stats_for_channels,
)

# 'auto' keeps a split in memory only while it fits this budget (per
# rank, in host memory and again on the device): CIFAR's 50,000 training
# images are ~0.4 GB at 32 px but ~15 GB at 224 px.
MEMORY_PIPELINE_BUDGET_BYTES = 2 * 2**30

log = logging.getLogger("distribuuuu")


def flip_probability(flip: bool | float) -> float:
    """True means the classic 1/2, False 0; a float is the probability
    itself (TRAIN.FLIP_PROB)."""
    return 0.5 if flip is True else float(flip)


def pad_crop_flip(
    padded: torch.Tensor, index: torch.Tensor, size: int, pad: int, flip: bool | float
) -> torch.Tensor:
    """Random size x size crops of the images padded[index] (already
    padded by pad on every side), each mirrored left-right with
    probability 1/2 when flip is True (flip itself when a float).

    The offsets are uniform in [0, 2 * pad], as torchvision's
    RandomCrop(size, padding=pad) draws them. The batch is copied out
    once (index_select), then every crop and flip is one gather over the
    flattened planes: a mirrored crop simply reads its columns
    backwards. (A gather with one index tensor per dimension is about 5x
    slower on the CPU.)
    """
    b, chans, side = index.numel(), padded.shape[1], padded.shape[-1]
    device = padded.device
    span = torch.arange(size, device=device)
    rows = torch.randint(0, 2 * pad + 1, (b, 1), device=device) + span  # [B, size]
    cols = torch.randint(0, 2 * pad + 1, (b, 1), device=device) + span
    if flip:
        mirror = torch.rand(b, 1, device=device) < flip_probability(flip)
        cols = torch.where(mirror, cols.flip(1), cols)
    flat = (
        (rows[:, :, None] * side + cols[:, None, :])
        .view(b, 1, size * size)
        .expand(b, chans, size * size)
    )
    batch = padded.index_select(0, index).view(b, chans, side * side)
    return batch.gather(2, flat).view(b, chans, size, size)


class MemoryLoader:
    """Batches of one rank, cut from a tensor that holds the whole split
    on the device."""

    def __init__(
        self,
        dataset: Sized,
        images: torch.Tensor,
        targets: torch.Tensor,
        sampler: Sampler,
        batch_size: int,
        drop_last: bool,
        pad: int = 0,
        flip: bool | float = False,
        train: bool = True,
        normalize: Callable[[torch.Tensor], torch.Tensor] | None = None,
        policy: Callable[[torch.Tensor], torch.Tensor] | None = None,
        erase: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """images [N, C, S, S] and targets [N] on the training device;
        pad/flip only when train, as the policy (of one uint8 image,
        applied per image after the crop) and erase (of a normalized
        batch). flip: True (probability 1/2), False, or a probability."""
        self.dataset, self.sampler = dataset, sampler
        self.batch_size, self.drop_last = batch_size, drop_last
        self.size, self.pad, self.flip = (
            images.shape[-1],
            pad if train else 0,
            flip_probability(flip) if train else 0.0,
        )
        self.augment = train and (pad > 0 or self.flip > 0)
        self.policy, self.erase = (policy, erase) if train else (None, None)
        # Padded once here, so that a crop is a plain gather (no
        # per-batch padding, no masks).
        self.images = F.pad(images, (self.pad,) * 4) if self.pad else images
        self.targets, self.normalize = targets, normalize

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # The sampler's own indices (one host list per epoch), so the
        # order is the DataLoader's.
        order = torch.tensor(list(self.sampler), dtype=torch.long).to(self.images.device)
        for b in range(len(self)):
            index = order[b * self.batch_size : (b + 1) * self.batch_size]
            if self.augment:
                images = pad_crop_flip(self.images, index, self.size, self.pad, self.flip)
            else:
                images = self.images.index_select(0, index)
            if self.policy is not None:
                images = per_image(self.policy, images)
            if self.normalize is not None:
                images = self.normalize(images)
            if self.erase is not None:
                images = self.erase(images)
            yield images, self.targets.index_select(0, index)


def memory_pipeline_bytes(cfg: CfgNode, key: str) -> int:
    """An upper bound of the bytes the in-memory pipeline holds for
    cfg[key] (CIFAR or a registered TensorSource such as mnist5k): the
    uint8 split at TRAIN.IM_SIZE plus its padded copy (MemoryLoader). A
    CIFAR split is counted from its files' sizes, unread (3,072 bytes
    per image and a little more)."""
    if sources.kind_of(cfg, key) != "cifar":  # a registered TensorSource: built, so counted
        src = registry.build_source(cfg, key)
        samples, pad = len(src.images), src.pad
    else:
        root, variant = cifar.find_cifar(cfg[key].DATASET)
        names = cifar.cifar_files(root, variant, cfg[key].SPLIT)
        paths = [os.path.join(root, n) for n in names]
        samples = sum(os.path.getsize(p) for p in paths if os.path.isfile(p)) // (32 * 32 * 3)
        pad = 4
    side = cfg.TRAIN.IM_SIZE
    return samples * cfg.MODEL.IN_CHANS * (side * side + (side + 2 * pad) ** 2)


class MemoryPipeline(Pipeline):
    """The split as one tensor on the device, batched by a MemoryLoader
    (module docstring)."""

    @classmethod
    def refusal(cls, cfg: CfgNode, key: str) -> str | None:
        """Why it cannot hold cfg[key] (None: it can)."""
        kind = sources.kind_of(cfg, key)
        if kind in ("folder", "labels", "hf", "shards"):
            what = {
                "folder": "an image folder",
                "labels": "label files",
                "hf": "a Hugging Face dataset",
                "shards": "a shard set",
            }[kind]
            return (
                "TRAIN.DATA_PIPELINE memory holds mnist5k, CIFAR or synthetic data, but "
                f"{key}.DATASET {cfg[key].DATASET!r} is {what}; use TRAIN.DATA_PIPELINE auto or "
                "loader"
            )
        if key == "TRAIN" and cfg.TRAIN.CROP_SCALE:  # the in-memory path only pads and crops
            return (
                "TRAIN.DATA_PIPELINE memory pads and crops only; TRAIN.CROP_SCALE needs "
                "TRAIN.DATA_PIPELINE auto or loader (auto then uses the DataLoader)"
            )
        return None

    @classmethod
    def auto_takes(cls, cfg: CfgNode, key: str) -> bool:
        """CIFAR and TensorSources it can read, while they fit the
        budget (the log says when not)."""
        if cls.refusal(cfg, key) is not None:
            return False
        kind = sources.kind_of(cfg, key)
        registered = kind == "registered" and registry.registered_data(cfg, key)
        if kind != "cifar" and not isinstance(registered, builtin.TensorSource):
            return False
        need = memory_pipeline_bytes(cfg, key)
        if need > MEMORY_PIPELINE_BUDGET_BYTES:
            log.warning(
                "TRAIN.DATA_PIPELINE auto: %s.DATASET at %d px would take %.1f GB per process in "
                "memory (more than %.1f GB): using the DataLoader instead (TRAIN.DATA_PIPELINE "
                "memory forces it)",
                key,
                cfg.TRAIN.IM_SIZE,
                need / 1e9,
                MEMORY_PIPELINE_BUDGET_BYTES / 1e9,
            )
            return False
        return True

    def train_loader(self, part: str | None, place: Place) -> MemoryLoader:
        return self._loader(True, part, place)

    def eval_loader(self, part: str | None, place: Place) -> MemoryLoader:
        return self._loader(False, part, place)

    def _loader(self, train: bool, part: str | None, place: Place) -> MemoryLoader:
        """The MemoryLoader of cfg[key] (or its VAL_SPLIT part),
        augmented when train."""
        cfg, key = self.cfg, self.key
        # The per-sample twin: len, classes, items for inspection (and
        # the split's labels).
        dataset = holdout.part_of(cfg, split_dataset(cfg, key, train, batched=False), part)
        device = place.device
        src = sources.tensor_source(cfg, key)
        policy = erase = None
        if (
            src is None
        ):  # synthetic or a user's Dataset: generated once, already normalized, no augmentation
            images = torch.stack([dataset[i][0] for i in range(len(dataset))])
            targets = torch.tensor([dataset[i][1] for i in range(len(dataset))])
            pad, flip, normalize = 0, 0.0, None
        else:
            images, targets, pad, flip = src.images, src.targets, src.pad, src.flip
            if part is not None:  # the rows of the part, in its order: row i is dataset[i]
                rows = torch.as_tensor(dataset.indices, dtype=torch.long)
                images, targets = images[rows], targets[rows]
            recipe = recipe_of(cfg)  # the user's mean/std and flip probability, else the source's
            stats = stats_for_channels(recipe.stats or src.stats, cfg.MODEL.IN_CHANS)
            flip = recipe.flip_prob(flip)
            normalize = BatchNormalize(stats, device)
            if (
                images.shape[-1] != cfg.TRAIN.IM_SIZE
            ):  # resized once, as the per-sample recipe resizes first
                images = v2.functional.resize(
                    images, [cfg.TRAIN.IM_SIZE] * 2, interpolation=recipe.mode, antialias=True
                )
            if train:
                policy = augment_policy(cfg)
                erase = (
                    BatchRandomErasing(cfg.TRAIN.RANDOM_ERASE)
                    if cfg.TRAIN.RANDOM_ERASE > 0
                    else None
                )
        sampler = self.sampler(dataset, train, place)
        batch_size = cfg.TRAIN.BATCH_SIZE if train else cfg.TEST.BATCH_SIZE
        drop_last = train and len(sampler) >= batch_size
        return MemoryLoader(
            dataset,
            images.to(device),
            targets.to(device),
            sampler,
            batch_size,
            drop_last,
            pad=pad,
            flip=flip,
            train=train,
            normalize=normalize,
            policy=policy,
            erase=erase,
        )

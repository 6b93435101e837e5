"""The per-sample items of a split, which every pipeline starts from:
image files decoded one at a time (ImageDataset, with the handling of
unreadable images), a TensorSource's images, or a source's ready items.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info
from yacs.config import CfgNode

from distribuuuu.data import sources, transforms
from distribuuuu.data.decoding import cpu
from distribuuuu.data.sources import builtin, registry
from distribuuuu.data.sources.files import ImageFiles

log = logging.getLogger("distribuuuu")


class UnreadableImage(RuntimeError):
    """An image that cannot be decoded, with TRAIN.BAD_IMAGES fail (or a
    run of them that no replacement gets past)."""


class ImageDataset(Dataset):
    """The (image, label) items of an ImageFiles reader: decode(bytes),
    then transform.

    An image that cannot be read or decoded stops the run naming it
    under TRAIN.BAD_IMAGES fail. Under skip it is logged by name and
    flagged once however often it is drawn; in training (replace) the
    next readable item stands in, so that every rank keeps its batch
    size and DDP its step count; in evaluation the item is None, left
    out of its batch (batches.collate_readable), so that n counts
    distinct readable images.
    """

    MAX_UNREADABLE_IN_A_ROW = 32

    def __init__(
        self,
        files: ImageFiles,
        decode: Callable[[bytes], Any],
        transform: Callable | None = None,
        bad_images: str = "skip",
        replace: bool = True,
    ) -> None:
        self.files, self.classes, self.targets = files, files.classes, files.targets
        self.decode, self.transform = decode, transform
        self.bad_images, self.replace = bad_images, replace
        # Shared with the loader's worker processes, which inherit them.
        self.unreadable = multiprocessing.Array("b", len(files), lock=False)
        self.item_seeds = multiprocessing.Array("q", [0, 0, 0], lock=False)  # on, seed, epoch

    def __len__(self) -> int:
        return len(self.files)

    def seed_items(self, seed: int, epoch: int) -> None:
        """From now on a loader worker seeds torch's RNG by (seed, epoch,
        index) before it makes an item, so that its crops and flips do
        not depend on the worker: a resumed epoch augments as the
        straight run did. (Without workers the main process draws them,
        and a checkpoint restores its RNG.)"""
        self.item_seeds[:] = [1, seed, epoch]

    def __getitem__(self, index: int) -> tuple[Any, int] | None:
        on, seed, epoch = self.item_seeds
        if on and get_worker_info() is not None:
            # The CPU generator only: torch.manual_seed seeds every device too (~130x slower).
            item_seed = (seed * 1_000_003 + epoch) * 1_000_000_007 + index
            torch.default_generator.manual_seed(item_seed % 2**63)
        try:
            return self.item(index)
        except cpu.DECODE_ERRORS as e:
            self.note_unreadable(index, e)
        return self.stand_in(index) if self.replace else None

    def stand_in(self, index: int) -> tuple[Any, int]:
        """The first readable item after the unreadable item index."""
        tries = min(len(self), self.MAX_UNREADABLE_IN_A_ROW)
        for i in range(index + 1, index + tries):
            try:
                return self.item(i % len(self))
            except cpu.DECODE_ERRORS as e:
                self.note_unreadable(i % len(self), e)
        raise UnreadableImage(
            f"{tries} unreadable images in a row in {self.files.root}; is this an image folder?"
        )

    def item(self, i: int) -> tuple[Any, int]:
        image = self.decode(self.files.read(i))
        if self.transform is not None:
            image = self.transform(image)
        return image, self.targets[i]

    def note_unreadable(self, i: int, error: Exception) -> None:
        """UnreadableImage under TRAIN.BAD_IMAGES fail; else item i is
        flagged, with a warning naming it the first time."""
        name, why = self.files.name(i), cpu.decode_error(error)
        if self.bad_images == "fail":
            raise UnreadableImage(
                f"cannot decode image {name} ({why}); remove it, or set TRAIN.BAD_IMAGES skip to "
                "skip unreadable files"
            ) from None
        if not self.unreadable[i]:
            self.unreadable[i] = 1
            log.warning("skipping unreadable image %s (%s)", name, why)

    def take_unreadable(self) -> list[int]:
        """The items found unreadable since the last call (by any worker
        of this process), each once."""
        flags = np.frombuffer(self.unreadable, dtype=np.int8)
        found = np.flatnonzero(flags)
        flags[found] = 0  # only these: a worker may flag another meanwhile
        return found.tolist()


class TensorImageDataset(Dataset):
    """A TensorSource's images as per-sample items, transformed as tensors."""

    def __init__(
        self,
        images: torch.Tensor,
        targets: torch.Tensor,
        classes: list[str],
        transform: Callable | None = None,
    ) -> None:
        self.images, self.targets, self.classes = images, targets, classes
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = self.images[i]
        return (self.transform(image) if self.transform else image), int(self.targets[i])


def build_dataset(cfg: CfgNode, train: bool) -> Dataset:
    """The whole TRAIN (train=True, augmented) or TEST dataset, with its
    per-sample transforms: items are (float32 [C, H, W] normalized, int
    label), one at a time."""
    return split_dataset(cfg, "TRAIN" if train else "TEST", train, batched=False)


def split_dataset(cfg: CfgNode, key: str, train: bool, batched: bool) -> Dataset:
    """The items of cfg[key], with the training transforms (train) or
    the eval ones. Image files are decoded one at a time; batched
    (TRAIN.IMAGE_DECODE fast): to uint8 crops, normalized (and erased)
    per batch on the device. Other sources: source_dataset."""
    if sources.kind_of(cfg, key) not in sources.IMAGE_FILES:
        return source_dataset(cfg, key, train)
    sources.require_image_chans(cfg, key)
    files = sources.image_files(cfg, key)
    size, recipe = cfg.TRAIN.IM_SIZE, transforms.recipe_of(cfg)  # val: TRAIN.IM_SIZE too
    mode = "L" if cfg.MODEL.IN_CHANS == 1 else "RGB"
    policy = transforms.augment_policy(cfg) if train else None
    bad = cfg.TRAIN.BAD_IMAGES
    if batched:  # the geometry in the decoder, so that its errors meet the handling above
        if train:
            crop = cpu.FastTrainDecode(size, mode, recipe)
        else:
            resize_to = recipe.eval_resize(size, cfg.TEST.IM_SIZE)
            crop = cpu.FastEvalDecode(resize_to, size, mode, recipe)
        return ImageDataset(files, crop, policy, bad, replace=train)
    erase = cfg.TRAIN.RANDOM_ERASE if train else 0.0
    tf = transforms.folder_transform(
        train, size, cfg.TEST.IM_SIZE, cfg.MODEL.IN_CHANS, policy, erase, recipe
    )
    decode = functools.partial(cpu.open_image, mode=mode)
    return ImageDataset(files, decode, tf, bad, replace=train)


def source_dataset(cfg: CfgNode, key: str, train: bool) -> Dataset:
    """The items of a source that is not image files: MODEL.DUMMY_INPUT's
    random tensors, synthetic data or a user's Dataset (ready items,
    never transformed), or the uint8 images of mnist5k, CIFAR or a
    registered TensorSource with the small-image recipe."""
    chans, size = cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE
    if cfg.MODEL.DUMMY_INPUT:
        seed = 0 if key == "TRAIN" else 1
        shape = (chans, size, size)
        return builtin.RandomTensorDataset(
            cfg[key].SYNTHETIC_SAMPLES, cfg.MODEL.NUM_CLASSES, shape, seed
        )
    data = registry.registered_data(cfg, key)
    if data is not None and not isinstance(data, builtin.TensorSource):
        return data
    src, recipe = sources.tensor_source(cfg, key, data), transforms.recipe_of(cfg)
    stats = transforms.stats_for_channels(recipe.stats or src.stats, chans)
    tf = transforms.small_image_transform(
        train,
        size,
        src.images.shape[-1],
        pad=src.pad,
        flip=src.flip,
        stats=stats,
        policy=transforms.augment_policy(cfg) if train else None,
        erase=cfg.TRAIN.RANDOM_ERASE if train else 0.0,
        recipe=recipe,
    )
    return TensorImageDataset(src.images, src.targets, src.classes, tf)


def take_unreadable(dataset: Any) -> list[int]:
    """The unreadable items this process met in dataset since the last
    call: image files' indices (of the whole split, also through a
    TRAIN.VAL_SPLIT part), a shard set's -1 per record; [] for sources
    that cannot have any."""
    take = getattr(getattr(dataset, "dataset", dataset), "take_unreadable", None)
    return take() if take else []


def unreadable_so_far(loader: Any, met: list[int]) -> list[int]:
    """Collective: met (the epoch's unreadable training items until
    now, as a checkpoint carries them) and those the loader found on any
    rank since the last call, each once: an item drawn on two ranks
    (TRAIN.REPEATED_AUG), or also tried as a stand-in, is one; a shard
    set reads each record once an epoch: one -1 per unreadable record."""
    from distribuuuu.launch import comm

    found = [met, *comm.all_gather_object(take_unreadable(loader.dataset))]
    ids = sorted({i for part in found for i in part if i >= 0})
    return ids + [-1] * sum(part.count(-1) for part in found)

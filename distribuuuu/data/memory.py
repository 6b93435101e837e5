"""The in-memory input pipeline for small datasets (TRAIN.DATA_PIPELINE memory; auto for mnist5k, CIFAR).

The whole split is one tensor on the training device (uint8 images, or the synthetic source's
floats). A batch is one indexing operation: the pad-and-crop offsets and the horizontal flips of
all its images are folded into one gather, then the batch is normalized in two in-place ops.
No DataLoader, no worker processes, no per-sample Python or PIL: on 28-32 px images the per-sample
path spends far more time in Python than in arithmetic.

The loader keeps the interface the engine relies on: ``len(loader)`` batches, ``loader.dataset``
(the per-sample dataset, for its length and classes), ``loader.sampler.set_epoch(epoch, start)``,
and iteration yielding ``(images, target)`` already on the device. The order is the sampler's: a
ResumableDistributedSampler for training (one seeded permutation per epoch, ``start`` samples
skipped, every W-th of the rest, the tail of fewer than W dropped) and a ShardedEvalSampler for
validation, so a rank sees exactly the samples the DataLoader path would give it. The random crops
and flips come from the device's default generator, seeded by the engine (RNG_SEED + rank) and
saved in checkpoints, as the augmentations of a DataLoader without workers.

TRAIN.AUTO_AUGMENT and TRAIN.RANDOM_ERASE are drawn per image too. Erasing is batched
(transforms.BatchRandomErasing, after the normalization). A policy is a torchvision transform of
one image, so it runs in a Python loop over the batch, after the crop. That loop is the price:
on mnist5k with one CPU thread the path fell from ~178,000 to ~2,400 img/s with RandAugment
(docs/recipes.md, Augmentation); TRAIN.DATA_PIPELINE loader spreads that work over worker processes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized

import torch
import torch.nn.functional as F
from torch.utils.data import Sampler

from distribuuuu.data.transforms import per_image


def flip_probability(flip: bool | float) -> float:
    """True means the classic 1/2, False 0; a float is the probability itself (TRAIN.FLIP_PROB)."""
    return 0.5 if flip is True else float(flip)


def pad_crop_flip(padded: torch.Tensor, index: torch.Tensor, size: int, pad: int, flip: bool | float) -> torch.Tensor:
    """Random size x size crops of the images padded[index] (already padded by pad on every side),
    each mirrored left-right with probability 1/2 when flip is True (flip itself when a float).

    The offsets are uniform in [0, 2 * pad], as torchvision's RandomCrop(size, padding=pad) draws
    them. The batch is copied out once (index_select), then every crop and flip is one gather over
    the flattened planes: a mirrored crop simply reads its columns backwards. (A gather with one
    index tensor per dimension is about 5x slower on the CPU.)
    """
    b, chans, side = index.numel(), padded.shape[1], padded.shape[-1]
    device = padded.device
    span = torch.arange(size, device=device)
    rows = torch.randint(0, 2 * pad + 1, (b, 1), device=device) + span  # [B, size]
    cols = torch.randint(0, 2 * pad + 1, (b, 1), device=device) + span
    if flip:
        mirror = torch.rand(b, 1, device=device) < flip_probability(flip)
        cols = torch.where(mirror, cols.flip(1), cols)
    flat = (rows[:, :, None] * side + cols[:, None, :]).view(b, 1, size * size).expand(b, chans, size * size)
    batch = padded.index_select(0, index).view(b, chans, side * side)
    return batch.gather(2, flat).view(b, chans, size, size)


class MemoryLoader:
    """Batches of one rank, cut from a tensor that holds the whole split on the device."""

    def __init__(self, dataset: Sized, images: torch.Tensor, targets: torch.Tensor, sampler: Sampler,
                 batch_size: int, drop_last: bool, pad: int = 0, flip: bool | float = False, train: bool = True,
                 normalize: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 policy: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 erase: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """images [N, C, S, S] and targets [N] on the training device; pad/flip only when train, as
        the policy (of one uint8 image, applied per image after the crop) and erase (of a normalized
        batch). flip: True (probability 1/2), False, or a probability."""
        self.dataset, self.sampler = dataset, sampler
        self.batch_size, self.drop_last = batch_size, drop_last
        self.size, self.pad, self.flip = images.shape[-1], pad if train else 0, flip_probability(flip) if train else 0.0
        self.augment = train and (pad > 0 or self.flip > 0)
        self.policy, self.erase = (policy, erase) if train else (None, None)
        # Padded once here, so that a crop is a plain gather (no per-batch padding, no masks).
        self.images = F.pad(images, (self.pad,) * 4) if self.pad else images
        self.targets, self.normalize = targets, normalize

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # The sampler's own indices (one host list per epoch), so the order is the DataLoader's.
        order = torch.tensor(list(self.sampler), dtype=torch.long).to(self.images.device)
        for b in range(len(self)):
            index = order[b * self.batch_size:(b + 1) * self.batch_size]
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

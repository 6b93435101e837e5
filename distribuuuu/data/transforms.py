"""Per-sample transforms (torchvision transforms v2) and the normalization statistics.

Folders get the ImageNet recipe on PIL images; the small built-in images (MNIST 28 px, CIFAR
32 px) are uint8 tensors in memory and get the classic pad-and-crop recipe as tensor ops.
"""

from __future__ import annotations

import torch
from torchvision.transforms import v2

Stats = tuple[tuple[float, ...], tuple[float, ...]]

IMAGENET_STATS: Stats = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
MNIST_STATS: Stats = ((0.1307,), (0.3081,))
CIFAR10_STATS: Stats = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR100_STATS: Stats = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))


def stats_for_channels(stats: Stats, chans: int) -> Stats:
    """Mean/std for the channel count the model sees.

    1 -> 3 channels repeats the gray value, so the statistics repeat too. 3 -> 1 uses the plain
    channel average, an approximation of the statistics of the gray image (for ImageNet this
    gives the usual 0.449 / 0.226).
    """
    mean, std = stats
    if len(mean) == chans:
        return stats
    if len(mean) == 1:
        return mean * chans, std * chans
    if chans == 1:
        return (round(sum(mean) / len(mean), 4),), (round(sum(std) / len(std), 4),)
    raise ValueError(f"cannot map {len(mean)}-channel statistics to {chans} channels")


def _to_normalized_float(stats: Stats) -> list[v2.Transform]:
    mean, std = stats
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean=list(mean), std=list(std))]


def folder_transform(train: bool, im_size: int, test_im_size: int, chans: int) -> v2.Compose:
    """ImageNet recipe on PIL images: RandomResizedCrop + flip, or Resize + CenterCrop."""
    if train:
        geometry = [v2.RandomResizedCrop(im_size, antialias=True), v2.RandomHorizontalFlip()]
    else:
        geometry = [v2.Resize(test_im_size, antialias=True), v2.CenterCrop(im_size)]
    # PILToTensor, not ToImage: batches should hold plain tensors, not tv_tensors.Image.
    stats = stats_for_channels(IMAGENET_STATS, chans)
    return v2.Compose(geometry + [v2.PILToTensor()] + _to_normalized_float(stats))


def small_image_transform(train: bool, im_size: int, native_size: int, pad: int, flip: bool,
                          stats: Stats) -> v2.Compose:
    """Pad-and-crop recipe on uint8 tensors [C, H, W]; resizes only when IM_SIZE is not native."""
    steps: list[v2.Transform] = []
    if im_size != native_size:
        steps.append(v2.Resize((im_size, im_size), antialias=True))
    if train:
        steps.append(v2.RandomCrop(im_size, padding=pad, fill=0))
        if flip:
            steps.append(v2.RandomHorizontalFlip())
    return v2.Compose(steps + _to_normalized_float(stats))


def match_channels(images: torch.Tensor, chans: int) -> torch.Tensor:
    """uint8 [N, C, H, W] -> [N, chans, H, W]: gray repeated to RGB, or RGB to luminance."""
    have = images.shape[1]
    if have == chans:
        return images
    if chans in (1, 3) and have in (1, 3):
        return v2.functional.rgb_to_grayscale(images, num_output_channels=chans).contiguous()
    raise ValueError(f"cannot convert {have}-channel images to {chans} channels")


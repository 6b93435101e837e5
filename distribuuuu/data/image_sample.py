"""A seeded sample of a folder's training images, what it shows (their
typical size, how many are grayscale, their mean/std) and the recipe it
implies for the keys the config leaves unset: the model, the input
channels, the image size, crop, flip, mean/std (inferred.py calls it and
logs each setting as a setup line); a few hundred files, the same ones
on every rank."""

from __future__ import annotations

import contextlib
import random
import statistics
from typing import Any

import numpy as np
from PIL import Image
from torch import cuda
from yacs.config import CfgNode

from distribuuuu.data import transforms
from distribuuuu.data.images import DECODE_ERRORS, list_split, open_image
from distribuuuu.models import default_size

MIN_STD = 0.0039  # one gray level: images of (nearly) one colour would otherwise be divided by ~0
SAMPLE_IMAGES, SAMPLE_SEED = (
    256,
    0,
)  # enough for a median and a mean to 2-3 digits; a fixed seed: every rank, every run
FORMER_ARCH, SMALL_ARCH, FORMER_SIZE = (
    "resnet18",
    "resnet_tiny",
    224,
)  # for MODEL.ARCH auto, TRAIN.IM_SIZE 0
SMALL_IMAGES = (
    64  # images up to this side train SMALL_ARCH on a CPU (resnet18 is 4x wider in every layer)
)
STRIDE, SMALL_STEM_STRIDE = (
    32,
    8,
)  # a ResNet's input side per side of its last map: the least input leaving 1x1
SMALL_CROP, PHOTO_CROP = [0.8, 1.0], [0.08, 1.0]  # docs/recipes.md, Data recipe
Setting = tuple[str, Any, str, bool]  # (key, value, why, warn): a setup line of inferred.py
GRAY_MODES = ("1", "L", "LA", "La", "I", "F", "I;16", "I;16L", "I;16B", "I;16N")


def sample(split_dir: str, classes: list[str]) -> list[str]:
    """Up to SAMPLE_IMAGES image files of split_dir's class folders,
    drawn with SAMPLE_SEED."""
    listing = list_split(split_dir, classes)
    files = [path for c in listing.classes for path in listing.files(c)]
    return random.Random(SAMPLE_SEED).sample(files, min(len(files), SAMPLE_IMAGES))


def looks(files: list[str]) -> tuple[int, int, int]:
    """(median shorter side, how many are grayscale, how many were
    readable), from the headers alone."""
    sides, gray = [], 0
    for file in files:
        with (
            contextlib.suppress(*DECODE_ERRORS),
            Image.open(file) as image,
        ):  # the preflight names unreadable files
            sides, gray = [*sides, min(image.size)], gray + (image.mode in GRAY_MODES)
    return (int(statistics.median_low(sides)) if sides else 0), gray, len(sides)


def mean_std(files: list[str], chans: int) -> tuple[list[float], list[float]]:
    """Per-channel mean and std (4 decimals, std at least MIN_STD) of
    the files' pixels in [0, 1], decoded as training decodes them to
    chans channels (small images: all of them in memory is a few MB)."""
    arrays = [np.zeros((0, chans), np.uint8)]
    for file in files:
        with contextlib.suppress(*DECODE_ERRORS):
            arrays.append(
                np.asarray(open_image(file, "L" if chans == 1 else "RGB")).reshape(-1, chans)
            )
    pixels = np.concatenate(arrays)
    mean, std = pixels.mean(0, dtype=np.float64) / 255, pixels.std(0, dtype=np.float64) / 255
    return [round(float(x), 4) for x in mean], [round(max(float(x), MIN_STD), 4) for x in std]


def _fill(cfg: CfgNode, key: str, unset: bool, value: Any, origin: str) -> list[Setting]:
    """key ("SECTION.NAME") set to value, with the reason for its setup
    line, when unset."""
    if unset:
        cfg.merge_from_list([key, value])  # yacs: the type checked
    return [(key, value, origin, False)] if unset else []


def recipe(cfg: CfgNode, files: list[str], side: int, gray: int, seen: int) -> list[Setting]:
    """The model, its input and the recipe from a folder's images
    (module docstring; docs/recipes.md)."""
    m, t, looks = (
        cfg.MODEL,
        cfg.TRAIN,
        f"from the images: {seen} sampled, median shorter side {side} px",
    )
    cpu = side <= SMALL_IMAGES and (
        cfg.DEVICE == "cpu" or cfg.DEVICE == "auto" and not cuda.is_available()
    )
    decided = _fill(
        cfg,
        "MODEL.ARCH",
        m.ARCH == "auto",
        SMALL_ARCH if cpu else FORMER_ARCH,
        looks
        + (
            ": 64 px or less on a CPU: a ResNet sized for them"
            if cpu
            else ": over 64 px or a GPU: the default"
        ),
    )
    decided += _fill(
        cfg,
        "MODEL.IN_CHANS",
        not m.IN_CHANS,
        1 if gray * 2 > seen else 3,
        f"from the images: {gray} of {seen} sampled are gray",
    )
    ceiling, floor = default_size(m.ARCH), SMALL_STEM_STRIDE if m.SMALL_STEM else STRIDE
    decided += _fill(
        cfg,
        "TRAIN.IM_SIZE",
        not t.IM_SIZE,
        min(max(side, floor), ceiling),
        looks
        + (
            f", raised to {floor}: the model divides its input by {floor}"
            if side < floor
            else f", lowered to {m.ARCH}'s default size"
            if side > ceiling
            else ""
        ),
    )
    small, why = (
        side < ceiling,
        f"{side} px, {'below' if side < ceiling else 'at least'} {m.ARCH}'s {ceiling}: ",
    )
    decided += _fill(
        cfg,
        "TRAIN.CROP_SCALE",
        not t.CROP_SCALE,
        SMALL_CROP if small else PHOTO_CROP,
        why + ("a small crop would cut their object" if small else "ImageNet's"),
    )
    decided += _fill(
        cfg,
        "TRAIN.FLIP_PROB",
        t.FLIP_PROB < 0,
        0.0 if small else 0.5,
        why
        + (
            "small images are often "
            "glyphs (digits, letters, signs) a mirror changes; 0.5 for photos"
            if small
            else "ImageNet's"
        ),
    )
    if t.MEAN or m.PRETRAINED:  # pretrained weights keep their own (data/transforms.recipe_of)
        return decided
    t.MEAN, t.STD = (
        mean_std(files, m.IN_CHANS)
        if small
        else map(list, transforms.stats_for_channels(transforms.IMAGENET_STATS, m.IN_CHANS))
    )
    own = f"their own, of {len(files)} sampled (a fixed seed)" if small else "ImageNet's"
    return decided + [("TRAIN.MEAN/STD", f"{t.MEAN} / {t.STD}", why + own, False)]


def former_defaults(cfg: CfgNode) -> list[Setting]:
    """No folder of images readable here: the former resnet18, 3
    channels (TRAIN.MEAN's count), 224 px."""
    m, t, origin = (
        cfg.MODEL,
        cfg.TRAIN,
        f"the former default: no folder of images read here ({cfg.TRAIN.DATASET})",
    )
    return (
        _fill(cfg, "MODEL.ARCH", m.ARCH == "auto", FORMER_ARCH, origin)
        + _fill(cfg, "MODEL.IN_CHANS", not m.IN_CHANS, len(t.MEAN) or 3, origin)
        + _fill(cfg, "TRAIN.IM_SIZE", not t.IM_SIZE, FORMER_SIZE, origin)
    )

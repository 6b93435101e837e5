"""A seeded sample of a folder's training images, and what it shows: their typical size, how many are
grayscale, their mean/std. inferred.py decides the model, the input channels, the image size and the
recipe from it when the config leaves them unset; a few hundred files, the same ones on every rank."""

from __future__ import annotations

import contextlib
import random
import statistics

import numpy as np
from PIL import Image

from distribuuuu.data.images import DECODE_ERRORS, list_split, open_image

MIN_STD = 0.0039  # one gray level: images of (nearly) one colour would otherwise be divided by ~0
SAMPLE_IMAGES, SAMPLE_SEED = 256, 0  # enough for a median and a mean to 2-3 digits; a fixed seed: every rank, every run
GRAY_MODES = ("1", "L", "LA", "La", "I", "F", "I;16", "I;16L", "I;16B", "I;16N")


def sample(split_dir: str, classes: list[str]) -> list[str]:
    """Up to SAMPLE_IMAGES image files of split_dir's class folders, drawn with SAMPLE_SEED."""
    listing = list_split(split_dir, classes)
    files = [path for c in listing.classes for path in listing.files(c)]
    return random.Random(SAMPLE_SEED).sample(files, min(len(files), SAMPLE_IMAGES))


def looks(files: list[str]) -> tuple[int, int, int]:
    """(median shorter side, how many are grayscale, how many were readable), from the headers alone."""
    sides, gray = [], 0
    for file in files:
        with contextlib.suppress(*DECODE_ERRORS), Image.open(file) as image:  # the preflight names unreadable files
            sides, gray = [*sides, min(image.size)], gray + (image.mode in GRAY_MODES)
    return (int(statistics.median_low(sides)) if sides else 0), gray, len(sides)


def mean_std(files: list[str], chans: int) -> tuple[list[float], list[float]]:
    """Per-channel mean and std (4 decimals, std at least MIN_STD) of the files' pixels in [0, 1], decoded as
    training decodes them to chans channels (small images: all of them in memory is a few MB)."""
    arrays = [np.zeros((0, chans), np.uint8)]
    for file in files:
        with contextlib.suppress(*DECODE_ERRORS):
            arrays.append(np.asarray(open_image(file, "L" if chans == 1 else "RGB")).reshape(-1, chans))
    pixels = np.concatenate(arrays)
    mean, std = pixels.mean(0, dtype=np.float64) / 255, pixels.std(0, dtype=np.float64) / 255
    return [round(float(x), 4) for x in mean], [round(max(float(x), MIN_STD), 4) for x in std]

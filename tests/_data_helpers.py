"""Small on-disk fixtures for tests/test_data.py: image trees and fake CIFAR pickles."""

from __future__ import annotations

import os
import pickle

import numpy as np
from PIL import Image

from distribuuuu.config import load_config


def make_cfg(overrides: dict):
    """load_config from {KEY: value}; non-string values are passed as Python literals."""
    opts: list[str] = []
    for key, value in overrides.items():
        opts += [key, value if isinstance(value, str) else repr(value)]
    return load_config(None, opts)


def write_image(path: str, size: tuple[int, int], mode: str, seed: int) -> None:
    """A random image of the given PIL mode (L, RGB, RGBA); the format follows the extension."""
    rng = np.random.default_rng(seed)
    chans = {"L": 1, "RGB": 3, "RGBA": 4}[mode]
    shape = (size[1], size[0]) if chans == 1 else (size[1], size[0], chans)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(path)


def write_image_tree(root: str, split: str, classes: dict[str, int], mode: str = "RGB",
                     ext: str = "png", size: tuple[int, int] = (12, 10)) -> None:
    """root/split/<class>/<i>.<ext> with classes[name] images each."""
    for c_idx, (name, n) in enumerate(sorted(classes.items())):
        for i in range(n):
            write_image(os.path.join(root, split, name, f"{i}.{ext}"), size, mode, seed=100 * c_idx + i)


def write_fake_cifar10(folder: str, per_batch: int = 2, test_size: int = 3) -> np.ndarray:
    """folder/ holding data_batch_1..5, test_batch and batches.meta (the python pickle layout).

    Returns the test batch's images as uint8 [N, 3, 32, 32] to compare against.
    """
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

    def dump(name: str, obj: dict) -> None:
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(obj, f)

    for b in range(1, 6):
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        dump(f"data_batch_{b}", {"data": data, "labels": [(b + i) % 10 for i in range(per_batch)]})
    test = rng.integers(0, 256, (test_size, 3072), dtype=np.uint8)
    dump("test_batch", {"data": test, "labels": [i % 10 for i in range(test_size)]})
    dump("batches.meta", {"label_names": names})
    return test.reshape(-1, 3, 32, 32)


def write_fake_cifar100(folder: str, n_train: int = 4, n_test: int = 2) -> None:
    """folder/ holding train, test and meta of CIFAR-100's python layout."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(1)
    for name, n in (("train", n_train), ("test", n_test)):
        obj = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
               "fine_labels": [99 - i for i in range(n)], "coarse_labels": [0] * n}
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(obj, f)
    with open(os.path.join(folder, "meta"), "wb") as f:
        pickle.dump({"fine_label_names": [f"c{i:02d}" for i in range(100)]}, f)


def write_constant_image_tree(root: str, split: str, classes: dict[str, int], value: int = 120,
                              size: tuple[int, int] = (20, 16)) -> None:
    """root/split/<class>/<i>.png, every image one flat RGB colour: any crop or flip of it is the
    same flat image, so what makes two of them differ is the rest of the augmentation."""
    for name, n in sorted(classes.items()):
        for i in range(n):
            path = os.path.join(root, split, name, f"{i}.png")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            Image.new("RGB", size, (value, value, value)).save(path)

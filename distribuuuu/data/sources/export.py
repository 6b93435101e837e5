"""`distribuuuu data export SOURCE DIR`: a dataset shipped inside a
package (no download) written as an image folder: mnist5k's split,
scikit-learn's digits, scikit-image's face crops."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import numpy as np

from distribuuuu.data.sources import folder
from distribuuuu.data.sources.builtin import MNIST_CLASSES, mnist5k_arrays, mnist5k_split_indices
from distribuuuu.errors import UserError


def export(source: str, out_dir: str) -> dict[str, int]:
    """Write source's images into out_dir (which must not hold files);
    returns the counts. The folder is written under a temporary name
    beside it and renamed when complete: an export killed half-way
    leaves no folder that a run would take for the data."""
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise UserError(
            f"{out_dir} already exists and is not empty; remove it or choose another folder"
        )
    partial = folder.partial_name(out_dir)
    shutil.rmtree(partial, ignore_errors=True)  # an earlier export that was killed
    counts = WRITERS[source](partial)
    if os.path.isdir(out_dir):
        os.rmdir(out_dir)
    os.rename(partial, out_dir)
    return counts


def mnist5k(out_dir: str) -> dict[str, int]:
    """out_dir/{train,val}/<digit>/<index>.png (28x28 gray), the split
    TRAIN/TEST.DATASET mnist5k uses. <index> is the position in the
    split, so ImageFolder's file order is the in-memory order."""
    from PIL import Image

    images, labels = mnist5k_arrays()
    splits = mnist5k_split_indices()
    for split, idx in splits.items():
        for c in MNIST_CLASSES:
            os.makedirs(os.path.join(out_dir, split, c), exist_ok=True)
        for pos, i in enumerate(idx):
            path = os.path.join(out_dir, split, str(labels[i]), f"{pos:04d}.png")
            Image.fromarray(images[i]).save(path)
    return {split: len(idx) for split, idx in splits.items()}


def digits(out_dir: str) -> dict[str, int]:
    """scikit-learn's 1,797 digits, their 17 gray levels scaled to
    0-255: small images of one's own, whose recipe the images decide."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise UserError("data export digits needs scikit-learn: pip install scikit-learn") from None
    data = load_digits()
    images = np.round(data.images * (255 / 16)).astype(np.uint8)
    return _class_folders(out_dir, images, data.target, list(MNIST_CLASSES))


def faces(out_dir: str) -> dict[str, int]:
    """scikit-image's LFW subset: 100 faces and 100 crops of the same
    photos' backgrounds, 25x25 gray, from the file inside the package."""
    try:
        from skimage import data as skimage_data
    except ImportError:
        raise UserError("data export faces needs scikit-image: pip install scikit-image") from None
    images = np.round(skimage_data.lfw_subset() * 255).astype(np.uint8)  # floats in [0, 1]
    return _class_folders(out_dir, images, np.repeat([0, 1], 100), ["face", "background"])


def _class_folders(
    out_dir: str, images: np.ndarray, labels: np.ndarray, classes: list[str]
) -> dict[str, int]:
    """out_dir/<class>/<index>.png, one gray PNG per uint8 image."""
    from PIL import Image

    for c in classes:
        os.makedirs(os.path.join(out_dir, c), exist_ok=True)
    for i, (image, label) in enumerate(zip(images, labels)):
        Image.fromarray(image).save(os.path.join(out_dir, classes[label], f"{i:04d}.png"))
    return {"images": len(images)}


WRITERS: dict[str, Callable[[str], dict[str, int]]] = {
    "mnist5k": mnist5k,
    "digits": digits,
    "faces": faces,
}

"""`distribuuuu data export mnist5k DIR`: the built-in digits as an ImageFolder tree of PNG files."""

from __future__ import annotations

import os

from PIL import Image

from distribuuuu.data import sources
from distribuuuu.errors import UserError


def export_mnist5k(out_dir: str) -> dict[str, int]:
    """Write out_dir/{train,val}/<digit>/<index>.png (28x28 grayscale); return counts per split.

    <index> is the zero-padded position in the split, so ImageFolder's sorted file order is the
    in-memory order within each class. The split is the one TRAIN/TEST.DATASET mnist5k uses.
    """
    images, labels = sources.mnist5k_arrays()
    splits = sources.mnist5k_split_indices()
    for split in splits:
        split_dir = os.path.join(out_dir, split)
        # Writing into a folder that holds other files would mix them into the dataset.
        if os.path.isdir(split_dir) and os.listdir(split_dir):
            raise UserError(f"{split_dir} already exists and is not empty; remove it or choose another folder")
    counts = {}
    for split, idx in splits.items():
        for c in sources.MNIST_CLASSES:
            os.makedirs(os.path.join(out_dir, split, c), exist_ok=True)
        for pos, i in enumerate(idx):
            path = os.path.join(out_dir, split, str(labels[i]), f"{pos:04d}.png")
            Image.fromarray(images[i]).save(path)
        counts[split] = len(idx)
    return counts

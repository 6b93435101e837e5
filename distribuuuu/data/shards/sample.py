"""A sample of a shard set's images: what the recipe is decided from
(inferred/images.py) when TRAIN.DATASET is a shard set, as it is from
a seeded sample of a folder's files.

The images are the first ones of up to SPREAD evenly spaced shards, so
that a few files are opened and read from their start; shards hold a
mix of the classes (`data shard` shuffles before writing, and the tools
that write WebDataset tars do likewise), so their fronts are a sample of
the set.
"""

from __future__ import annotations

import itertools

import numpy as np

from distribuuuu.data.shards import tar
from distribuuuu.data.shards.index import ShardSet
from distribuuuu.data.sources.files import ImageFiles

SPREAD = 16  # shards opened at most


class SampledImages(ImageFiles):
    """Encoded images read once, as the ImageFiles interface gives them
    (no files: paths is None)."""

    def __init__(self, root: str, classes: list[str], images: list[tuple[str, bytes, int]]) -> None:
        super().__init__(root, classes, [], [label for _, _, label in images])
        self.paths, self.images = None, images

    def read(self, i: int) -> bytes:
        return self.images[i][1]

    def name(self, i: int) -> str:
        return self.images[i][0]


def sample_images(shard_set: ShardSet, count: int) -> SampledImages:
    """Up to count images with their labels from the fronts of the
    shards (module docstring); records without an image or a label are
    passed over."""
    shards = shard_set.shards
    picks = np.unique(np.linspace(0, len(shards) - 1, min(len(shards), SPREAD)).round())
    per_shard = -(-count // len(picks))
    found = []
    for k in picks.astype(int):
        path = shards[k].path
        for key, fields in itertools.islice(tar.samples(path), per_shard):
            try:
                image, label = shard_set.fields.read(fields)
            except ValueError:  # fields.MissingField, or a label that is no number
                continue
            found.append((f"record {key!r} of {path}", image, label))
    return SampledImages(shard_set.index_path, shard_set.classes, found[:count])

"""Imbalanced classes: the setup line that says the training classes'
sizes spread widely, and what TRAIN.CLASS_BALANCE needs from the data.

  none     the data as it is (default); with a wide spread, one setup line says so and names the way
           out
  sampler  BalancedDraw, the epoch's order of the training sampler
           (pipeline.ResumableDistributedSampler): every class drawn equally often (a sample with
           probability 1 / (classes x its class's size), with replacement), as many samples an epoch
           as now
  loss     the training cross-entropy weighs class c by N / (K x n_c): inverse to its size, mean 1
           over the training samples (scikit-learn's 'balanced'), so the loss keeps its scale
Evaluation stays on the real distribution: its exact sampler, and an
unweighted loss.

Both need every training sample's label before any image is read: the
dataset's ``targets`` (an image folder's listing, CIFAR's, mnist5k's and
a TensorSource's labels, synthetic data's, a TRAIN.VAL_SPLIT part's). A
shard set's index holds no labels (they are inside the tars):
check_datasets refuses the two there (SHARDS_REFUSAL).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from yacs.config import CfgNode

from distribuuuu.errors import UserError

log = logging.getLogger("distribuuuu")

# The largest class this many times the smallest, or more, gets the
# setup line: the smallest class then gets a third of the largest's
# updates or less, where plain training starts to favour the large ones.
SPREAD_RATIO = 3

SHARDS_REFUSAL = (
    "TRAIN.CLASS_BALANCE {mode} needs every training sample's label before the images are read, "
    "which a shard set's index.json does not hold (the labels are inside the tars); train on the "
    "image folder the shards were written from (TRAIN.DATASET <folder>), or set "
    "TRAIN.CLASS_BALANCE none"
)


def note_spread(cfg: CfgNode, dataset: Dataset) -> None:
    """The setup line when the training classes' sizes spread
    SPREAD_RATIO times or more; none where the labels are not known
    without reading the images (every rank may call it: only rank 0 logs
    INFO)."""
    labels = np.asarray(getattr(dataset, "targets", []), dtype=np.int64)
    counts = np.bincount(labels, minlength=len(dataset.classes) or 1)
    if counts.max() >= SPREAD_RATIO * counts.min(where=counts > 0, initial=counts.max()) > 0:
        log.info("setup: %s", spread_line(cfg.TRAIN.CLASS_BALANCE, counts, dataset.classes))


def spread_line(mode: str, counts: np.ndarray, classes: list[Any]) -> str:
    """'the training classes' sizes spread 40.0x: class cat has 12
    samples, class dog 480; ...' and the way out."""
    present = np.flatnonzero(counts)
    small, large = present[counts[present].argmin()], counts.argmax()
    name = lambda c: classes[c] if c < len(classes) else c  # noqa: E731
    what = (
        f"the training classes' sizes spread {counts[large] / counts[small]:.1f}x: class "
        f"{name(small)} has {counts[small]} samples, class {name(large)} {counts[large]}"
    )
    if mode != "none":
        return f"{what}; evened out by TRAIN.CLASS_BALANCE {mode}"
    return (
        f"{what}; TRAIN.CLASS_BALANCE sampler (draws every class equally often) or loss (weighs "
        "the loss by inverse class size) evens them out"
    )


def class_counts(
    dataset: Dataset, mode: str, num_classes: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(every sample's label, every class's size) for
    TRAIN.CLASS_BALANCE mode; UserError where the labels are not known
    without reading the images."""
    labels = np.asarray(getattr(dataset, "targets", []), dtype=np.int64)
    if len(labels) != len(dataset):
        raise UserError(
            f"TRAIN.CLASS_BALANCE {mode} needs every training sample's label before the images are "
            f"read, and the training data ({type(dataset).__name__}) has no `targets`; give it a "
            "`targets` list (image folders, CIFAR, mnist5k and TensorSources have one), or set "
            "TRAIN.CLASS_BALANCE none"
        )
    return labels, np.bincount(labels, minlength=max(num_classes, len(dataset.classes)))


def loss_weights(dataset: Dataset, num_classes: int) -> torch.Tensor:
    """TRAIN.CLASS_BALANCE loss: class c's weight N / (K x n_c) over the
    K classes present (1 for a class without training samples, which is
    never a target): mean 1 over the training samples."""
    _, counts = class_counts(dataset, "loss", num_classes)
    present = counts > 0
    weights = np.ones(len(counts))
    weights[present] = counts.sum() / (present.sum() * counts[present])
    return torch.tensor(weights, dtype=torch.float32)


class BalancedDraw:
    """TRAIN.CLASS_BALANCE sampler's order of an epoch: ``draw(size,
    generator=)`` -> ``size`` sample indices, drawn with replacement: a
    class uniformly among those present, then one of its samples
    uniformly, so a sample comes with probability 1 / (classes x its
    class's size), a small class's samples several times, a large
    class's some not at all. ResumableDistributedSampler seeds it by
    (seed, epoch), the same on every rank, then shards and skips it
    exactly as its permutation: exact-once over the draw's positions,
    step-exact resume. torch has no distributed weighted sampler
    (pytorch/pytorch#77154). Two stages rather than one
    torch.multinomial over the samples' weights, which takes at most
    2**24 categories. An image folder's items are seeded by (seed,
    epoch, index) in loader workers (exact resume), so a sample drawn
    twice in an epoch gets the same crop and flip both times; new ones
    the next epoch."""

    def __init__(self, dataset: Dataset) -> None:
        labels, counts = class_counts(dataset, "sampler")
        self.members = torch.from_numpy(
            np.argsort(labels, kind="stable")
        )  # the samples grouped by class
        self.counts = torch.from_numpy(counts)
        self.starts = (
            torch.cumsum(self.counts, 0) - self.counts
        )  # where each class's group begins in members

    def __call__(self, size: int, generator: torch.Generator) -> torch.Tensor:
        cls = torch.multinomial(
            (self.counts > 0).double(), size, replacement=True, generator=generator
        )
        pick = (
            torch.rand(size, generator=generator, dtype=torch.float64) * self.counts[cls]
        ).long()
        return self.members[self.starts[cls] + torch.minimum(pick, self.counts[cls] - 1)]

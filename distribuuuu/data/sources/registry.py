"""Named sources: a function ``build(split, cfg, key)`` registered
under a name, which a run naming it reads as ``build(cfg[key].SPLIT,
cfg, key)`` with key 'TRAIN' or 'TEST'. It returns either

- a ``TensorSource``: uint8 images [N, C, H, W] with labels, class
  names, normalization stats and an augmentation recipe, treated as
  mnist5k is (resized to TRAIN.IM_SIZE, pad-and-crop and flip in
  training, held on the device by TRAIN.DATA_PIPELINE auto while it
  fits); or
- a ``torch.utils.data.Dataset`` whose items are ready ``(float32 tensor
  [C, H, W], int label)`` and that has ``.classes`` and ``.targets``, as
  the synthetic source does: read as it is.

Every process calls ``build`` itself, so it must give the same data each
time and on every rank. A user's module registers its source when it is
imported, which IMPORTS / ``--import`` does in every process::

    from distribuuuu.data import TensorSource, register_source

    @register_source("tiny", splits=("train", "val"))
    def tiny(split, cfg, key):
        return TensorSource(images, labels, classes=["a", "b"], stats=((0.5,), (0.25,)))
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

import torch
from torch.utils.data import Dataset
from yacs.config import CfgNode

from distribuuuu.data.sources.builtin import (
    MNIST_SPLITS,
    TensorSource,
    check_split_name,
    mnist5k_source,
    synthetic_source,
)
from distribuuuu.data.transforms import Stats
from distribuuuu.errors import UserError

log = logging.getLogger("distribuuuu")
BUILTIN = ("mnist5k", "synthetic")

# A runtime alias: `|` needs Python 3.10's types on both sides.

SourceData = Union[TensorSource, Dataset]  # noqa: UP007


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
            f"channel, got {stats!r}"
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
            ".classes and .targets"
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
        last = len(data.classes) - 1
        return f"a TensorSource whose labels must lie in 0..{last} (one per name in classes)"
    if len(data.stats) != 2 or len(data.stats[0]) != len(data.stats[1]):
        return (
            "a TensorSource whose stats must be ((mean, ...), (std, ...)), one value per channel "
            "(or one for all)"
        )
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
            "TRAIN.AUTO_AUGMENT and TRAIN.RANDOM_ERASE have no effect on %s: those images are not "
            "augmented",
            what,
        )
    name = cfg.TRAIN.DATASET
    if data is not None and not _SOURCES[name].builtin and stated_stats(name, data) is None:
        log.warning(
            "TRAIN.DATASET %r states no normalization: the model card records pixels in [0, 1] "
            "(mean 0, std 1), and predict / load_model prepare images that way; if its items are "
            "normalized, state how: register_source(%r, stats=((mean, ...), (std, ...)))",
            name,
            name,
        )


def note() -> str:
    """The sources a DATASET may name, for a message about a missing
    folder: the built-ins and the user's, or how to register one."""
    names = [n for n in _SOURCES if n not in BUILTIN]
    builtin = f"a built-in source: {', '.join(BUILTIN)}"
    if names:
        return f"{builtin}; registered sources: {', '.join(names)}"
    how = "distribuuuu.data.register_source, in a module named by IMPORTS"
    return f"{builtin} (or register one: {how})"


def registered_data(cfg: CfgNode, key: str) -> SourceData | None:
    """What the registered source cfg[key].DATASET builds for
    cfg[key].SPLIT; None for other data and MODEL.DUMMY_INPUT."""
    if cfg.MODEL.DUMMY_INPUT or cfg[key].DATASET not in _SOURCES:
        return None
    return build_source(cfg, key)


# The registry: the built-in sources first, registered as a user's would
# be (register_source adds the user's).
_SOURCES: dict[str, Source] = {
    "mnist5k": Source("mnist5k", mnist5k_source, MNIST_SPLITS, builtin=True),
    "synthetic": Source("synthetic", synthetic_source, builtin=True),
}

"""Named dataset sources: the built-in ones (mnist5k, synthetic) and the user's, one registry.

A source is a function ``build(split, cfg, key)`` registered under a name; TRAIN.DATASET /
TEST.DATASET naming it (a registered name wins over a folder of that name) makes the run read
``build(cfg[key].SPLIT, cfg, key)`` with key 'TRAIN' or 'TEST' (which group of cfg asks: the
synthetic source reads cfg[key].SYNTHETIC_SAMPLES). It returns either

- a ``TensorSource``: uint8 images [N, C, H, W] with labels, class names, normalization stats and an
  augmentation recipe. The run then treats it as it treats mnist5k: resized to TRAIN.IM_SIZE,
  pad-and-crop / flip / TRAIN.AUTO_AUGMENT / TRAIN.RANDOM_ERASE in training, normalized with its
  stats (the data recipe keys, TRAIN.CROP_SCALE, FLIP_PROB, MEAN/STD..., override them), and held
  on the device by TRAIN.DATA_PIPELINE auto while it fits; or
- a ``torch.utils.data.Dataset`` whose items are ready ``(float32 tensor [C, H, W], int label)``
  and that has ``.classes`` (names in label order) and ``.targets`` (every item's label, for
  TRAIN.VAL_SPLIT and the preflight's class counts), as the synthetic source does. It is read as
  it is: no transform, no augmentation.

Every process calls ``build`` itself (the preflight, then each loader), so it must give the same
data each time and on every rank; cache what is slow to make (e.g. ``functools.lru_cache`` on a
helper that takes the split). A user's module registers its source when it is imported, which
IMPORTS / ``--import`` does in every process before the data is built::

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

from distribuuuu.data.transforms import Stats
from distribuuuu.errors import UserError


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


_SOURCES: dict[str, Source] = {}


def register_source(name: str, build: Builder | None = None, *, splits: tuple[str, ...] | None = None,
                    classes: list[str] | tuple[str, ...] | None = None, stats: Stats | None = None,
                    _builtin: bool = False) -> Callable:
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
    named = tuple(str(c) for c in classes) if classes is not None else None
    known_stats = (tuple(float(m) for m in stats[0]), tuple(float(v) for v in stats[1])) if stats is not None else None

    def add(fn: Builder) -> Builder:
        if not callable(fn):
            raise ValueError(f"register_source({name!r}): {fn!r} is not callable")
        known = _SOURCES.get(name)
        if known is not None:
            what = "a built-in source" if known.builtin else f"already registered (by {_where(known.build)})"
            raise ValueError(f"register_source: the dataset source {name!r} is {what}; pick another name")
        _SOURCES[name] = Source(name, fn, tuple(splits) if splits is not None else None, _builtin, named, known_stats)
        return fn

    return add if build is None else add(build)


def _where(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def unregister_source(name: str) -> None:
    """Forget a user's source (tests, notebooks that re-run a cell); built-ins stay."""
    known = _SOURCES.get(name)
    if known is not None and not known.builtin:
        del _SOURCES[name]


def get_source(name: str) -> Source | None:
    """The source registered as name, or None."""
    return _SOURCES.get(name)


def source_names() -> list[str]:
    """The registered names: the built-ins first, then the user's in registration order."""
    return [s.name for s in _SOURCES.values() if s.builtin] + [s.name for s in _SOURCES.values() if not s.builtin]


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
        _check_tensors(data, source, key)
    elif not (isinstance(data, Dataset) and hasattr(data, "classes") and hasattr(data, "targets")):
        raise UserError(f"{key}.DATASET {source.name!r}: {_where(source.build)} returned {type(data).__name__}, "
                        "but a dataset source returns a TensorSource or a Dataset with .classes and .targets")
    if source.classes is not None and tuple(str(c) for c in data.classes) != source.classes:
        raise UserError(f"{key}.DATASET {source.name!r}: {_where(source.build)} returned the classes "
                        f"{list(data.classes)[:5]}..., but register_source stated {list(source.classes)[:5]}...; "
                        "make them the same (names in label order)")
    return data


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


def warn_unstated_stats(cfg: CfgNode) -> None:
    """A user's Dataset source that states no normalization: its model card can only record pixels in
    [0, 1] (mean 0, std 1), which predict and load_model then apply; say so once, at train time."""
    source = None if cfg.MODEL.DUMMY_INPUT else get_source(cfg.TRAIN.DATASET)
    if source is None or source.builtin or source.stats is not None:
        return
    data = build_source(cfg, "TRAIN")
    if isinstance(data, TensorSource) or stated_stats(source.name, data) is not None:
        return
    logging.getLogger("distribuuuu").warning(
        "TRAIN.DATASET %r states no normalization: the model card records pixels in [0, 1] (mean 0, std 1), "
        "and predict / load_model prepare images that way; if its items are normalized, state how: "
        "register_source(%r, stats=((mean, ...), (std, ...)))", source.name, source.name)


def _check_tensors(data: TensorSource, source: Source, key: str) -> None:
    """UserError for tensors the loaders could not use (they would fail later, less clearly)."""
    images, targets = data.images, data.targets
    problem = None
    if not (isinstance(images, torch.Tensor) and images.dtype == torch.uint8 and images.dim() == 4):
        problem = "images must be a uint8 tensor [N, C, H, W]"
    elif not (isinstance(targets, torch.Tensor) and targets.shape == (len(images),)):
        problem = f"targets must be a tensor of {len(images)} labels, one per image"
    elif len(images) and not 0 <= int(targets.min()) <= int(targets.max()) < len(data.classes):
        problem = f"labels must lie in 0..{len(data.classes) - 1} (one per name in classes)"
    elif len(data.stats) != 2 or len(data.stats[0]) != len(data.stats[1]):
        problem = "stats must be ((mean, ...), (std, ...)), one value per channel (or one for all)"
    if problem:
        raise UserError(f"{key}.DATASET {source.name!r}: {_where(source.build)} returned a TensorSource whose "
                        f"{problem}")

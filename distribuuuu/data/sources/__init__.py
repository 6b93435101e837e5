"""Where data comes from: the kind of source a TRAIN.DATASET or
TEST.DATASET value names, and the reader of each kind.

``source_kind`` is the one chooser, cheap (no dataset read):

  registered  a name registered with register_source (mnist5k, synthetic,
              or a user's: registry.py), which wins over a folder of that name
  cifar       a folder of CIFAR pickles (cifar.py)
  shards      a shard set written by `distribuuuu data shard` (data/shards/)
  hf          a Hugging Face dataset on disk: save_to_disk's folder or
              Parquet files (hf.py)
  labels      images listed with their labels in a file (labels.py)
  folder      an image folder <DATASET>/<SPLIT>/<class>/<image> (folder.py)

Image files (a folder, label files, a Hugging Face dataset's image
bytes: IMAGE_FILES) are read through
``image_files``, an ImageFiles reader (files.py); small sources held as
one tensor (CIFAR, mnist5k, a user's TensorSource) through
``tensor_source``.
"""

from __future__ import annotations

import dataclasses
import os

from yacs.config import CfgNode

from distribuuuu.data.shards.index import is_shard_set
from distribuuuu.data.sources import cifar, folder, hf, labels, registry
from distribuuuu.data.sources.builtin import TensorSource
from distribuuuu.data.sources.files import ImageFiles
from distribuuuu.data.transforms import match_channels, stats_for_channels
from distribuuuu.errors import UserError

IMAGE_FILES = ("folder", "labels", "hf")  # the kinds read as image files through image_files


def source_kind(dataset: str) -> str:
    """'registered', 'cifar', 'shards', 'hf', 'labels' or 'folder'
    (module docstring)."""
    if registry.get_source(dataset) is not None:
        return "registered"
    if cifar.find_cifar(dataset) is not None:
        return "cifar"
    if is_shard_set(dataset):
        return "shards"
    if hf.is_hf_dataset(dataset):
        return "hf"
    if labels.is_label_source(dataset):
        return "labels"
    return "folder"


def kind_of(cfg: CfgNode, key: str) -> str:
    """The kind of cfg[key].DATASET, or 'dummy' under MODEL.DUMMY_INPUT."""
    return "dummy" if cfg.MODEL.DUMMY_INPUT else source_kind(cfg[key].DATASET)


def split_classes(cfg: CfgNode, key: str) -> tuple[str, list[str]]:
    """(<DATASET>/<SPLIT>, its classes in label order) of the folder
    cfg[key]. A TEST folder takes the training folder's order when that
    is here: the model's label i is the training class i, and a val
    split lacking a class folder would shift every later label."""
    group = cfg[key]
    split_dir = folder.folder_split_dir(group.DATASET, group.SPLIT, key, registry.note())
    classes = folder.folder_classes(split_dir)
    train_dir = os.path.join(cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT)
    if key == "TRAIN" or source_kind(cfg.TRAIN.DATASET) != "folder":
        return split_dir, classes
    if not os.path.isdir(train_dir):
        return split_dir, classes  # e.g. evaluating where the training images are not
    train_classes = folder.folder_classes(train_dir)
    extra = [c for c in classes if c not in set(train_classes)]
    if extra:
        raise UserError(
            f"TEST.DATASET has class folders that the training split {train_dir} lacks: "
            f"{', '.join(extra[:5])}; val classes must be a subset of the train classes"
        )
    return split_dir, train_classes


def image_files(cfg: CfgNode, key: str) -> ImageFiles:
    """The reader of cfg[key]'s image files: a folder split, label
    files, or a Hugging Face dataset's split."""
    group, kind = cfg[key], source_kind(cfg[key].DATASET)
    if kind == "folder":
        return folder.folder_files(*split_classes(cfg, key), key)
    train = None
    if key == "TEST" and source_kind(cfg.TRAIN.DATASET) in IMAGE_FILES:
        try:  # the model's label i is the training class i
            train = image_files(cfg, "TRAIN").classes
        except (UserError, OSError):
            train = None  # e.g. evaluating where the training images are not
    t = cfg.TRAIN
    if kind == "hf":
        return hf.hf_files(group.DATASET, group.SPLIT, t.IMAGE_FIELD, t.LABEL_FIELD, key, train)
    path = labels.find(group.DATASET, group.SPLIT)
    if path is None:
        names = ", ".join((*labels.METADATA, *labels.KAGGLE))
        raise UserError(
            f"{key}.DATASET {group.DATASET!r} holds no label file of split {group.SPLIT!r} "
            f"({names}, or {group.SPLIT}.csv, .tsv, .jsonl, .txt)"
        )
    return labels.label_files(path, group.SPLIT, t.IMAGE_FIELD, t.LABEL_FIELD, train)


def require_image_chans(cfg: CfgNode, key: str) -> None:
    """Image files become 1 (gray) or 3 (RGB) channels; other counts
    only exist for synthetic data."""
    chans = cfg.MODEL.IN_CHANS
    if chans not in (1, 3):
        raise UserError(
            f"MODEL.IN_CHANS is {chans}, but {key}.DATASET {cfg[key].DATASET!r} holds images, "
            "which become 1 (gray) or 3 (RGB) channels; set MODEL.IN_CHANS 1 or 3 (only the "
            "synthetic source makes any channel count)"
        )


def tensor_source(cfg: CfgNode, key: str, data: object = None) -> TensorSource | None:
    """The split of cfg[key] as a TensorSource whose channels and stats
    match MODEL.IN_CHANS: CIFAR, or a registered source that builds one
    (data: what it built, if already built); None for the others."""
    kind = kind_of(cfg, key)
    if kind == "cifar":
        require_image_chans(cfg, key)
        src = cifar.cifar_source(cfg, key)
    elif kind == "registered":
        src = registry.build_source(cfg, key) if data is None else data
    else:
        return None
    if not isinstance(src, TensorSource):
        return None
    have, chans = src.images.shape[1], cfg.MODEL.IN_CHANS
    if have != chans:
        require_image_chans(cfg, key)
        if have not in (1, 3):
            raise UserError(
                f"MODEL.IN_CHANS is {chans}, but {key}.DATASET {cfg[key].DATASET!r} has "
                f"{have}-channel images; set MODEL.IN_CHANS {have}"
            )
    images = match_channels(src.images, chans)
    return dataclasses.replace(src, images=images, stats=stats_for_channels(src.stats, chans))

"""Finding a shard set from TRAIN.DATASET / TEST.DATASET and checking it
before any rank reads it.

Accepted forms (recognised by is_shard_set): a shard root (DEST
of `data shard`, holding <SPLIT>/index.json), a split folder holding
index.json, the index.json path itself, or a brace pattern
``.../train-{000000..000127}.tar``. A brace pattern takes its counts and
classes from the index.json beside the tars; without one it is refused:
exactly-once splitting and equal step counts need every shard's sample
count before the first read, and scanning every tar's headers on every
rank at start would cost a full pass over the metadata of the data set
(write an index with `distribuuuu data shard`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

from distribuuuu.data.shards.fields import SampleFields
from distribuuuu.errors import UserError

FORMAT = "distribuuuu-shards/1"  # index.json's "format": what this version reads and writes
INDEX = "index.json"


@dataclasses.dataclass(frozen=True)
class Shard:
    path: str
    num_samples: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class ShardSet:
    """One split's shards, in index order, with the split's class names."""

    index_path: str
    classes: list[str]
    shards: tuple[Shard, ...]
    fields: SampleFields = dataclasses.field(default_factory=SampleFields)

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)


BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")


def is_shard_set(path: str) -> bool:
    """Whether path names a shard set in a form load_shard_set reads: a
    brace pattern of tars, an index.json, a folder holding one, or a
    root holding <split>/index.json."""
    if path.endswith(".tar") and BRACE.search(path):
        return True
    if not os.path.isdir(path):
        return os.path.isfile(path) and _is_index(path)
    folders = [path] + [e.path for e in os.scandir(path) if e.is_dir()]
    return any(_is_index(os.path.join(folder, INDEX)) for folder in folders)


def _is_index(path: str) -> bool:
    try:
        with open(path) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def expand_braces(pattern: str) -> list[str]:
    """'a-{000..002}.tar' -> ['a-000.tar', 'a-001.tar', 'a-002.tar']
    (zero padding kept; one range)."""
    m = BRACE.search(pattern)
    if not m:
        return [pattern]
    lo, hi, width = int(m.group(1)), int(m.group(2)), len(m.group(1))
    return [pattern[: m.start()] + f"{i:0{width}d}" + pattern[m.end() :] for i in range(lo, hi + 1)]


def _read_index(path: str, key: str) -> dict:
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{key}.DATASET: cannot read the shard index {path} ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise UserError(
            f"{key}.DATASET: {path} is not a distribuuuu shard index (format {FORMAT}); write "
            "shards with `distribuuuu data shard SRC DEST`"
        )
    return index


def index_path(dataset: str, split: str, key: str) -> str:
    """The index.json that cfg[key].DATASET (with cfg[key].SPLIT) names."""
    if os.path.isfile(dataset):
        return dataset
    if BRACE.search(dataset) or dataset.endswith(".tar"):
        beside = os.path.join(os.path.dirname(dataset), INDEX)
        if not os.path.isfile(beside):
            raise UserError(
                f"{key}.DATASET {dataset!r}: no {INDEX} beside the tars, so the per-shard sample "
                "counts are unknown (needed for exactly-once splitting over ranks); point at "
                "shards written by `distribuuuu data shard`, or at the folder holding their "
                "index.json"
            )
        return beside
    if os.path.isfile(os.path.join(dataset, INDEX)):
        return os.path.join(dataset, INDEX)
    path = os.path.join(dataset, split, INDEX)
    if not os.path.isfile(path):
        have = sorted(
            e.name
            for e in os.scandir(dataset)
            if e.is_dir() and os.path.isfile(os.path.join(e.path, INDEX))
        )
        raise UserError(
            f"{key}.DATASET {dataset!r} is a shard root without split {split!r} ({path} is "
            f"missing); its splits: {', '.join(have) or 'none'}; set {key}.SPLIT to one of them"
        )
    return path


def load_shard_set(
    dataset: str, split: str, key: str, image_field: str = "", label_field: str = ""
) -> ShardSet:
    """The shards cfg[key].DATASET names (a brace pattern: those it
    lists, in its order), checked; image_field / label_field:
    TRAIN.IMAGE_FIELD / LABEL_FIELD ('' = the index's)."""
    path = index_path(dataset, split, key)
    index = _read_index(path, key)
    folder = os.path.dirname(os.path.abspath(path))
    listed = {s["name"]: s for s in index["shards"]}
    if BRACE.search(dataset) or dataset.endswith(".tar"):
        names = [os.path.basename(p) for p in expand_braces(dataset)]
        unknown = [n for n in names if n not in listed]
        if unknown:
            raise UserError(
                f"{key}.DATASET {dataset!r}: shard {unknown[0]} is not in {path} ({len(unknown)} "
                f"of {len(names)} unknown); the index lists {len(listed)} shards"
            )
    else:
        names = [s["name"] for s in index["shards"]]
    shards = tuple(
        Shard(os.path.join(folder, n), int(listed[n]["num_samples"]), int(listed[n]["bytes"]))
        for n in names
    )
    fields = sample_fields(index, path, key, image_field, label_field)
    result = ShardSet(path, list(index["classes"]), shards, fields)
    verify(result, key)
    return result


def sample_fields(
    index: dict, path: str, key: str, image_field: str, label_field: str
) -> SampleFields:
    """How the samples are read: the fields the index was made with
    (`distribuuuu data index`), the image field overridden by
    TRAIN.IMAGE_FIELD. Its class names were read from its label field,
    so another TRAIN.LABEL_FIELD is refused."""
    indexed = index.get("label_field", "cls")
    if label_field and label_field != indexed:
        raise UserError(
            f"TRAIN.LABEL_FIELD is {label_field!r}, but {key}.DATASET's index {path} was made "
            f"with the label field {indexed!r}; leave TRAIN.LABEL_FIELD unset, or index the "
            f"tars again with `distribuuuu data index` --label-field {label_field}"
        )
    names = list(index["classes"]) if index.get("labels") == "names" else None
    return SampleFields(image_field or index.get("image_field", ""), indexed, names)


def verify(shard_set: ShardSet, key: str) -> None:
    """Every shard present with the size its index records: a missing or
    truncated shard is found here, by every rank alike, before any reads
    (so no rank waits for another that failed)."""
    for s in shard_set.shards:
        if not os.path.isfile(s.path):
            raise UserError(
                f"{key}.DATASET: shard {s.path} is missing (listed in {shard_set.index_path}); "
                "restore it or re-run `distribuuuu data shard`"
            )
        size = os.path.getsize(s.path)
        if size != s.bytes:
            raise UserError(
                f"{key}.DATASET: shard {s.path} is {size} bytes but its index records {s.bytes}: "
                "truncated or rewritten; restore it or re-run `distribuuuu data shard`"
            )
    if shard_set.num_samples == 0:
        raise UserError(f"{key}.DATASET: the shard set {shard_set.index_path} holds no samples")

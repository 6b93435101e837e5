"""`distribuuuu data index DIR`: the index.json a run needs, for
WebDataset-style tars written by other tools (webdataset's TarWriter,
timm's and LAION's scripts, `tar` itself).

A WebDataset tar carries no count of its samples (NVIDIA/DALI#6203),
and the reader's exactly-once plan needs every shard's count before the
first read (index.py). The counts are taken from an index the tars came
with, else read from the tar headers once (data seeked past, only the
small label members read):

- DIR/_info.json (or info.json): timm's (timm/data/readers/
  reader_wds.py), ``{"splits": {name: {"filenames", "shard_lengths"}}}``
  naming tars in DIR; each split's index goes to DIR/<split>/
  ('validation' is 'val'), listing the tars as ../<file>.tar.
- DIR/<split>/*.tar: each folder of tars a split, its index beside them.
- DIR/*.tar: one split, its index in DIR.

In a folder of tars, a wids shard index (webdataset's ``widsindex
create``: ``{"wids_version": 1, "shardlist": [{"url", "nsamples"}]}``)
gives the counts of the tars it lists.

The class names come from a classes.txt (one name per line, label i on
line i) in the split's folder or in DIR, else from the labels seen:
whole numbers are class indices ('0' .. 'K-1', K the same for every
split), other values names (sorted, as folders are). With counts and
classes.txt both given, no tar is read but the first sample.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys
from collections.abc import Iterator

from distribuuuu.data.shards import tar
from distribuuuu.data.shards.fields import MissingField, SampleFields
from distribuuuu.data.shards.index import FORMAT, INDEX
from distribuuuu.errors import UserError
from distribuuuu.files import atomic_write

INFO_FILES = ("_info.json", "info.json")  # timm's names, in the order its reader tries them
CLASSES = "classes.txt"
SPLIT_NAMES = {"validation": "val", "valid": "val"}
COMPRESSED = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")
WHOLE_NUMBER = re.compile(r"-?\d+")
FIELD_HINT = (
    "give every sample a label, or say where it is with --label-field (cls, json:KEY, or another "
    "member such as txt)"
)


@dataclasses.dataclass
class Split:
    """One split's tars, where its index goes, and the counts its tars
    came with (None: read from the tar headers)."""

    name: str
    folder: str
    tars: list[str]
    counts: list[int] | None = None
    counted_by: str = "the tar headers"
    labels: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    classes: list[str] | None = None  # from a classes.txt
    classes_per_tar: list[int] = dataclasses.field(default_factory=list)  # labels seen in each


def find_splits(root: str) -> list[Split]:
    """The splits of DIR (module docstring), their tars checked to be
    there."""
    if not os.path.isdir(root):
        raise UserError(f"data index: {root!r} is not a folder of tars")
    info = next((os.path.join(root, n) for n in INFO_FILES if _exists(root, n)), None)
    if info is not None:
        return _timm_splits(root, info)
    folders = sorted(e.path for e in os.scandir(root) if e.is_dir() and _tars(e.path))
    if folders and _tars(root):
        raise UserError(
            f"data index: {root} holds tars and folders of tars ({os.path.basename(folders[0])}"
            "/); put each split's tars in a folder of its own (DIR/train/, DIR/val/)"
        )
    if not folders and not _tars(root):
        packed = [e.name for e in os.scandir(root) if e.name.endswith(COMPRESSED)]
        hint = f"; {packed[0]} is compressed: decompress it first" if packed else ""
        raise UserError(
            f"data index: no .tar files in {root} (DIR/<split>/*.tar or DIR/*.tar){hint}"
        )
    named = [(os.path.basename(f), f) for f in folders] or [(os.path.basename(root), root)]
    return [_wids_split(Split(name, folder, _tars(folder))) for name, folder in named]


def _exists(folder: str, name: str) -> bool:
    return os.path.isfile(os.path.join(folder, name))


def _tars(folder: str) -> list[str]:
    names = (e.name for e in os.scandir(folder) if e.is_file() and e.name.endswith(".tar"))
    return [os.path.join(folder, n) for n in sorted(names) if not n.startswith(".")]


def _read_json(path: str) -> object:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"data index: cannot read {path} ({e})") from None


def _timm_splits(root: str, info_path: str) -> list[Split]:
    """timm's _info.json: each split's tars and counts (a split of an
    alternative label, ``alt_label``, counts other samples: left out)."""
    info = _read_json(info_path)
    splits = info.get("splits") if isinstance(info, dict) else None
    if not isinstance(splits, dict) or not splits:
        raise UserError(f"data index: {info_path} has no 'splits' (timm's _info.json format)")
    found = []
    for name, entry in splits.items():
        with _format(info_path, "timm's _info.json: filenames, shard_lengths per split"):
            if entry.get("alt_label"):
                continue
            tars = [os.path.join(root, f) for f in entry["filenames"]]
            counts = [int(n) for n in entry["shard_lengths"]]
            if len(counts) != len(tars):
                raise ValueError(f"split {name!r}: {len(tars)} filenames, {len(counts)} lengths")
        split = SPLIT_NAMES.get(name, name)
        by = os.path.basename(info_path)
        found.append(Split(split, os.path.join(root, split), tars, counts, by))
    for split in found:
        _require_present(split.tars, info_path)
    return found


def _wids_split(split: Split) -> Split:
    """The split with the tars and counts of the wids shard index in its
    folder, if there is one."""
    indexes = []
    for entry in os.scandir(split.folder):
        if entry.name.endswith(".json") and entry.name not in (INDEX, *INFO_FILES):
            with open(entry.path, "rb") as f:
                head = f.read(4096)
            if b"wids_version" in head or b"wids-shard-index" in head:
                indexes.append(entry.path)
    if not indexes:
        return split
    if len(indexes) > 1:
        raise UserError(
            f"data index: {split.folder} holds two wids indexes ({', '.join(sorted(indexes))}); "
            "keep the one that lists its tars"
        )
    desc = _read_json(indexes[0])
    if not isinstance(desc, dict) or desc.get("datasets") or not desc.get("shardlist"):
        raise UserError(
            f"data index: {indexes[0]} has no 'shardlist' of its own (sub-datasets are not "
            "read); list the tars in it with `widsindex create`"
        )
    with _format(indexes[0], "a wids shard index: url and nsamples per shard"):
        return _listed_split(split, desc, indexes[0])


def _listed_split(split: Split, desc: dict, index: str) -> Split:
    """The split as the wids index ``desc`` (at path index) lists it:
    urls relative to its folder (or to its ``base``), as wids reads
    them."""
    base = os.path.join(split.folder, _local(desc.get("base", ""), index))
    listed = desc["shardlist"]
    tars = [os.path.normpath(os.path.join(base, _local(s["url"], index))) for s in listed]
    _require_present(tars, f"{index} (urls are relative to its folder)")
    for path, shard in zip(tars, listed):
        size = shard.get("filesize")
        if size is not None and size != os.path.getsize(path):
            raise UserError(
                f"data index: {path} is {os.path.getsize(path)} bytes, but {index} records "
                f"{size}: the tar changed since; make the wids index again"
            )
    counts = [int(s["nsamples"]) for s in listed]
    return dataclasses.replace(split, tars=tars, counts=counts, counted_by=os.path.basename(index))


@contextlib.contextmanager
def _format(path: str, expected: str) -> Iterator[None]:
    """A file of another tool's format that is not as expected: a
    UserError naming it."""
    try:
        yield
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UserError(f"data index: {path} is not {expected} ({type(e).__name__}: {e})") from None


def _local(url: str, where: str) -> str:
    if url.startswith("file://"):
        return url[len("file://") :]
    if "://" in url:
        raise UserError(f"data index: {where} names {url}, not a local file; fetch the tars first")
    return url


def _require_present(tars: list[str], listed_in: str) -> None:
    missing = [t for t in tars if not os.path.isfile(t)]
    if missing:
        raise UserError(
            f"data index: {missing[0]} is listed in {listed_in} but is not there ({len(missing)} "
            f"of {len(tars)} missing)"
        )


def scan_shard(path: str, fields: SampleFields, limit: int | None = None) -> Split:
    """The samples of one tar counted, and each label value with the
    (shard, key) it was first seen at; only the label members are read.
    A sample without an image or a label is a UserError naming it."""
    wanted = fields.member
    records = tar.samples(path, want_data=lambda name: tar.split_name(name)[1] == wanted)
    count, labels = 0, {}
    for key, members in records:
        where = f"data index: shard {path}, sample {key!r}"
        try:
            fields.image_name(members)
        except MissingField as e:
            raise UserError(
                f"{where}: {e}; say which member is the image with --image-field"
            ) from None
        try:
            value = fields.value(members)
        except ValueError as e:  # fields.MissingField, or a .json that does not parse
            raise UserError(f"{where}: {e}; {FIELD_HINT}") from None
        if not value:
            raise UserError(f"data index: shard {path}, sample {key!r}: an empty label")
        labels.setdefault(value, (path, key))
        count += 1
        if count == limit:
            break
    return Split("", os.path.dirname(path), [path], [count], labels=labels)


def _scan(split: Split, fields: SampleFields, progress: bool) -> None:
    """Count the split's samples and collect its labels (all of its
    tars, or the first sample alone when counts and classes are given);
    a count off the one the tars came with is a UserError."""
    peek = split.counts is not None and split.classes is not None
    tars = split.tars[:1] if peek else split.tars
    bar = _bar(len(tars), split.name, progress)
    counts = []
    for path in tars:
        scanned = scan_shard(path, fields, limit=1 if peek else None)
        for value, where in scanned.labels.items():
            split.labels.setdefault(value, where)
        counts += scanned.counts
        split.classes_per_tar.append(len(scanned.labels))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if peek:
        return
    for path, have, listed in zip(split.tars, counts, split.counts or counts):
        if have != listed:
            raise UserError(
                f"data index: {path} holds {have} samples, but {split.counted_by} records "
                f"{listed}; remove {split.counted_by} to count them from the tars"
            )
    split.counts = counts


def class_order_note(split: Split) -> str:
    """A line when the tars hold their samples grouped by class: the
    reader shuffles the shard order and blocks of TRAIN.SHARD_SHUFFLE
    samples, not the whole set, so its batches would hold a few classes
    (docs/data-at-scale.md). Judged on the tars of at least twice as
    many samples as the split has classes, where a shuffled order shows
    at least 86% of the classes in each: '' when most show half."""
    k = len(split.labels)
    checked = [
        (seen, path)
        for seen, path, n in zip(split.classes_per_tar, split.tars, split.counts or [])
        if n >= 2 * k
    ]
    few = [(seen, path) for seen, path in checked if seen < k / 2]
    if k < 2 or len(few) * 2 <= len(checked):
        return ""
    seen, path = min(few)
    return (
        f"note: the {split.name} tars hold their samples grouped by class ({path} holds {seen} of "
        f"{k} classes); the reader shuffles the tar order and blocks of TRAIN.SHARD_SHUFFLE "
        "samples, not the whole set, so batches would hold few classes: write the tars from a "
        "shuffled list of samples"
    )


def _bar(total: int, desc: str, progress: bool):
    if not (progress and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"index {desc}", unit="tar")


def _read_classes(split: Split, root: str) -> list[str] | None:
    for folder in (split.folder, root):
        path = os.path.join(folder, CLASSES)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return [line.strip() for line in f if line.strip()]
    return None


def _label_kind(split: Split) -> str:
    """'indices' (every label a whole number) or 'names'; a negative
    number is no class (timm writes -1 for "no label")."""
    numbers = all(WHOLE_NUMBER.fullmatch(v) for v in split.labels)
    negative = next((v for v in split.labels if v.startswith("-")), None)
    if numbers and negative is not None:
        path, key = split.labels[negative]
        raise UserError(
            f"data index: shard {path}, sample {key!r}: label {negative} is no class (-1 marks a "
            "sample without a label); give every sample a class, or leave such samples out"
        )
    return "indices" if numbers else "names"


def _classes(split: Split, kind: str, largest: int, names: list[str]) -> list[str]:
    """The split's class names; its labels checked against a
    classes.txt."""
    if split.classes is None:
        return [str(i) for i in range(largest + 1)] if kind == "indices" else names
    for value, (path, key) in split.labels.items():
        known = int(value) < len(split.classes) if kind == "indices" else value in split.classes
        if not known:
            raise UserError(
                f"data index: shard {path}, sample {key!r}: label {value!r} is not a class of "
                f"{CLASSES} ({len(split.classes)} classes); fix the label or the class list"
            )
    return split.classes


def index_tars(
    root: str, image_field: str = "", label_field: str = "cls", progress: bool = True
) -> list[tuple[str, dict, str]]:
    """Index every split of DIR (module docstring); returns (index path,
    index, class_order_note) per split. Everything is checked before
    anything is written."""
    fields = SampleFields(image_field, label_field)
    splits = find_splits(root)
    for split in splits:
        split.classes = _read_classes(split, root)
        _require_own_index(split.folder)
        _scan(split, fields, progress)
    kinds = [_label_kind(s) for s in splits]
    numbers = [int(v) for s, k in zip(splits, kinds) if k == "indices" for v in s.labels]
    names = sorted({v for s, k in zip(splits, kinds) if k == "names" for v in s.labels})
    written = []
    for split, kind in zip(splits, kinds):
        classes = _classes(split, kind, max(numbers, default=-1), names)
        index = _index(split, fields, kind, classes)
        written.append((os.path.join(split.folder, INDEX), index, class_order_note(split)))
    for path, index, _ in written:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        text = (json.dumps(index, indent=1) + "\n").encode()
        atomic_write(path, lambda f, t=text: f.write(t))
    return written


def _index(split: Split, fields: SampleFields, kind: str, classes: list[str]) -> dict:
    """The split's index.json: data shard's format (index.py), with the
    fields its samples are read by and where its counts came from."""
    counts = split.counts or []
    return {
        "format": FORMAT,
        "split": split.name,
        "num_samples": sum(counts),
        "classes": classes,
        "shards": [
            {
                "name": os.path.relpath(t, split.folder),
                "num_samples": n,
                "bytes": os.path.getsize(t),
            }
            for t, n in zip(split.tars, counts)
        ],
        "image_field": fields.image_field,
        "label_field": fields.label_field,
        "labels": kind,
        "counted_by": split.counted_by,
    }


def _require_own_index(folder: str) -> None:
    """An index.json that another tool wrote is not overwritten."""
    path = os.path.join(folder, INDEX)
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            ours = json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        ours = False
    if not ours:
        raise UserError(
            f"data index: {path} exists and is not a distribuuuu shard index; move it away "
            "first (the run reads its index from that name)"
        )

"""Label files: images listed with their labels in a file beside them:
a Kaggle-style labels.csv (``id,label``), Hugging Face ImageFolder's
metadata.csv / metadata.jsonl (``file_name``), mmpretrain's annotation
file (``path label`` lines), or any CSV, TSV or JSON-lines file.

TRAIN.DATASET (or TEST.DATASET) names the file, or a folder holding
metadata.csv / metadata.jsonl or labels.csv (also .tsv, .jsonl), or one
holding ``<SPLIT>.csv`` (also .tsv, .jsonl, .txt) or
``<SPLIT>/metadata.csv``. The image column is
found by its usual name (IMAGE_COLUMNS) and the label column likewise,
or named by TRAIN.IMAGE_FIELD / TRAIN.LABEL_FIELD. A path is relative to
the label file's folder; an id without an extension is the one image
file with that stem under it. Labels are names (classes sorted as
folders are) or whole numbers (the class index), a classes.txt beside
the file naming them. A ``split`` column keeps the rows of the SPLIT
asked for ('validation' is 'val'); without one the file is one split.
"""

from __future__ import annotations

import csv
import json
import os
from collections import Counter

from torchvision.datasets.folder import IMG_EXTENSIONS

from distribuuuu.data.sources.files import ImageFiles, class_indices
from distribuuuu.errors import UserError

SUFFIXES = (".csv", ".tsv", ".jsonl", ".txt")
METADATA = ("metadata.csv", "metadata.jsonl")  # Hugging Face ImageFolder's
KAGGLE = ("labels.csv", "labels.tsv", "labels.jsonl")  # images/ + labels.csv, as Kaggle's sets
IMAGE_COLUMNS = ("file_name", "path", "filepath", "filename", "image", "img", "id", "image_id")
LABEL_COLUMNS = ("label", "labels", "class", "category", "target")
SPLIT_COLUMN, SPLIT_NAMES = "split", {"validation": "val", "valid": "val"}
CLASSES = "classes.txt"  # one class name per line, label i on line i


SPLIT_FILES = ("train", "val", "validation", "test")


def is_label_source(dataset: str) -> bool:
    """Whether DATASET names label files (find's forms, for any split)."""
    if os.path.isfile(dataset) or find(dataset) is not None:
        return find(dataset) is not None
    if not os.path.isdir(dataset):
        return False
    return any(find(dataset, split) is not None for split in SPLIT_FILES)


def find(dataset: str, split: str = "") -> str | None:
    """The label file a DATASET value (and SPLIT) names, or None."""
    if os.path.isfile(dataset):
        return dataset if dataset.lower().endswith(SUFFIXES) else None
    folders = [dataset, os.path.join(dataset, split)] if split else [dataset]
    for folder in folders:
        for name in (*METADATA, *KAGGLE):
            if os.path.isfile(os.path.join(folder, name)):
                return os.path.join(folder, name)
    if split:
        for suffix in SUFFIXES:
            if os.path.isfile(os.path.join(dataset, split + suffix)):
                return os.path.join(dataset, split + suffix)
    return None


def rows(path: str) -> tuple[list[str], list[dict[str, str]]]:
    """(the columns, one dict per row) of a label file: CSV or TSV with a
    header, JSON lines, or 'path label' lines (.txt)."""
    with open(path, newline="", encoding="utf-8-sig") as f:
        if path.lower().endswith(".jsonl"):
            found = [_json_row(path, n, line) for n, line in enumerate(f, 1) if line.strip()]
            columns = list(dict.fromkeys(k for row in found for k in row))
            return columns, found
        if path.lower().endswith(".txt"):
            found = [
                dict(zip(("path", "label"), line.rsplit(None, 1))) for line in f if line.strip()
            ]
            return ["path", "label"], found
        reader = csv.DictReader(f, delimiter="\t" if path.lower().endswith(".tsv") else ",")
        return list(reader.fieldnames or []), list(reader)


def _json_row(path: str, n: int, line: str) -> dict[str, str]:
    try:
        row = json.loads(line)
    except ValueError as e:
        raise UserError(f"{path}, line {n}: not a JSON object ({e})") from None
    if not isinstance(row, dict):
        raise UserError(f"{path}, line {n}: not a JSON object")
    return {k: "" if v is None else str(v) for k, v in row.items()}


def splits(path: str) -> set[str] | None:
    """The split names of a label file's split column, or None."""
    columns, found = rows(path)
    if SPLIT_COLUMN not in columns:
        return None
    return {SPLIT_NAMES.get(row[SPLIT_COLUMN], row[SPLIT_COLUMN]) for row in found}


def column(columns: list[str], asked: str, usual: tuple[str, ...], what: str, path: str) -> str:
    """The image or label column: the one asked for, else the first of
    the usual names; a UserError naming the columns there."""
    if asked and asked in columns:
        return asked
    found = next((c for c in usual if c in columns), None)
    if found and not asked:
        return found
    key = "TRAIN.IMAGE_FIELD" if what == "image" else "TRAIN.LABEL_FIELD"
    wanted = (
        f"the {what} column {asked!r}" if asked else f"{what} column (named {', '.join(usual)})"
    )
    raise UserError(
        f"{path} has no {wanted}: its columns are {', '.join(columns) or 'none'}; name the {what} "
        f"column with {key} COLUMN"
    )


def label_files(
    path: str, split: str, image_field: str, label_field: str, classes: list[str] | None = None
) -> ImageFiles:
    """The reader of a label file's split (module docstring); classes:
    the training classes a TEST file's names are matched to."""
    columns, found = rows(path)
    image = column(columns, image_field, IMAGE_COLUMNS, "image", path)
    label = column(columns, label_field, LABEL_COLUMNS, "label", path)
    first = 2 if path.lower().endswith((".csv", ".tsv")) else 1  # the row's line in the file
    numbered = list(enumerate(found, first))
    if split and SPLIT_COLUMN in columns:
        numbered = [
            (n, r)
            for n, r in numbered
            if SPLIT_NAMES.get(r[SPLIT_COLUMN], r[SPLIT_COLUMN]) == split
        ]
    folder = os.path.dirname(os.path.abspath(path))
    stems = _Stems(folder)
    paths, names = [], []
    for n, row in numbered:
        where = f"{path}, line {n}"
        name = (row.get(label) or "").strip()
        if not name:
            raise UserError(
                f"{where}: an empty {label!r}; give every image a label or remove the row"
            )
        paths.append(stems.file(row.get(image) or "", where))
        names.append(name)
    _require_one_label_each(path, numbered, paths, names)
    classes, targets = _classes(path, folder, names, classes)
    return ImageFiles(path, classes, paths, targets)


def _require_one_label_each(path: str, numbered: list, paths: list[str], names: list[str]) -> None:
    """Two rows naming one file with two labels: which is it?"""
    seen: dict[str, tuple[int, str]] = {}
    for (n, _), file, name in zip(numbered, paths, names):
        first = seen.setdefault(file, (n, name))
        if first[1] != name:
            raise UserError(
                f"{path}: lines {first[0]} and {n} give {file} two labels ({first[1]!r} and "
                f"{name!r}); keep one of them"
            )


def _classes(
    path: str, folder: str, names: list[str], train: list[str] | None
) -> tuple[list[str], list[int]]:
    """(class names in label order, each row's label): names sorted as
    folders are, or whole numbers as class indices (named by classes.txt
    when there is one); a TEST file takes the training classes."""
    listed = os.path.join(folder, CLASSES)
    named = _read_classes(listed) if os.path.isfile(listed) else None
    if all(n.isdigit() for n in names):
        labels = [int(n) for n in names]
        count = len(named) if named else max(labels, default=-1) + 1
        bad = next((n for n in labels if n >= count), None)
        if bad is not None:
            raise UserError(f"{path}: label {bad} is not a class of {listed} ({count} classes)")
        classes = train or named or [str(i) for i in range(count)]
        return classes, class_indices(path, labels, classes)
    classes = train if train is not None else named or sorted(set(names))
    return classes, class_indices(path, names, classes)


def _read_classes(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


class _Stems:
    """The image files under a folder by their stem, made when an id
    without an extension first needs it."""

    def __init__(self, folder: str) -> None:
        self.folder, self.by_stem = folder, None

    def file(self, value: str, where: str) -> str:
        path = os.path.normpath(os.path.join(self.folder, value.strip()))
        if os.path.isfile(path):
            return path
        if not value.strip() or os.path.splitext(value)[1].lower() in IMG_EXTENSIONS:
            raise UserError(f"{where}: no file {path}; fix the row or add the image")
        matches = self._index().get(os.path.basename(value.strip()), [])
        if len(matches) != 1:
            what = "no image file" if not matches else f"{len(matches)} image files"
            raise UserError(
                f"{where}: {what} named {value.strip()!r} with an image extension under "
                f"{self.folder}; give the file name with its extension"
            )
        return matches[0]

    def _index(self) -> dict[str, list[str]]:
        if self.by_stem is None:
            self.by_stem = {}
            for root, _, files in os.walk(self.folder, followlinks=True):
                for name in files:
                    stem, ext = os.path.splitext(name)
                    if ext.lower() in IMG_EXTENSIONS:
                        self.by_stem.setdefault(stem, []).append(os.path.join(root, name))
        return self.by_stem


def counts(files: ImageFiles) -> dict[str, int]:
    """{class: images} of a reader, in label order (classes without an
    image left out)."""
    per = Counter(files.targets)
    return {c: per[i] for i, c in enumerate(files.classes) if per[i]}

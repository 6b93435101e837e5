"""Hugging Face datasets on disk: a folder written by ``save_to_disk``
(a DatasetDict's dataset_dict.json with a folder per split, or one
Dataset's state.json), or Parquet files as the Hub keeps them
(``<split>-*.parquet`` / ``<split>.parquet``, also under data/; files
not named by a split are one Dataset), read map-style with the
``datasets`` library (``pip install "distribuuuu[hf]"``), imported here
only when such a dataset is read, and never over the network.

The image feature (TRAIN.IMAGE_FIELD, else IMAGE_FEATURES) is an Image
feature or encoded image bytes; the label feature (TRAIN.LABEL_FIELD,
else LABEL_FEATURES) a ClassLabel, whose names are the classes, or
names (sorted as folders are) or whole numbers (class indices). The
Hub's 'validation' split is our 'val'; one Dataset without splits is
every split asked for. A save_to_disk folder is memory-mapped where it
is; Parquet files are converted once into Arrow files in the datasets
cache (HF_DATASETS_CACHE) and memory-mapped from there.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
from typing import Any

from distribuuuu.data.sources.files import ImageFiles, class_indices
from distribuuuu.errors import UserError

DICT, STATE = "dataset_dict.json", "state.json"  # what save_to_disk writes
PARQUET_SPLITS = ("train", "validation", "valid", "val", "test")  # <split>-*.parquet
SPLIT_NAMES = {"validation": "val", "valid": "val"}  # the Hub's names -> ours
IMAGE_FEATURES = ("image", "img")
LABEL_FEATURES = ("label", "labels")


def is_hf_dataset(dataset: str) -> bool:
    """Whether DATASET is a save_to_disk folder or Parquet files (their
    names only: nothing read, nothing imported)."""
    if os.path.isfile(dataset):
        return dataset.endswith(".parquet")
    marks = (DICT, STATE, "*.parquet", os.path.join("data", "*.parquet"))
    return any(glob.glob(os.path.join(glob.escape(dataset), mark)) for mark in marks)


def parquet_files(dataset: str) -> dict[str, list[str]]:
    """{split as the files name it: its files} of a .parquet file or a
    folder holding them (or a data/ folder holding them); {'': files}
    when a file is not named by a split; {} when there are none. The
    paths are absolute: the datasets cache is the same however DATASET
    was written."""
    if os.path.isfile(dataset):
        return {"": [os.path.abspath(dataset)]} if dataset.endswith(".parquet") else {}
    folder = glob.escape(os.path.abspath(dataset))
    found = glob.glob(os.path.join(folder, "*.parquet"))
    found += glob.glob(os.path.join(folder, "data", "*.parquet"))
    by_split: dict[str, list[str]] = {}
    for path in sorted(found):
        name = os.path.basename(path)[: -len(".parquet")].split("-")[0]
        by_split.setdefault(name, []).append(path)
    if set(by_split) - set(PARQUET_SPLITS):
        return {"": sorted(found)}
    return by_split


def splits(dataset: str) -> list[str] | None:
    """Our names of DATASET's splits; None for one Dataset without
    splits (from the folder's files, nothing loaded)."""
    if os.path.isfile(os.path.join(dataset, DICT)):
        with open(os.path.join(dataset, DICT), encoding="utf-8") as f:
            named = json.load(f)["splits"]
    elif os.path.isfile(os.path.join(dataset, STATE)):
        return None
    else:
        named = list(parquet_files(dataset))
    if "" in named:
        return None
    return [SPLIT_NAMES.get(name, name) for name in named]


def _library() -> Any:
    """The datasets module, offline and quiet, or a UserError saying
    how to install it."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # read at import: no call to the Hub
    try:
        import datasets
    except ImportError:
        raise UserError(
            "a Hugging Face dataset is read with the datasets library, which is not installed: "
            'pip install "distribuuuu[hf]"'
        ) from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors reach us as exceptions
    return datasets


def _load(dataset: str, split: str, key: str) -> tuple[Any, str]:
    """(the Dataset of SPLIT in DATASET, where its rows are: a folder
    or a Parquet file, for messages)."""
    datasets = _library()
    files = parquet_files(dataset)
    try:
        if files:
            data_files = {name or "train": paths for name, paths in files.items()}
            loaded = datasets.load_dataset("parquet", data_files=data_files)
        else:
            loaded = datasets.load_from_disk(dataset)
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        raise UserError(
            f"{key}.DATASET {dataset}: not a readable Hugging Face dataset ({e})"
        ) from e
    if "" in files:  # files not named by a split: one Dataset
        return loaded["train"], _where(files[""])
    if not isinstance(loaded, datasets.DatasetDict):
        return loaded, dataset
    by_name = {SPLIT_NAMES.get(name, name): name for name in loaded}
    if split not in by_name:
        raise _no_split(dataset, split, key, list(loaded))
    name, where = by_name[split], os.path.join(dataset, by_name[split])
    if files:
        where = _where(files[name])
    return loaded[name], where


def _where(files: list[str]) -> str:
    more = f" (and {len(files) - 1} more Parquet files)" if len(files) > 1 else ""
    return files[0] + more


def _no_split(dataset: str, split: str, key: str, named: list[str]) -> UserError:
    ours = ", ".join(SPLIT_NAMES.get(name, name) for name in named)
    return UserError(
        f"{key}.DATASET {dataset} has no split {split!r}: its splits are {', '.join(named)}; set "
        f"{key}.SPLIT to one of {ours} (the Hub's 'validation' is 'val')"
    )


def _feature(rows: Any, asked: str, usual: tuple[str, ...], what: str, where: str) -> str:
    """The image or label feature: the one asked for, else the first of
    the usual names; a UserError naming the features there."""
    names = list(rows.features)
    if asked in names:
        return asked
    found = next((name for name in usual if name in names), None)
    if found and not asked:
        return found
    key = "TRAIN.IMAGE_FIELD" if what == "image" else "TRAIN.LABEL_FIELD"
    wanted = f"feature {asked!r}" if asked else f"{what} feature (named {', '.join(usual)})"
    raise UserError(
        f"{where} has no {wanted}: its features are {', '.join(names) or 'none'}; name the "
        f"{what} feature with {key} NAME"
    )


def hf_files(
    dataset: str,
    split: str,
    image_field: str,
    label_field: str,
    key: str,
    train: list[str] | None = None,
) -> HFImages:
    """The reader of SPLIT of a Hugging Face dataset on disk (module
    docstring); train: the training classes a TEST split's labels are
    matched to by name."""
    import pyarrow as pa

    rows, where = _load(dataset, split, key)
    image = _feature(rows, image_field, IMAGE_FEATURES, "image", where)
    label = _feature(rows, label_field, LABEL_FEATURES, "label", where)
    kind = rows.data.column(image).type
    is_struct = pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0
    if not (is_struct or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
        raise UserError(
            f"{where}: the feature {image!r} is {rows.features[image]}, not an image (an Image "
            "feature, or encoded image bytes); name the image feature with TRAIN.IMAGE_FIELD NAME"
        )
    values = rows.data.column(label).to_pylist()
    names = getattr(rows.features[label], "names", None)  # a ClassLabel's
    classes, targets = _classes(f"{where}, feature {label!r}", values, names, train)
    return HFImages(dataset, classes, targets, rows, image, is_struct, where)


def _classes(
    where: str, values: list, names: list[str] | None, train: list[str] | None
) -> tuple[list[str], list[int]]:
    """(class names in label order, each row's label): a ClassLabel's
    names, names sorted as folders are, or whole numbers as class
    indices; a TEST split takes the training classes (train)."""
    empty = next((i for i, v in enumerate(values) if v in (None, "") or _negative(v)), None)
    if empty is not None:
        raise UserError(
            f"{where}, row {empty}: no label ({values[empty]!r}); give every image a label, or "
            "leave the unlabelled rows out (Dataset.filter) and save the dataset again"
        )
    if not all(isinstance(v, (int, str)) for v in values):
        bad = next(v for v in values if not isinstance(v, (int, str)))
        raise UserError(f"{where}: a label {bad!r} is not a class (a name or a whole number)")
    if names is not None:  # a ClassLabel: values index its names
        bad = next((v for v in values if v >= len(names)), None)
        if bad is not None:
            raise UserError(f"{where}: label {bad} is not one of its {len(names)} names")
        if train is None:
            return list(names), values
        values = [names[v] for v in values]
    if all(isinstance(v, int) for v in values):
        classes = train or [str(c) for c in range(max(values, default=-1) + 1)]
    else:
        values = [str(v) for v in values]
        classes = train or sorted(set(values))
    return classes, class_indices(where, values, classes)


def _negative(value: object) -> bool:
    """A ClassLabel's -1 (no label, as the Hub's unlabelled test splits
    have), or any class index below 0."""
    return isinstance(value, int) and value < 0


class HFImages(ImageFiles):
    """The rows of one split of a Dataset: item i is row i's encoded
    image, read from the memory-mapped Arrow column itself (Dataset[i]
    formats the whole row, 7x the time: docs/data-formats.md). It
    pickles as the Dataset does, by its files (each loader worker maps
    them again), not by its bytes: the column is dropped."""

    def __init__(
        self,
        root: str,
        classes: list[str],
        targets: list[int],
        rows: Any,
        image: str,
        is_struct: bool,
        where: str,
    ) -> None:
        super().__init__(root, classes, None, targets)  # a reader of bytes: no paths
        self.rows, self.image, self.is_struct, self.where = rows, image, is_struct, where
        self.column = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "column": None}

    def buffer(self, i: int) -> Any:
        """Row i's image bytes as an Arrow buffer on the mapped file (no
        copy), or its file's bytes when the row holds a path only."""
        if self.column is None:
            self.column = self.rows.data.column(self.image)
        value = self.column[i]
        if self.is_struct:
            path, value = value["path"].as_py(), value["bytes"]
            if not value.is_valid and path:
                return pathlib.Path(path).read_bytes()
        if not value.is_valid:
            raise OSError(f"{self.name(i)} holds no image")
        return value.as_buffer()

    def read(self, i: int) -> bytes:
        return bytes(self.buffer(i))

    def size(self, i: int) -> int:
        return len(self.buffer(i))

    def name(self, i: int) -> str:
        return f"{self.where} row {i}"

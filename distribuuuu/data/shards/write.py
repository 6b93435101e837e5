"""`distribuuuu data shard SRC DEST`: an image dataset as
WebDataset-layout tar shards + index.json.

Each sample is two tar members, ``<key>.<ext>`` (the file's original
encoded bytes, never re-encoded) and ``<key>.cls`` (the class index as
ASCII), the layout webdataset.WebDataset reads. Samples are shuffled
ONCE with ``seed`` before writing, so that a shard holds every class and
not one (folders list class by class); the reader shuffles again per
epoch. Keys are the sample's position in the sorted source listing
("%08d"), so a key names the same image in every run.

The tars are written by hand with tarfile rather than
webdataset.TarWriter: TarWriter stamps each member with the current time
and the user's name, so two runs would differ; here the mtime, uid/gid,
names, mode and member order are fixed, and the same input + seed give
byte-identical shards. A shard is written to a temporary name and
renamed when complete.
"""

from __future__ import annotations

import functools
import io
import json
import os
import pathlib
import sys
import tarfile
from collections.abc import Callable

import numpy as np

from distribuuuu.data.shards.index import FORMAT, INDEX
from distribuuuu.data.sources import builtin, folder
from distribuuuu.errors import UserError

SPLIT_NAMES = ("train", "val", "test")
_BLOCK = 512  # tar block: every member is a header block plus its data padded to whole blocks


def member_bytes(size: int) -> int:
    """The bytes one tar member of `size` data bytes takes (header +
    padded data)."""
    return _BLOCK + (size + _BLOCK - 1) // _BLOCK * _BLOCK


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


# A sample to write: (key, extension, a function returning its encoded
# bytes, class index)
Sample = tuple[str, str, Callable[[], bytes], int]


def _folder_samples(split_dir: str) -> tuple[list[str], list[Sample]]:
    classes = folder.folder_classes(split_dir)
    listing = folder.require_no_loop(folder.list_split(split_dir, classes), "SRC")
    out: list[Sample] = []
    for i, (path, label) in enumerate(listing.samples()):
        ext = os.path.splitext(path)[1].lstrip(".").lower() or "img"
        out.append((f"{i:08d}", ext, lambda p=path: pathlib.Path(p).read_bytes(), label))
    return classes, out


def _png(image: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def _mnist5k_samples(split: str) -> tuple[list[str], list[Sample]]:
    # The digits exist only as pixels: encoded as PNG (lossless), once.
    digits, labels = builtin.load_mnist5k(split, "SRC")
    arr = digits[:, 0].numpy()
    return list(builtin.MNIST_CLASSES), [
        (f"{i:08d}", "png", lambda a=arr[i]: _png(a), int(labels[i])) for i in range(len(arr))
    ]


def _splits_of(src: str) -> dict[str, Callable[[], tuple[list[str], list[Sample]]]]:
    """split name -> a function listing its (classes, samples)."""
    if src == "mnist5k":
        return {s: (lambda s=s: _mnist5k_samples(s)) for s in builtin.MNIST_SPLITS}
    if not os.path.isdir(src):
        raise UserError(
            f"data shard: SRC {src!r} is neither a folder nor a built-in source; give an image "
            "folder (<class>/<image>), a dataset root holding train/ val/, or mnist5k"
        )
    roots = [s for s in SPLIT_NAMES if os.path.isdir(os.path.join(src, s))]
    if roots:  # a dataset root, laid out like TRAIN.DATASET
        return {s: functools.partial(_folder_samples, os.path.join(src, s)) for s in roots}
    name = os.path.basename(os.path.normpath(src))
    return {name: lambda: _folder_samples(src)}


def _bar(total: int, desc: str, progress: bool):
    if not (progress and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="img")


def write_split(
    name: str,
    classes: list[str],
    samples: list[Sample],
    dest: str,
    *,
    shard_bytes: int,
    shard_samples: int | None,
    seed: int,
    progress: bool,
) -> pathlib.Path:
    """Write one split's shards and index.json into dest; returns the
    index path."""
    if not samples:
        raise UserError(f"data shard: split {name!r} has no images")
    order = np.random.default_rng(seed).permutation(len(samples))
    os.makedirs(dest, exist_ok=True)
    bar, shards = _bar(len(samples), name, progress), []
    pos, k = 0, 0
    while pos < len(order):
        chunk, used = [], 0
        while pos < len(order):  # fill one shard
            key, ext, read, label = samples[order[pos]]
            blob = read()  # one shard's bytes in memory at a time
            size = member_bytes(len(blob)) + member_bytes(len(str(label)))
            if chunk and (
                used + size > shard_bytes
                or (shard_samples is not None and len(chunk) >= shard_samples)
            ):
                break
            chunk.append((key, ext, blob, label))
            used, pos = used + size, pos + 1
        shard = f"{name}-{k:06d}.tar"
        tmp = os.path.join(dest, f".{shard}.tmp")
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            for key, ext, blob, label in chunk:
                _add(tar, f"{key}.{ext}", blob)
                _add(tar, f"{key}.cls", str(label).encode())
        os.replace(tmp, os.path.join(dest, shard))
        shards.append(
            {
                "name": shard,
                "num_samples": len(chunk),
                "bytes": os.path.getsize(os.path.join(dest, shard)),
            }
        )
        if bar is not None:
            bar.update(len(chunk))
        k += 1
    if bar is not None:
        bar.close()
    index = {
        "format": FORMAT,
        "split": name,
        "num_samples": len(samples),
        "classes": classes,
        "shards": shards,
        "seed": seed,
    }
    path = pathlib.Path(dest) / INDEX
    path.write_text(json.dumps(index, indent=1) + "\n")
    return path


def write_shards(
    src: str,
    dest: str,
    *,
    shard_bytes: int = 256 * 2**20,
    shard_samples: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> list[pathlib.Path]:
    """Shard every split of src into dest/<split>/ (see the module
    docstring); returns the index files.

    src: an ImageFolder split (class folders), a dataset root holding
    train/ val/ [test/], or mnist5k.
    """
    if shard_bytes < 1 or (shard_samples is not None and shard_samples < 1):
        raise UserError("data shard: --shard-size and --shard-samples must be positive")
    splits = _splits_of(src)
    for name in splits:
        out = os.path.join(dest, name)
        # Writing into a folder with other files would mix old shards
        # into the set.
        if os.path.isdir(out) and os.listdir(out):
            raise UserError(
                f"data shard: {out} already exists and is not empty; remove it or choose another "
                "DEST"
            )
    written = []
    for name, listing in splits.items():
        classes, samples = listing()
        written.append(
            write_split(
                name,
                classes,
                samples,
                os.path.join(dest, name),
                shard_bytes=shard_bytes,
                shard_samples=shard_samples,
                seed=seed,
                progress=progress,
            )
        )
    return written


def parse_size(text: str) -> int:
    """'256MB', '64M', '1G', '500K', '1000' -> bytes (powers of 1024)."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in units and t[-1:] else ""
    try:
        value = float(t[:-1] if unit else t)
    except ValueError:
        raise UserError(
            f"data shard: --shard-size {text!r} is not a size; write e.g. 256MB, 64M, 1G or 500K"
        ) from None
    if value <= 0:
        raise UserError(f"data shard: --shard-size must be positive, got {text!r}")
    return int(value * units[unit])

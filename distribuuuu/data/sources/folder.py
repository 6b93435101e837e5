"""Image folders: <DATASET>/<SPLIT>/<class>/<image>, listed as
torchvision's ImageFolder lists them.

``list_split`` lists a split in one walk (symlinks followed, the same
files in the same order as ImageFolder) that never enters a symlink to a
folder containing it (``ln -s .. train/2/loop`` would list 300 images as
tens of thousands): such loops are recorded and refused. Each file keeps
readdir's inode number, free, with which the data checks find the same
file listed twice.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

from distribuuuu.data.sources.files import ImageFiles
from distribuuuu.errors import UserError

NAMED = 5  # how many offenders a message names


LAYOUT = "<DATASET>/<SPLIT>/<class>/<image>"


def partial_name(folder: str) -> str:
    """Where `distribuuuu data export` writes folder until it is
    complete (then renamed to folder)."""
    return folder.rstrip(os.sep) + ".partial"


def folder_split_dir(dataset: str, split: str, key: str, sources_note: str) -> str:
    """<DATASET>/<SPLIT>, or a UserError that says what was looked for
    and what is expected (sources_note: the sources a name may take)."""
    split_dir = os.path.join(dataset, split)
    if not os.path.isdir(split_dir):
        missing = "" if os.path.isdir(dataset) else f"; {dataset!r} itself does not exist"
        if os.path.isdir(partial_name(dataset)):
            missing += (
                f"; {partial_name(dataset)} holds an export that did not complete: run the "
                "export again"
            )
        raise UserError(
            f"{key}.DATASET is {dataset!r} but there is no folder {split_dir!r} "
            f"({key}.DATASET/{key}.SPLIT{missing}). Expected an image tree {LAYOUT} (e.g. "
            f"{os.path.join(split_dir, 'cat', '0001.jpg')}; {key}.SPLIT '' reads "
            "<DATASET>/<class>/<image>), a CIFAR folder holding "
            f"cifar-10-batches-py/ or cifar-100-python/, or {sources_note}"
        )
    return split_dir


def folder_classes(split_dir: str) -> list[str]:
    """Sorted class folder names. Hidden folders (.ipynb_checkpoints,
    ...) are skipped: plain ImageFolder would make them classes and
    shift every label after them."""
    return sorted(
        e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith(".")
    )


@dataclass
class SplitListing:
    """The image files of a split, per class in ImageFolder's order, and
    the symlink loops met. entries: class -> [(path, readdir's inode
    number, None for a symlink)]."""

    split_dir: str
    classes: list[str]
    entries: dict[str, list[tuple[str, int | None]]]
    loops: list[tuple[str, str]]  # (symlink, the real folder it points to)
    skipped: dict[str, Counter] = field(default_factory=dict)  # class -> extensions not read

    def files(self, cls: str) -> list[str]:
        return [path for path, _ in self.entries.get(cls, [])]

    def count(self, cls: str) -> int:
        return len(self.entries.get(cls, []))

    def samples(self) -> list[tuple[str, int]]:
        """(path, class index) of every listed file, as
        DatasetFolder.make_dataset returns them."""
        index = {c: i for i, c in enumerate(self.classes)}
        return [(path, index[c]) for c in sorted(self.classes) for path in self.files(c)]


def list_split(split_dir: str, classes: list[str]) -> SplitListing:
    """The image files of split_dir/<class> for each class (folders that
    do not exist: none)."""
    listing = SplitListing(split_dir, list(classes), {}, [])
    for c in classes:
        if os.path.isdir(os.path.join(split_dir, c)):
            skipped = listing.skipped[c] = Counter()
            listing.entries[c] = _walk_class(os.path.join(split_dir, c), listing.loops, skipped)
    return listing


def _walk_class(
    class_dir: str, loops: list[tuple[str, str]], skipped: Counter
) -> list[tuple[str, int | None]]:
    """The image files below class_dir, os.walk(followlinks=True)'s,
    sorted as ImageFolder sorts them, except that a symlinked folder
    pointing to a folder that contains it (real paths compared down the
    way) is recorded in loops and not entered. Unreadable folders are
    skipped, as os.walk skips them."""
    found: list[tuple[str, list[tuple[str, int | None]]]] = []
    stack = [
        (class_dir, (os.path.realpath(class_dir),))
    ]  # (listed path, real paths from the class down)
    while stack:
        root, chain = stack.pop()
        try:
            with os.scandir(root) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            continue
        files = []
        for e in entries:
            try:
                is_dir = e.is_dir()  # follows symlinks, as os.walk(followlinks=True)
            except OSError:
                is_dir = False
            if is_dir:
                real = (
                    os.path.realpath(e.path) if e.is_symlink() else os.path.join(chain[-1], e.name)
                )
                if any(r == real or r.startswith(real.rstrip(os.sep) + os.sep) for r in chain):
                    loops.append((e.path, real))
                else:
                    stack.append((e.path, (*chain, real)))
            elif has_file_allowed_extension(e.name, IMG_EXTENSIONS):
                files.append((e.path, None if e.is_symlink() else e.inode()))
            else:
                skipped[os.path.splitext(e.name)[1].lower() or e.name] += 1
        found.append((root, files))
    return [file for _, files in sorted(found, key=lambda f: f[0]) for file in files]


def require_no_loop(listing: SplitListing, key: str) -> SplitListing:
    """The listing, or a UserError naming the symlinks that point to a
    folder containing them."""
    if listing.loops:
        shown = "; ".join(f"{link} -> {target}" for link, target in listing.loops[:NAMED])
        more = f" (and {len(listing.loops) - NAMED} more)" if len(listing.loops) > NAMED else ""
        raise UserError(
            f"{key}.DATASET: {len(listing.loops)} symlink(s) in {listing.split_dir} point to a "
            "folder that contains them, a loop that would list the same images over and over: "
            f"{shown}{more}. Remove them (rm {listing.loops[0][0]}) or point them outside the "
            "class folders"
        )
    return listing


def folder_files(split_dir: str, classes: list[str], key: str) -> ImageFiles:
    """The reader of a folder split: its listed files in ImageFolder's
    order, labelled by their class's position in classes."""
    listing = require_no_loop(list_split(split_dir, classes), key)
    samples = listing.samples()
    paths = [path for path, _ in samples]
    return ImageFiles(split_dir, classes, paths, [label for _, label in samples])

"""Each image once: the same real file listed twice in a folder split
(through a symlink or a hard link: the same st_dev and st_ino), refused
unless TRAIN.DUPLICATE_IMAGES keep (deliberate oversampling).
readdir's inode numbers group the candidates for free and only files
sharing one are stat'ed, so a tree without links costs no more than its
listing."""

from __future__ import annotations

import os

from distribuuuu.data.sources.folder import NAMED, SplitListing
from distribuuuu.errors import UserError


def file_id(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the file path names, links followed: the same
    pair is the same file (a symlink or a hard link of it); None if it
    cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def duplicates(listing: SplitListing) -> list[tuple[str, str]]:
    """(path listed again, path listed first) for every listed file
    whose real file was listed before.

    Candidates share an inode number: readdir's for a plain file (free),
    the target's for a symlink (one stat; a dangling link is an
    unreadable image, not a duplicate). Only files sharing one are
    stat'ed, since an inode number alone can mislead (two devices,
    overlayfs).
    """
    by_ino: dict[int, list[str]] = {}
    for c in listing.classes:
        for path, ino in listing.entries.get(c, []):
            if ino is None:
                target = file_id(path)
                if target is None:
                    continue
                ino = target[1]
            by_ino.setdefault(ino, []).append(path)
    pairs: list[tuple[str, str]] = []
    for paths in (paths for paths in by_ino.values() if len(paths) > 1):
        first: dict[tuple[int, int], str] = {}
        for path in paths:
            key = file_id(path)
            if key in first:
                pairs.append((path, first[key]))
            elif key is not None:
                first[key] = path
    return pairs


def require_no_duplicates(listing: SplitListing, key: str) -> None:
    """UserError counting the files listed twice (through symlinks or
    hard links), naming the first few pairs."""
    pairs = duplicates(listing)
    if pairs:
        split = listing.split_dir.rstrip(os.sep) + os.sep
        shown = "; ".join(
            f"{again.removeprefix(split)} is {first.removeprefix(split)}"
            for again, first in pairs[:NAMED]
        )
        raise UserError(
            f"{key}.DATASET: {len(pairs)} image file(s) in {listing.split_dir} are, through "
            "symlinks or hard links, the same real file as another listed one: "
            f"{shown}{_more(pairs)}. Remove the extra links, or set TRAIN.DUPLICATE_IMAGES keep to "
            "train on every listed copy (oversampling)"
        )


def _more(named: list) -> str:
    return f" (and {len(named) - NAMED} more)" if len(named) > NAMED else ""

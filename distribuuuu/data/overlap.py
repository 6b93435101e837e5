"""Evaluation images that are also training images (TRAIN.OVERLAP): reported, or refused.

A val image hard-linked, symlinked or copied into train makes the val accuracy a training
accuracy, and nothing in the numbers shows it. ``find`` compares the two image-folder splits:

- the same file: the same (st_dev, st_ino), a hard link or a symlink of it;
- the same bytes: sizes first (the stat already made), then only files whose size some file of
  the other split has are read: 4 KiB first, and the whole file only when those match. A dataset
  is never read whole; a folder of images of one fixed byte size (BMP, raw PPM) costs 4 KiB per file.

Cost: one stat per file of both splits and the reads above; measured in docs/reliability.md.
``check`` runs it on rank 0 once the process group is up and broadcasts the verdict (one small
object), so every rank refuses alike (TRAIN.OVERLAP error: exit 2) and none waits on another.
The TRAIN.VAL_SPLIT hold-out is cut from the listed training files and cannot overlap the rest;
shard sets are not compared (their records have no file identity to stat).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any

from yacs.config import CfgNode

from distribuuuu.data import integrity, sources
from distribuuuu.errors import UserError

HEAD = 4096  # bytes read first from a file whose size matches one of the other split
_BLOCK = 1 << 20
NAMED = 5  # examples a message names


@dataclass
class Overlap:
    """Pairs (training path, evaluation path, how) and what finding them cost."""

    pairs: list[tuple[str, str, str]]
    stated: int  # files stat'ed
    read: int  # files read (4 KiB or whole)


def digest(path: str, limit: int | None = None) -> bytes | None:
    """blake2b of the first `limit` bytes of path (None: all of it); None if it cannot be read."""
    h = hashlib.blake2b(digest_size=16)
    try:
        with open(path, "rb") as f:
            left = limit if limit is not None else -1
            while left:
                block = f.read(_BLOCK if left < 0 else min(_BLOCK, left))
                if not block:
                    break
                h.update(block)
                left = left - len(block) if left > 0 else left
    except OSError:
        return None
    return h.digest()


def _stat_all(paths: list[str]) -> dict[str, os.stat_result]:
    """{path: os.stat(path)} of the paths that can be stat'ed (links followed)."""
    out = {}
    for p in paths:
        try:
            out[p] = os.stat(p)
        except OSError:
            continue  # unreadable: the datasets skip or refuse it (TRAIN.BAD_IMAGES)
    return out


def _whole(path: str, cache: dict[str, bytes | None]) -> bytes | None:
    if path not in cache:
        cache[path] = digest(path)
    return cache[path]


def _same_bytes(train: dict[str, int], test_by_size: dict[int, list[str]]) -> list[tuple[str, str, str]]:
    """(train path, test path, 'same bytes') for train files (path: size) whose bytes equal a test file's."""
    pairs = []
    wholes: dict[str, bytes | None] = {}  # test path -> digest of the whole file, once
    by_size: dict[int, list[str]] = {}
    for path, size in train.items():
        by_size.setdefault(size, []).append(path)
    for size, train_paths in by_size.items():
        limit = HEAD if size > HEAD else None  # a small file is read whole at once
        heads: dict[bytes, list[str]] = {}
        for t in test_by_size[size]:
            key = digest(t, limit)
            if key is not None:
                heads.setdefault(key, []).append(t)
        for path in train_paths:
            same_head = heads.get(digest(path, limit) or b"", [])
            if limit is None and same_head:
                pairs.append((path, same_head[0], "same bytes"))
            elif same_head:
                whole = digest(path)
                match = next((t for t in same_head if whole is not None and _whole(t, wholes) == whole), None)
                if match is not None:
                    pairs.append((path, match, "same bytes"))
    return pairs


def find(train_paths: list[str], test_paths: list[str]) -> Overlap:
    """The training files that are an evaluation file: the same file (hard link, symlink) or the same bytes."""
    test_stats = _stat_all(test_paths)
    test_ids = {(st.st_dev, st.st_ino): p for p, st in test_stats.items()}
    test_by_size: dict[int, list[str]] = {}
    for p, st in test_stats.items():
        test_by_size.setdefault(st.st_size, []).append(p)
    pairs, candidates = [], {}
    train_stats = _stat_all(train_paths)
    for path, st in train_stats.items():
        twin = test_ids.get((st.st_dev, st.st_ino))
        if twin is not None:
            how = "symlink" if os.path.realpath(path) == os.path.realpath(twin) else "hard link"
            pairs.append((path, twin, how))
        elif st.st_size and st.st_size in test_by_size:  # empty files are unreadable images, not copies
            candidates[path] = st.st_size
    read = len(candidates) + sum(len(test_by_size[s]) for s in set(candidates.values()))
    pairs += _same_bytes(candidates, test_by_size)
    return Overlap(pairs, len(test_stats) + len(train_stats), read)


def _split_paths(cfg: CfgNode, key: str) -> list[str]:
    group = cfg[key]
    split_dir = sources.folder_split_dir(group.DATASET, group.SPLIT, key)
    listing = integrity.list_split(split_dir, sources.folder_classes(split_dir))
    return [path for path, _ in listing.samples()]


def message(cfg: CfgNode, found: Overlap) -> str:
    """One line: how many training images are evaluation images, how, the first pairs, the way out."""
    kinds = {how: sum(1 for *_, h in found.pairs if h == how) for how in ("hard link", "symlink", "same bytes")}
    counts = ", ".join(f"{n} {how}" for how, n in kinds.items() if n)
    train_dir = os.path.join(cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT)
    base = os.path.commonpath([os.path.abspath(train_dir), os.path.abspath(os.path.join(cfg.TEST.DATASET,
                                                                                        cfg.TEST.SPLIT))])
    rel = (lambda p: os.path.relpath(os.path.abspath(p), base))  # noqa: E731 (short paths in one line)
    shown = "; ".join(f"{rel(a)} is {rel(b)} ({how})" for a, b, how in found.pairs[:NAMED])
    more = f" (and {len(found.pairs) - NAMED} more)" if len(found.pairs) > NAMED else ""
    return (f"{len(found.pairs)} image(s) of TRAIN.DATASET are also in TEST.DATASET ({counts}), under {base}: "
            f"{shown}{more}. Evaluating on images trained on overstates accuracy: remove them from one split "
            f"(TRAIN.OVERLAP {cfg.TRAIN.OVERLAP}; 'error' refuses such a run, 'off' skips this check)")


def check(cfg: CfgNode, is_main: bool) -> None:
    """TRAIN.OVERLAP: rank 0 compares the training and evaluation folders and every rank gets the
    verdict (one broadcast: call it on every rank); 'warn' logs it on rank 0, 'error' is a UserError
    on every rank. Not two image folders (or OVERLAP off): nothing to compare, no collective."""
    if cfg.TRAIN.OVERLAP == "off" or cfg.MODEL.DUMMY_INPUT:
        return
    if sources.source_kind(cfg.TRAIN.DATASET) != "folder" or sources.source_kind(cfg.TEST.DATASET) != "folder":
        return
    if (cfg.TEST.DATASET, cfg.TEST.SPLIT) == (cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT):
        return  # one folder of class folders: its val part is held out of it (TRAIN.VAL_SPLIT), no overlap
    from distribuuuu.launch import comm  # torch.distributed: only once there is something to compare

    verdict: Any = None
    if is_main:
        found = find(_split_paths(cfg, "TRAIN"), _split_paths(cfg, "TEST"))
        verdict = (len(found.pairs), message(cfg, found)) if found.pairs else (0, "")
    count, text = comm.broadcast_object(verdict)
    if count and cfg.TRAIN.OVERLAP == "error":
        raise UserError(text)
    if count and is_main:
        logging.getLogger("distribuuuu").warning(text)

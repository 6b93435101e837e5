"""Evaluation images that are training images (TRAIN.OVERLAP): the same
file (a hard link or a symlink), or the same bytes (a copy).

``check_overlap`` runs once the process group is up: rank 0 looks and
broadcasts its verdict, so that every rank refuses alike. Near-linear
in the number of images: files are stat'ed, and only those of a byte
size both splits have are read and hashed (docs/reliability.md). The
TRAIN.VAL_SPLIT part is held out of the training split and cannot
overlap it; TEST naming the training split itself, nothing held out, is
all overlap; shard sets are not compared (their records have no file
identity).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass

import numpy as np
from yacs.config import CfgNode

from distribuuuu.data import holdout, sources
from distribuuuu.data.checks.preflight import scan
from distribuuuu.data.sources.files import ImageFiles
from distribuuuu.errors import UserError

NAMED = 5  # how many pairs a message names
log = logging.getLogger("distribuuuu")


@dataclass
class Overlap:
    """Pairs (training image, evaluation image, how) and what finding
    them cost."""

    pairs: list[tuple[str, str, str]]
    stated: int  # files stat'ed
    read: int  # images read whole


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _sizes(files: ImageFiles, items: list[int]) -> dict[int, tuple[tuple[int, int] | None, int]]:
    """{item: (its file's (st_dev, st_ino) or None, its byte size)} of the
    items that can be stat'ed (or sized, for a reader of bytes); the
    others the datasets skip or refuse (TRAIN.BAD_IMAGES)."""
    out = {}
    for i in items:
        try:
            if files.paths is None:
                out[i] = (None, files.size(i))
            else:
                st = os.stat(files.paths[i])
                out[i] = ((st.st_dev, st.st_ino), st.st_size)
        except OSError:
            continue
    return out


def find(train: ImageFiles, test: ImageFiles, train_items: list[int] | None = None) -> Overlap:
    """The training images (train_items of train: all by default) that
    are an evaluation image: the same file, or the same bytes (images of
    a byte size both splits have, grouped by content hash)."""
    train_items = range(len(train)) if train_items is None else train_items
    train_sizes, test_sizes = _sizes(train, list(train_items)), _sizes(test, range(len(test)))
    test_ids = {file_id: i for i, (file_id, _) in test_sizes.items() if file_id is not None}
    pairs, candidates = [], {}
    for i, (file_id, size) in train_sizes.items():
        twin = test_ids.get(file_id) if file_id is not None else None
        if twin is not None:
            a, b = train.name(i), test.name(twin)
            how = "symlink" if os.path.realpath(a) == os.path.realpath(b) else "hard link"
            pairs.append((a, b, how))
        elif size:  # empty files are unreadable images, not copies
            candidates[i] = size
    shared = set(candidates.values()) & {size for _, size in test_sizes.values()}
    by_content: dict[tuple[int, bytes], int] = {}  # (size, hash) -> the first test item
    read = 0
    for i, (_, size) in test_sizes.items():
        if size in shared and (content := _read(test, i)) is not None:
            read += 1
            by_content.setdefault((size, digest(content)), i)
    for i, size in candidates.items():
        if size in shared and (content := _read(train, i)) is not None:
            read += 1
            twin = by_content.get((size, digest(content)))
            if twin is not None:
                pairs.append((train.name(i), test.name(twin), "same bytes"))
    return Overlap(pairs, len(train_sizes) + len(test_sizes), read)


def _read(files: ImageFiles, i: int) -> bytes | None:
    try:
        return files.read(i)
    except OSError:
        return None


def overlap_message(cfg: CfgNode, found: Overlap) -> str:
    """One line: how many training images are evaluation images, how,
    the first pairs, the way out."""
    hows = ("hard link", "symlink", "same bytes")
    kinds = {how: sum(1 for *_, h in found.pairs if h == how) for how in hows}
    counts = ", ".join(f"{n} {how}" for how, n in kinds.items() if n)
    roots = [os.path.abspath(os.path.join(cfg[k].DATASET, cfg[k].SPLIT)) for k in ("TRAIN", "TEST")]
    base = os.path.commonpath(roots)

    def short(path: str) -> str:
        return os.path.relpath(os.path.abspath(path), base)

    shown = "; ".join(f"{short(a)} is {short(b)} ({how})" for a, b, how in found.pairs[:NAMED])
    more = f" (and {len(found.pairs) - NAMED} more)" if len(found.pairs) > NAMED else ""
    return (
        f"{len(found.pairs)} image(s) of TRAIN.DATASET are also in TEST.DATASET ({counts}), "
        f"under {base}: {shown}{more}. {_overstates(cfg, 'remove them from one split')}"
    )


def _overstates(cfg: CfgNode, fix: str) -> str:
    return (
        f"Evaluating on images trained on overstates accuracy: {fix} (TRAIN.OVERLAP "
        f"{cfg.TRAIN.OVERLAP}; 'error' refuses such a run, 'off' skips this check)"
    )


def _verdict(cfg: CfgNode) -> tuple[int, str]:
    """(how many training images are evaluation images, the message)."""
    train, test = sources.image_files(cfg, "TRAIN"), sources.image_files(cfg, "TEST")
    kept = None
    if cfg.TRAIN.VAL_SPLIT:  # only what is trained on
        kept = holdout.holdout_indices(np.asarray(train.targets), cfg.TRAIN.VAL_SPLIT)[0].tolist()
    found = find(train, test, kept)
    return len(found.pairs), overlap_message(cfg, found) if found.pairs else ""


def check_overlap(cfg: CfgNode, is_main: bool) -> None:
    """TRAIN.OVERLAP: rank 0 compares the training and evaluation images
    and every rank gets the verdict (one broadcast: call it on every
    rank); 'warn' logs it on rank 0, 'error' is a UserError on every
    rank. Nothing to compare: OVERLAP off, not two image splits, or the
    held-out part of the training split."""
    t, test = cfg.TRAIN, cfg.TEST
    same_split = (test.DATASET, test.SPLIT) == (t.DATASET, t.SPLIT)
    if t.OVERLAP == "off" or cfg.MODEL.DUMMY_INPUT or (t.VAL_SPLIT and same_split):
        return
    if same_split:
        count = scan(cfg, "TEST")[1]
        way_out = "evaluate on a split of its own (TEST.SPLIT val) or hold a part out "
        way_out += "(TRAIN.VAL_SPLIT 0.1)"
        text = (
            f"TEST.DATASET {test.DATASET!r}, split {test.SPLIT!r}, is the training split itself "
            f"and TRAIN.VAL_SPLIT holds nothing out: all {count} evaluation images are training "
            f"images. {_overstates(cfg, way_out)}"
        )
    elif not {sources.kind_of(cfg, "TRAIN"), sources.kind_of(cfg, "TEST")} <= set(
        sources.IMAGE_FILES
    ):
        return
    else:
        from distribuuuu.launch import comm  # torch.distributed: only when there is work

        count, text = comm.broadcast_object(_verdict(cfg) if is_main else None)
    if count and t.OVERLAP == "error":
        raise UserError(text)
    if count and is_main:
        log.warning(text)

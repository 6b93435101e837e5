"""The checks every run makes of its data before it trains, each a
UserError (exit 2) naming what is wrong.

check_datasets, the preflight of TRAIN.DATASET / TEST.DATASET, runs on
every rank before any process group starts, on the same config and
files: a bad path ends every rank with exit 2 instead of one rank
failing while the others wait in a collective. Image folders are listed
whole, in one walk (the listing the datasets use): a symlink loop, a
class folder without images, a class with no image that decodes (files
are opened until one does: about one open per class) and, unless
TRAIN.DUPLICATE_IMAGES keep (deliberate oversampling), the same real
file listed twice (duplicates: through a symlink or a hard link, the
same st_dev and st_ino; readdir's inode numbers group the candidates for
free and only files sharing one are stat'ed, so a tree without links
costs no more than the listing). The training set must hold at least one
optimizer step, TRAIN.BATCH_SIZE x processes x ACCUM_STEPS samples (an
epoch drops its last partial step), the part TRAIN.VAL_SPLIT holds out
must leave every class a training image, and the TEST data's label i
must be the training class i (_require_same_labels).

check_overlap (TRAIN.OVERLAP) runs once the process group is up: rank 0
looks for evaluation images that are training images (the same file, or
the same bytes: a copy) and broadcasts its verdict, so every rank
refuses alike; near-linear in the number of files (docs/reliability.md).
The TRAIN.VAL_SPLIT hold-out cannot overlap the rest; TEST naming the
training split itself with nothing held out is all overlap (its count is
said); shard sets are not compared (their records have no file
identity).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image
from yacs.config import CfgNode

from distribuuuu.data import balance, datasets, images, sources
from distribuuuu.data.pipeline import data_pipeline
from distribuuuu.errors import UserError

NAMED = images.NAMED  # how many offenders a message names


# ---------------------------------------------------------------------------------------------
# The preflight
# ---------------------------------------------------------------------------------------------
def check_datasets(cfg: CfgNode, world_size: int, train: bool = True) -> list[str]:
    """Raise UserError when the data of cfg cannot work; train=False
    checks TEST only (eval). Returns the notes for rank 0's setup lines
    (an evaluation set too small to tell models apart)."""
    if cfg.MODEL.DUMMY_INPUT:
        return []  # random tensors: nothing on disk to check
    classes, counts = {}, {}
    for key in ("TRAIN", "TEST") if train else ("TEST",):
        if (
            cfg.TRAIN.DATA_PIPELINE == "memory"
        ):  # refused here, before any process starts, if impossible
            data_pipeline(cfg, key)
        classes[key], n, counts[key] = _scan(cfg, key)
        _require_class_count(cfg, key, len(classes[key]))
        if key == "TRAIN":
            train_n, kept = _training_samples(cfg, n, counts[key], world_size)
            shards = counts[key] is None  # (a shard set has no per-class counts)
    if train:  # after TEST's checks: a wrong path or layout is the first thing to hear about
        _require_one_step(cfg, train_n, kept, world_size)
        if shards:
            _require_no_empty_step(cfg, train_n, world_size)
        _require_same_labels(cfg, classes["TRAIN"], classes["TEST"])
    return (
        datasets.small_eval_set(cfg, counts, n, train)
        if cfg.TRAIN.VAL_SPLIT or n < datasets.SMALL_EVAL_SET
        else []
    )


def _scan(cfg: CfgNode, key: str) -> tuple[list[str], int, dict[str, int] | None]:
    """(class names in label order, number of samples, {class: samples};
    None for a shard set) of cfg[key].DATASET, with the source's own
    checks."""
    kind = sources.source_kind(cfg[key].DATASET)
    if kind in ("folder", "cifar", "shards"):
        sources.require_image_chans(cfg, key)
    if kind != "folder":
        return _scan_source(cfg, key, kind)
    counts = _scan_folder(cfg, key)
    return list(counts), sum(counts.values()), counts


def _scan_source(cfg: CfgNode, key: str, kind: str) -> tuple[list[str], int, dict[str, int] | None]:
    """_scan of a shard set (counts and classes from the index; every
    shard present at its size), CIFAR or a registered source
    (synthetic's targets are i mod NUM_CLASSES, made without images)."""
    group = cfg[key]
    if kind == "shards":
        from distribuuuu.data.shards.index import load_shard_set

        shard_set = load_shard_set(group.DATASET, group.SPLIT, key)
        if key == "TRAIN" and cfg.TRAIN.CLASS_BALANCE != "none":
            raise UserError(balance.SHARDS_REFUSAL.format(mode=cfg.TRAIN.CLASS_BALANCE))
        return list(shard_set.classes), shard_set.num_samples, None
    if kind == "cifar":
        _, targets, names = datasets.load_cifar(
            *sources.find_cifar(group.DATASET), group.SPLIT, key
        )
    else:
        data = sources.build_source(cfg, key)
        sources.tensor_source(cfg, key, data)  # the channel checks of a TensorSource
        targets, names = data.targets, data.classes
    labels, counts = np.unique(np.asarray(targets), return_counts=True)
    names = [str(c) for c in names]
    return (
        names,
        len(targets),
        {(names[k] if k < len(names) else str(k)): int(n) for k, n in zip(labels, counts)},
    )


def _scan_folder(cfg: CfgNode, key: str) -> dict[str, int]:
    """{class: number of images} of a folder split, after refusing what
    cannot work."""
    group = cfg[key]
    split_dir = sources.folder_split_dir(group.DATASET, group.SPLIT, key)
    classes = sources.folder_classes(split_dir)
    if not classes:
        raise UserError(
            f"{key}.DATASET: {split_dir} holds no class folders; expected {sources.LAYOUT} "
            f"(e.g. {os.path.join(split_dir, 'cat', '0001.jpg')})"
        )
    listing = images.require_no_loop(images.list_split(split_dir, classes), key)
    if cfg.TRAIN.DUPLICATE_IMAGES == "fail":
        require_no_duplicates(listing, key)
    counts = {c: listing.count(c) for c in classes}
    empty = [c for c, n in counts.items() if n == 0]
    if empty:
        raise UserError(
            f"{key}.DATASET: {len(empty)} class folder(s) in {split_dir} hold no image file "
            f"({', '.join(empty[:NAMED])}{_more(empty)}); put images in them or remove them"
        )
    dead = [
        f"{c} ({counts[c]} files; {why})"
        for c in classes
        if (why := _none_decodes(listing.files(c)))
    ]
    if dead:
        raise UserError(
            f"{key}.DATASET: every image file of {len(dead)} class folder(s) in {split_dir} is "
            f"unreadable: {'; '.join(dead[:NAMED])}{_more(dead)}. Replace them with images that "
            "open, "
            "or remove the class folder(s)"
        )
    if key == "TEST":
        sources.eval_folder_classes(cfg, classes)  # val classes must be train classes
        _require_eval_resize(cfg, "val images are")
    return counts


def _more(named: list) -> str:
    return f" (and {len(named) - NAMED} more)" if len(named) > NAMED else ""


def _none_decodes(paths: list[str]) -> str | None:
    """None when one of paths decodes (opened in order until one does:
    one open for a good class), else why the first one did not (they
    would never be trained on, or evaluated)."""
    why = None
    for path in paths:
        err = can_decode(path)
        if err is None:
            return None
        why = why or f"{path}: {err}"
    return why


def can_decode(path: str) -> str | None:
    """None when path decodes as an image, else why not. JPEGs are
    decoded at 1/8 scale (PIL draft): the whole file is still read, at a
    fraction of the cost."""
    try:
        with Image.open(path) as image:
            image.draft(image.mode, (1, 1))  # JPEG only; a no-op for other formats
            image.load()
        return None
    except images.DECODE_ERRORS as e:
        return f"{type(e).__name__}: {e}"


def _require_eval_resize(cfg: CfgNode, what: str) -> None:
    if cfg.TEST.IM_SIZE < cfg.TRAIN.IM_SIZE:
        raise UserError(
            f"TEST.IM_SIZE ({cfg.TEST.IM_SIZE}) must be >= TRAIN.IM_SIZE ({cfg.TRAIN.IM_SIZE}): "
            f"{what} resized to TEST.IM_SIZE, then center-cropped to TRAIN.IM_SIZE"
        )


def _require_same_labels(cfg: CfgNode, train: list[str], test: list[str]) -> None:
    """The model's label i is the training data's class i. Two image
    folders, or two shard sets, match the TEST classes to it by name
    (sources.eval_folder_classes, shards.loader); other TEST data is
    read in its own numbering, which must then name the same class at
    each label."""
    kinds = {sources.source_kind(cfg[key].DATASET) for key in ("TRAIN", "TEST")}
    if (len(kinds) == 1 and kinds <= {"folder", "shards"}) or test == train[: len(test)]:
        return
    i = next(i for i, (a, b) in enumerate(zip(train, test)) if a != b)
    raise UserError(
        f"TEST.DATASET {cfg.TEST.DATASET!r} numbers its classes otherwise than TRAIN.DATASET "
        f"{cfg.TRAIN.DATASET!r}: label {i} is {test[i]!r} there, {train[i]!r} in training, so "
        "every "
        "evaluation would count answers against other classes; evaluate on data whose label i is "
        "the "
        "training class i (two image folders, or two shard sets, are matched by class name)"
    )


def _require_class_count(cfg: CfgNode, key: str, n_classes: int) -> None:
    """The model has one output per training class: MODEL.NUM_CLASSES
    must be the TRAIN data's count (outputs without a class would appear
    in the model card as made-up names), and the TEST data may hold no
    more classes than that."""
    num = cfg.MODEL.NUM_CLASSES
    if n_classes == num or (key == "TEST" and n_classes < num):
        return
    fix = (
        "leave MODEL.NUM_CLASSES unset (0) to follow the data"
        if key == "TRAIN"
        else f"evaluate on data of at most {num} classes"
    )
    raise UserError(
        f"{key}.DATASET {cfg[key].DATASET!r} has {n_classes} classes but MODEL.NUM_CLASSES is "
        f"{num}; "
        f"{fix}, or set MODEL.NUM_CLASSES {n_classes}"
    )


def _training_samples(
    cfg: CfgNode, n: int, counts: dict[str, int] | None, world_size: int
) -> tuple[int, str]:
    """(the samples training reads, what TRAIN.VAL_SPLIT held out of
    them: '' or a phrase), after refusing a hold-out that cannot work
    and a world size above the training samples."""
    t, kept = cfg.TRAIN, ""
    if t.VAL_SPLIT:
        if counts is None:
            raise UserError(
                "TRAIN.VAL_SPLIT holds out random samples, which a shard set (read as a stream) "
                "cannot "
                "give; shard a val split too (`distribuuuu data shard` writes one per folder) and "
                "set "
                "TEST.DATASET to it, with TRAIN.VAL_SPLIT 0"
            )
        if sources.source_kind(t.DATASET) == "folder":
            _require_eval_resize(cfg, "the images TRAIN.VAL_SPLIT holds out are")
        held = datasets.check_holdout(counts, t.VAL_SPLIT)
        n, kept = n - held, f" left after TRAIN.VAL_SPLIT holds out {held}"
    if n < world_size:
        raise UserError(
            f"world size {world_size} is larger than the {n} training samples{kept} of "
            f"TRAIN.DATASET {t.DATASET!r}; use at most {n} processes or more data"
        )
    return n, kept


def _require_one_step(cfg: CfgNode, n: int, kept: str, world_size: int) -> None:
    """UserError when n training samples make no whole optimizer step
    (an epoch would run none)."""
    batch, accum = cfg.TRAIN.BATCH_SIZE, cfg.TRAIN.ACCUM_STEPS
    step = batch * world_size * accum
    if n >= step:
        return
    per_rank = n // world_size
    fix = (
        f"set TRAIN.BATCH_SIZE {per_rank // accum} or less"
        if per_rank >= accum
        else f"set TRAIN.ACCUM_STEPS {per_rank} or less and TRAIN.BATCH_SIZE 1"
    )
    raise UserError(
        f"TRAIN.DATASET {cfg.TRAIN.DATASET!r} has {n} training samples{kept}, {per_rank} per "
        "process, "
        f"but one optimizer step takes TRAIN.BATCH_SIZE {batch} x {world_size} process(es) x "
        f"TRAIN.ACCUM_STEPS {accum} = {step}: an epoch would run no step; {fix}, or use more data"
    )


def _require_no_empty_step(cfg: CfgNode, n: int, world_size: int) -> None:
    """Shards run every sample in equal step counts (shards/plan.py):
    refuse a plan where a rank has an empty step."""
    from distribuuuu.data.shards import plan

    batch, accum = cfg.TRAIN.BATCH_SIZE, cfg.TRAIN.ACCUM_STEPS
    if plan.smallest_train_batch(n, world_size, batch, accum) < 1:
        raise UserError(
            f"TRAIN.DATASET {cfg.TRAIN.DATASET!r}: {n} samples over {world_size} process(es) in "
            f"{plan.train_steps(n, world_size, batch, accum)} steps (TRAIN.BATCH_SIZE {batch}, "
            "ACCUM_STEPS "
            f"{accum}) would leave a step without a sample on some process; raise TRAIN.BATCH_SIZE "
            "to 2 "
            "or more, or lower TRAIN.ACCUM_STEPS"
        )


# ---------------------------------------------------------------------------------------------
# Each image once: the same real file listed twice
# ---------------------------------------------------------------------------------------------
def file_id(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the file path names, links followed: the same
    pair is the same file (a symlink or a hard link of it); None if it
    cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def duplicates(listing: images.SplitListing) -> list[tuple[str, str]]:
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


def require_no_duplicates(listing: images.SplitListing, key: str) -> None:
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
            "symlinks or "
            f"hard links, the same real file as another listed one: {shown}{_more(pairs)}. Remove "
            "the "
            "extra links, or set TRAIN.DUPLICATE_IMAGES keep to train on every listed copy "
            "(oversampling)"
        )


# ---------------------------------------------------------------------------------------------
# Evaluation images that are also training images (TRAIN.OVERLAP)
# ---------------------------------------------------------------------------------------------
@dataclass
class Overlap:
    """Pairs (training path, evaluation path, how) and what finding them
    cost."""

    pairs: list[tuple[str, str, str]]
    stated: int  # files stat'ed
    read: int  # files read (whole)


def digest(path: str) -> bytes | None:
    """blake2b of the whole file (read in 1 MiB blocks); None if it
    cannot be read."""
    h = hashlib.blake2b(digest_size=16)
    try:
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    except OSError:
        return None
    return h.digest()


def _stat_all(paths: list[str]) -> dict[str, os.stat_result]:
    """{path: os.stat(path)} of the paths that can be stat'ed (links
    followed; the others the datasets skip or refuse: TRAIN.BAD_IMAGES)."""
    out = {}
    for path in paths:
        try:
            out[path] = os.stat(path)
        except OSError:
            continue
    return out


def find(train_paths: list[str], test_paths: list[str]) -> Overlap:
    """The training files that are an evaluation file: the same file (a
    hard link or a symlink: the same st_dev and st_ino), or the same
    bytes (files of a byte size both splits have, grouped by content
    hash)."""
    test_stats, train_stats = _stat_all(test_paths), _stat_all(train_paths)
    test_ids = {(st.st_dev, st.st_ino): path for path, st in test_stats.items()}
    pairs, candidates = [], {}
    for path, st in train_stats.items():
        twin = test_ids.get((st.st_dev, st.st_ino))
        if twin is not None:
            pairs.append(
                (
                    path,
                    twin,
                    "symlink" if os.path.realpath(path) == os.path.realpath(twin) else "hard link",
                )
            )
        elif st.st_size:  # empty files are unreadable images, not copies
            candidates[path] = st.st_size
    shared = set(candidates.values()) & {st.st_size for st in test_stats.values()}
    by_content: dict[
        tuple[int, bytes | None], str
    ] = {}  # (size, hash) -> the first test file with them
    for path, st in test_stats.items():
        if st.st_size in shared:
            by_content.setdefault((st.st_size, digest(path)), path)
    read = sum(st.st_size in shared for st in test_stats.values())
    for path, size in candidates.items():
        if size in shared:
            read += 1
            twin = by_content.get((size, digest(path) or b""))
            if twin is not None:
                pairs.append((path, twin, "same bytes"))
    return Overlap(pairs, len(test_stats) + len(train_stats), read)


def _split_paths(cfg: CfgNode, key: str) -> list[str]:
    split_dir = sources.folder_split_dir(cfg[key].DATASET, cfg[key].SPLIT, key)
    samples = images.list_split(split_dir, sources.folder_classes(split_dir)).samples()
    kept = (
        datasets.holdout_indices(np.asarray([label for _, label in samples]), cfg.TRAIN.VAL_SPLIT)[
            0
        ]
        if (key == "TRAIN" and cfg.TRAIN.VAL_SPLIT)
        else range(len(samples))
    )  # TRAIN: only what is trained on
    return [samples[i][0] for i in kept]


def overlap_message(cfg: CfgNode, found: Overlap) -> str:
    """One line: how many training images are evaluation images, how,
    the first pairs, the way out."""
    kinds = {
        how: sum(1 for *_, h in found.pairs if h == how)
        for how in ("hard link", "symlink", "same bytes")
    }
    counts = ", ".join(f"{n} {how}" for how, n in kinds.items() if n)
    base = os.path.commonpath(
        [os.path.abspath(os.path.join(cfg[k].DATASET, cfg[k].SPLIT)) for k in ("TRAIN", "TEST")]
    )
    shown = "; ".join(
        f"{os.path.relpath(os.path.abspath(a), base)} is "
        f"{os.path.relpath(os.path.abspath(b), base)} "
        f"({how})"
        for a, b, how in found.pairs[:NAMED]
    )
    return (
        f"{len(found.pairs)} image(s) of TRAIN.DATASET are also in TEST.DATASET ({counts}), under "
        f"{base}: "
        f"{shown}{_more(found.pairs)}. {_overstates(cfg, 'remove them from one split')}"
    )


def _overstates(cfg: CfgNode, fix: str) -> str:
    return (
        f"Evaluating on images trained on overstates accuracy: {fix} (TRAIN.OVERLAP "
        f"{cfg.TRAIN.OVERLAP}; "
        "'error' refuses such a run, 'off' skips this check)"
    )


def check_overlap(cfg: CfgNode, is_main: bool) -> None:
    """TRAIN.OVERLAP: rank 0 compares the training and evaluation
    folders and every rank gets the verdict (one broadcast: call it on
    every rank); 'warn' logs it on rank 0, 'error' is a UserError on
    every rank. TEST naming the training split itself, nothing held out:
    every rank counts its images. Not two image folders (or OVERLAP
    off): nothing to compare."""
    t, test = cfg.TRAIN, cfg.TEST
    if (
        t.OVERLAP == "off"
        or cfg.MODEL.DUMMY_INPUT
        or (t.VAL_SPLIT and (test.DATASET, test.SPLIT) == (t.DATASET, t.SPLIT))
    ):
        return  # (TRAIN.VAL_SPLIT's part is held out of the training split: no overlap)
    if (test.DATASET, test.SPLIT) == (t.DATASET, t.SPLIT):
        count = _scan(cfg, "TEST")[1]
        text = (
            f"TEST.DATASET {test.DATASET!r}, split {test.SPLIT!r}, is the training split itself "
            "and TRAIN.VAL_SPLIT "
            f"holds nothing out: all {count} evaluation images are training images. "
            + _overstates(
                cfg,
                "evaluate on a split of its own (TEST.SPLIT val) or hold a part out "
                "(TRAIN.VAL_SPLIT 0.1)",
            )
        )
    elif (
        sources.source_kind(t.DATASET) != "folder" or sources.source_kind(test.DATASET) != "folder"
    ):
        return
    else:
        from distribuuuu.launch import (
            comm,
        )  # torch.distributed: only once there is something to compare

        verdict: Any = None
        if is_main:
            found = find(_split_paths(cfg, "TRAIN"), _split_paths(cfg, "TEST"))
            verdict = (len(found.pairs), overlap_message(cfg, found)) if found.pairs else (0, "")
        count, text = comm.broadcast_object(verdict)
    if count and t.OVERLAP == "error":
        raise UserError(text)
    if count and is_main:
        logging.getLogger("distribuuuu").warning(text)

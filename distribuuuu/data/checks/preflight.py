"""The preflight of TRAIN.DATASET / TEST.DATASET: what would make a run
fail, refused before any process group starts, each as a UserError
(exit 2) naming what is wrong.

``check_datasets`` runs on every rank on the same config and files, so
a bad path ends every rank with exit 2 instead of one rank failing while
the others wait in a collective. Image folders are listed whole, in the
walk the datasets use: a symlink loop, a class folder without images, a
class with no image that decodes (files are opened until one does), the
same real file listed twice (duplicates.py). The training set must have
two classes at least and hold one optimizer step, the part
TRAIN.VAL_SPLIT holds out must leave every class a training image, and
the TEST data's label i must be the training class i.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
from torchvision.datasets.folder import IMG_EXTENSIONS
from yacs.config import CfgNode

from distribuuuu.data import holdout, sources
from distribuuuu.data.checks.duplicates import require_no_duplicates
from distribuuuu.data.decoding.cpu import can_decode
from distribuuuu.data.loading import balance
from distribuuuu.data.shards import index, plan
from distribuuuu.data.sources import cifar, folder, labels, registry
from distribuuuu.errors import UserError

NAMED = folder.NAMED  # how many offenders a message names
SMALL_EVAL_SET = 50  # fewer images scored than this: a line on how little top-1 can tell


def check_datasets(cfg: CfgNode, world_size: int, train: bool = True) -> list[str]:
    """Raise UserError when the data of cfg cannot work; train=False
    checks TEST only (eval). Returns the notes for rank 0's setup lines
    (an evaluation set too small to tell models apart)."""
    if cfg.MODEL.DUMMY_INPUT:
        return []  # random tensors: nothing on disk to check
    from distribuuuu.data.loading import pipeline_class

    classes, counts = {}, {}
    for key in ("TRAIN", "TEST") if train else ("TEST",):
        pipeline_class(cfg, key)  # a TRAIN.DATA_PIPELINE that cannot read it is refused
        classes[key], n, counts[key] = scan(cfg, key)
        _require_class_count(cfg, key, len(classes[key]))
        if key == "TRAIN":
            train_n, kept = _training_samples(cfg, n, counts[key], world_size)
    if train:  # after TEST's checks: a wrong path or layout is the first thing to hear about
        _require_two_classes(cfg, classes["TRAIN"])
        _require_one_step(cfg, train_n, kept, world_size)
        if counts["TRAIN"] is None:  # a shard set (no per-class counts)
            _require_no_empty_step(cfg, train_n, world_size)
        _require_same_labels(cfg, classes["TRAIN"], classes["TEST"])
    if cfg.TRAIN.VAL_SPLIT or n < SMALL_EVAL_SET:
        return small_eval_set(cfg, counts, n, train)
    return []


def scan(cfg: CfgNode, key: str) -> tuple[list[str], int, dict[str, int] | None]:
    """(class names in label order, number of samples, {class: samples};
    None for a shard set) of cfg[key].DATASET, with the source's own
    checks."""
    group, kind = cfg[key], sources.kind_of(cfg, key)
    if kind in (*sources.IMAGE_FILES, "cifar", "shards"):
        sources.require_image_chans(cfg, key)
    if kind in sources.IMAGE_FILES:
        counts = _scan_folder(cfg, key) if kind == "folder" else _scan_files(cfg, key)
        return list(counts), sum(counts.values()), counts
    if kind == "shards":
        t = cfg.TRAIN
        shard_set = index.load_shard_set(
            group.DATASET, group.SPLIT, key, t.IMAGE_FIELD, t.LABEL_FIELD
        )
        if key == "TRAIN" and cfg.TRAIN.CLASS_BALANCE != "none":
            raise UserError(balance.SHARDS_REFUSAL.format(mode=cfg.TRAIN.CLASS_BALANCE))
        return list(shard_set.classes), shard_set.num_samples, None
    if kind == "cifar":
        root, variant = cifar.find_cifar(group.DATASET)
        _, targets, names = cifar.load_cifar(root, variant, group.SPLIT, key)
    else:
        data = registry.build_source(cfg, key)
        sources.tensor_source(cfg, key, data)  # the channel checks of a TensorSource
        targets, names = data.targets, data.classes
    labels, sizes = np.unique(np.asarray(targets), return_counts=True)
    names = [str(c) for c in names]
    counts = {(names[k] if k < len(names) else str(k)): int(n) for k, n in zip(labels, sizes)}
    return names, len(targets), counts


def _scan_folder(cfg: CfgNode, key: str) -> dict[str, int]:
    """{class: number of images} of a folder split, after refusing what
    cannot work."""
    split_dir, classes = sources.split_classes(cfg, key)
    if not classes:
        example = os.path.join(split_dir, "cat", "0001.jpg")
        raise UserError(
            f"{key}.DATASET: {split_dir} holds no class folders; expected {folder.LAYOUT} "
            f"(e.g. {example})"
        )
    listing = folder.require_no_loop(folder.list_split(split_dir, classes), key)
    if cfg.TRAIN.DUPLICATE_IMAGES == "fail":
        require_no_duplicates(listing, key)
    counts = {c: listing.count(c) for c in classes if os.path.isdir(os.path.join(split_dir, c))}
    empty = [c for c, n in counts.items() if n == 0]
    if empty:
        named = ", ".join(_with_skipped(c, listing.skipped.get(c)) for c in empty[:NAMED])
        fix = "put images in them or remove them"
        if any(listing.skipped.get(c) for c in empty):
            read = ", ".join(sorted(IMG_EXTENSIONS))
            fix = f"convert them (the extensions read: {read}) or remove the folders"
        raise UserError(
            f"{key}.DATASET: {len(empty)} class folder(s) in {split_dir} hold no file read as an "
            f"image ({named}{_more(empty)}); {fix}"
        )
    dead = [
        f"{c} ({n} files; {why})"
        for c, n in counts.items()
        if (why := _none_decodes(listing.files(c)))
    ]
    if dead:
        raise UserError(
            f"{key}.DATASET: every image file of {len(dead)} class folder(s) in {split_dir} is "
            f"unreadable: {'; '.join(dead[:NAMED])}{_more(dead)}. Replace them with images that "
            "open, or remove the class folder(s)"
        )
    if key == "TEST":
        _require_eval_resize(cfg, "val images are")
    return counts


def _scan_files(cfg: CfgNode, key: str) -> dict[str, int]:
    """{class: number of images} of label files or a Hugging Face
    dataset, after refusing what cannot work (the readers refuse missing
    files and features, empty labels and two labels for one file): a
    class of which no image decodes, a file listed twice (unless
    TRAIN.DUPLICATE_IMAGES keep)."""
    files = sources.image_files(cfg, key)
    if not len(files):
        raise UserError(f"{key}.DATASET: {files.root} lists no image of split {cfg[key].SPLIT!r}")
    by_class: dict[int, list[int]] = {}
    for i, label in enumerate(files.targets):
        by_class.setdefault(label, []).append(i)
    dead = [
        f"{files.classes[c]} ({len(items)} images; {why})"
        for c, items in sorted(by_class.items())
        if (why := _none_decodes(items, files.read, files.name))
    ]
    if dead:
        raise UserError(
            f"{key}.DATASET: every image of {len(dead)} class(es) of {files.root} is unreadable: "
            f"{'; '.join(dead[:NAMED])}{_more(dead)}. Replace them with images that open, or "
            "remove their rows"
        )
    twice = [p for p, n in Counter(files.paths or []).items() if n > 1]
    if twice and cfg.TRAIN.DUPLICATE_IMAGES == "fail":
        raise UserError(
            f"{key}.DATASET: {len(twice)} image(s) are listed twice in {files.root} "
            f"({', '.join(twice[:NAMED])}{_more(twice)}); remove the extra rows, or set "
            "TRAIN.DUPLICATE_IMAGES keep to train on every listed copy (oversampling)"
        )
    if key == "TEST":
        _require_eval_resize(cfg, "val images are")
    return {files.classes[c]: len(items) for c, items in sorted(by_class.items())}


def _with_skipped(name: str, skipped: dict[str, int] | None) -> str:
    """'birds: 20 files with an extension not read here (.gif)' (a class
    whose files are all of extensions not read), else the name."""
    if not skipped:
        return name
    by_count = sorted(skipped.items(), key=lambda item: (-item[1], item[0]))
    found = ", ".join(f"{n} {ext}" for ext, n in by_count)
    if len(skipped) == 1:
        found = by_count[0][0]
    return f"{name}: {sum(skipped.values())} files with an extension not read here ({found})"


def _more(named: list) -> str:
    return f" (and {len(named) - NAMED} more)" if len(named) > NAMED else ""


def _read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _none_decodes(
    items: list, read: Callable[[Any], bytes] = _read_file, name: Callable[[Any], str] = str
) -> str | None:
    """None when one of items (paths, or a reader's items) decodes
    (read in order until one does: one read for a good class), else why
    the first one did not (they would never be trained on, or
    evaluated)."""
    why = None
    for item in items:
        try:
            err = can_decode(read(item))
        except OSError as e:
            err = f"{type(e).__name__}: {e}"
        if err is None:
            return None
        why = why or f"{name(item)}: {err}"
    return why


def _require_eval_resize(cfg: CfgNode, what: str) -> None:
    if cfg.TEST.IM_SIZE < cfg.TRAIN.IM_SIZE:
        raise UserError(
            f"TEST.IM_SIZE ({cfg.TEST.IM_SIZE}) must be >= TRAIN.IM_SIZE ({cfg.TRAIN.IM_SIZE}): "
            f"{what} resized to TEST.IM_SIZE, then center-cropped to TRAIN.IM_SIZE"
        )


def _require_same_labels(cfg: CfgNode, train: list[str], test: list[str]) -> None:
    """The model's label i is the training data's class i. Two image
    folders, or two shard sets, match the TEST classes to it by name;
    other TEST data is read in its own numbering, which must then name
    the same class at each label."""
    kinds = {sources.kind_of(cfg, key) for key in ("TRAIN", "TEST")}
    by_name = kinds <= set(sources.IMAGE_FILES) or kinds == {"shards"}
    if by_name or test == train[: len(test)]:
        return
    i = next(i for i, (a, b) in enumerate(zip(train, test)) if a != b)
    raise UserError(
        f"TEST.DATASET {cfg.TEST.DATASET!r} numbers its classes otherwise than TRAIN.DATASET "
        f"{cfg.TRAIN.DATASET!r}: label {i} is {test[i]!r} there, {train[i]!r} in training, so "
        "every evaluation would count answers against other classes; evaluate on data whose "
        "label i is the training class i (two image folders, or two shard sets, are matched "
        "by class name)"
    )


def _require_class_count(cfg: CfgNode, key: str, n_classes: int) -> None:
    """The model has one output per training class: MODEL.NUM_CLASSES
    must be the TRAIN data's count, and the TEST data may hold no more
    classes than that."""
    num, dataset = cfg.MODEL.NUM_CLASSES, cfg[key].DATASET
    if n_classes == num or (key == "TEST" and n_classes < num):
        return
    fix = f"evaluate on data of at most {num} classes"
    if key == "TRAIN":
        fix = "leave MODEL.NUM_CLASSES unset (0) to follow the data"
    raise UserError(
        f"{key}.DATASET {dataset!r} has {n_classes} classes but MODEL.NUM_CLASSES is {num}; "
        f"{fix}, or set MODEL.NUM_CLASSES {n_classes}"
    )


def _require_two_classes(cfg: CfgNode, classes: list[str]) -> None:
    """A classifier of one class scores 100% by construction: the
    refusal names the folder or label file and what would be right."""
    if len(classes) >= 2:
        return
    t, kind = cfg.TRAIN, sources.kind_of(cfg, "TRAIN")
    need = "but a classifier needs 2 classes or more (its top-1 would be 100% by construction)"
    if kind == "folder" and classes:
        raise UserError(_one_class_folder(t.DATASET, t.SPLIT, classes[0], need))
    if kind == "labels" and classes:
        rows = f"every {t.SPLIT!r} row" if t.SPLIT else "every row"
        raise UserError(
            f"TRAIN.DATASET: {rows} of {labels.find(t.DATASET, t.SPLIT)} has the label "
            f"{classes[0]!r}, {need}; check that the label column is the one read "
            "(TRAIN.LABEL_FIELD names another), or add the rows of the other classes"
        )
    raise UserError(
        f"TRAIN.DATASET {t.DATASET!r} has {len(classes)} class, {need}; give it the data of "
        "two classes or more"
    )


def _one_class_folder(dataset: str, split: str, name: str, need: str) -> str:
    """The refusal of a split holding one class folder, name: when that
    folder holds class folders itself, TRAIN.DATASET is one level too
    high; else the others are missing (or still being copied)."""
    split_dir = os.path.normpath(os.path.join(dataset, split))
    inner = folder.folder_classes(os.path.join(split_dir, name))
    what = f"TRAIN.DATASET: {split_dir} holds one class folder, {name!r}, {need}"
    if len(inner) < 2:
        return (
            f"{what}; point TRAIN.DATASET at the folder that holds all the class folders, or "
            "add the other classes (are they still being copied?)"
        )
    shown = ", ".join(inner[:NAMED]) + (", ..." if len(inner) > NAMED else "")
    fix = f"set TRAIN.DATASET {os.path.join(split_dir, name)}"
    if split:
        fix = f"move them up into {split_dir}"
    return f"{what}; its {len(inner)} subfolders ({shown}) look like the classes: {fix}"


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
                "cannot give; shard a val split too (`distribuuuu data shard` writes one per "
                "folder) and set TEST.DATASET to it, with TRAIN.VAL_SPLIT 0"
            )
        if sources.kind_of(cfg, "TRAIN") in sources.IMAGE_FILES:
            _require_eval_resize(cfg, "the images TRAIN.VAL_SPLIT holds out are")
        held = holdout.check_holdout(counts, t.VAL_SPLIT)
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
    fix = f"set TRAIN.ACCUM_STEPS {per_rank} or less and TRAIN.BATCH_SIZE 1"
    if per_rank >= accum:
        fix = f"set TRAIN.BATCH_SIZE {per_rank // accum} or less"
    raise UserError(
        f"TRAIN.DATASET {cfg.TRAIN.DATASET!r} has {n} training samples{kept}, {per_rank} per "
        f"process, but one optimizer step takes TRAIN.BATCH_SIZE {batch} x {world_size} "
        f"process(es) x TRAIN.ACCUM_STEPS {accum} = {step}: an epoch would run no step; {fix}, "
        "or use more data"
    )


def _require_no_empty_step(cfg: CfgNode, n: int, world_size: int) -> None:
    """Shards run every sample in equal step counts (shards/plan.py):
    refuse a plan where a rank has an empty step."""
    batch, accum = cfg.TRAIN.BATCH_SIZE, cfg.TRAIN.ACCUM_STEPS
    if plan.smallest_train_batch(n, world_size, batch, accum) < 1:
        steps = plan.train_steps(n, world_size, batch, accum)
        raise UserError(
            f"TRAIN.DATASET {cfg.TRAIN.DATASET!r}: {n} samples over {world_size} process(es) in "
            f"{steps} steps (TRAIN.BATCH_SIZE {batch}, ACCUM_STEPS {accum}) would leave a step "
            "without a sample on some process; raise TRAIN.BATCH_SIZE to 2 or more, or lower "
            "TRAIN.ACCUM_STEPS"
        )


def small_eval_set(
    cfg: CfgNode, counts: dict[str, dict[str, int] | None], test_n: int, train: bool
) -> list[str]:
    """The note of an evaluation set under SMALL_EVAL_SET images: top-1
    on n images has a 95% interval of up to +-98/sqrt(n) points (1.96
    standard errors at 50%), so two runs' top-1 may differ by chance
    alone. Training validates on the part TRAIN.VAL_SPLIT holds out,
    else on TEST; eval scores that part when TEST is the training data,
    else TEST (test_n: its size)."""
    t, test, counts = cfg.TRAIN, cfg.TEST, counts["TRAIN" if train else "TEST"]
    same_split = (test.DATASET, test.SPLIT) == (t.DATASET, t.SPLIT)
    held_out = t.VAL_SPLIT and counts is not None and (train or same_split)
    n = holdout.check_holdout(counts, t.VAL_SPLIT) if held_out else test_n
    if n >= SMALL_EVAL_SET:
        return []
    what = "the part TRAIN.VAL_SPLIT holds out" if held_out else f"TEST.DATASET {test.DATASET}"
    bigger = 4 * SMALL_EVAL_SET
    return [
        f"evaluation set {n} images ({what}): each image moves top-1 by {100 / n:.1f} points and "
        f"its 95% interval is up to +-{98 / n**0.5:.0f} points; {bigger} images would make it "
        f"+-{98 / bigger**0.5:.0f}"
    ]

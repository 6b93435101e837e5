"""Defaults that follow the data: the config keys left "unset" get their
value here, once.

``resolve(cfg)`` is called by ``config.load_config`` (and again, a no-op
then, by ``api.run_command`` for a config built by hand), before any
process starts work that depends on these values; every rank computes
the same values from the same config and files. The result is an
ordinary config: the rest of the code never sees an unset value, and the
run folder's config.yaml and every checkpoint hold the values used. What
was decided, and from what, is kept with the config (``decisions``) and
logged once by rank 0 with the setup lines (``log_decisions``):

  MODEL.NUM_CLASSES 0    the training data's class count: class folders, CIFAR's meta, a shard set's
                         index, a registered source (its stated classes, else what it builds); 1000
                         for synthetic and dummy data, or when the data is not readable here (the
                         preflight then names the problem). A value set that differs: exit 2
                         (data/checks.py, naming both)
  TEST.DATASET ''        TRAIN.DATASET
  a folder of class      TRAIN.DATASET holding class folders but no TRAIN.SPLIT/ sub-folder: the
  folders                folder itself is the training split (TRAIN.SPLIT ''), and with TEST.DATASET
                         unset a stratified, seeded tenth of it is held out as the val set
                         (TRAIN.VAL_SPLIT 0.1; data/datasets.py)
  MODEL.ARCH, IN_CHANS,  a fine-tune's model card (MODEL.WEIGHTS), else a resumed run's own start values, then a
                         folder's images (data/image_sample.py):
  TRAIN.IM_SIZE and      resnet_tiny for 64 px or less on a CPU, else resnet18; 1 channel when most are gray; the
  the recipe (CROP_SCALE median side in [32, the model's default size]; smaller images: crop 0.8-1, no flip, their
  FLIP_PROB, MEAN/STD)   own mean/std, else ImageNet's recipe. Other data: the former resnet18, 3, 224, own recipe
  TEST.IM_SIZE 0         TRAIN.IM_SIZE / (TEST.CROP_PCT or 0.875), floored: 256 for 224, 36 for 32
  TRAIN.TOPK             clamped below MODEL.NUM_CLASSES (top-k of k classes is always 100%)
  TRAIN.WORKERS -1       this process's cores (CPU affinity / processes on this node) less one, at most 8;
                         a value set above both the cores and 8 is clamped to the larger (warned)
  NUM_THREADS 0          OMP_NUM_THREADS when set, else the cores free to this process (launch/comm.free_threads);
                         a value set above this process's cores is clamped to them (warned)
  OPTIM.WARMUP_EPOCHS    over half of OPTIM.MAX_EPOCH: the schedule's warmup is a fifth of the run
                         (optim.warmup_epochs, used by the LR schedule; the key keeps its value)
  IMPORTS                entries found only from this folder, as absolute paths
  TRAIN/TEST.DATASET     a path that exists here, as an absolute path (no line: config.yaml shows it)
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

from yacs.config import CfgNode

from distribuuuu.config.reading import TEST_FOLLOWED
from distribuuuu.errors import UserError

log = logging.getLogger("distribuuuu")

FALLBACK_CLASSES = (
    1000  # the former default (ImageNet's): synthetic and dummy data, unreadable data
)
EVAL_CROP_PCT = 0.875  # 224 / 256, Distribuuuu's (and torchvision's) eval resize
HOLDOUT_FRACTION = 0.1  # a folder of class folders: the share held out as the val set
MAX_AUTO_WORKERS = 8
# where the decisions live on the resolved CfgNode (an attribute, not a
# key)
_DECISIONS = "_inferred_decisions"


@dataclass(frozen=True)
class Decision:
    """One decided value: the key, the value, where it came from (e.g.
    "from the folder", "config")."""

    key: str
    value: Any
    origin: str
    warn: bool = False

    def line(self) -> str:
        return f"{self.key} {self.value} ({self.origin})"


def decisions(cfg: CfgNode) -> list[Decision]:
    """The decisions resolve() recorded on cfg ([] for a config it did
    not resolve)."""
    return list(cfg.__dict__.get(_DECISIONS, []))


def log_decisions(cfg: CfgNode) -> None:
    """One setup line per decided value (rank 0 calls it once)."""
    for decision in decisions(cfg):
        (log.warning if decision.warn else log.info)("setup: %s", decision.line())


def resolve(cfg: CfgNode, local_world_size: int | None = None) -> CfgNode:
    """A frozen copy of cfg with every unset key decided (module
    docstring), the decisions recorded on it. A config already resolved
    is returned as it is. Raises UserError where the data forbids a
    value."""
    if _DECISIONS in cfg.__dict__:
        return cfg
    out = cfg.clone()
    out.defrost()
    from distribuuuu.launch.launcher import detect  # light: reads the launcher's variables

    local_world_size = local_world_size or detect().local_world_size
    decided = (
        _followed(out) if TEST_FOLLOWED in out.__dict__ else []
    )  # a config file's TEST.DATASET dropped
    decided += _flat_folder(out) if _is_flat_folder(out) else []
    if out.TEST.DATASET == "":
        out.TEST.DATASET = out.TRAIN.DATASET
        split = out.TEST.SPLIT or "(itself)"
        decided.append(
            Decision("TEST.DATASET", out.TEST.DATASET, f"TRAIN.DATASET, split {split!r}")
        )
    decided += [
        *_num_classes(out),
        *_images(out),
        _eval_size(out),
        _workers(out, local_world_size),
        *_threads(out, local_world_size),
        *_warmup(out),
    ]
    decided += _absolute_imports(out)
    _absolute_datasets(out)  # last: the lines above name the data as the user wrote it
    out.freeze()
    out.__dict__[_DECISIONS] = tuple(decided)
    return out


def _kind(dataset: str) -> str:
    from distribuuuu.data import sources  # late: torch, only when a config is resolved

    return sources.source_kind(dataset)


def _class_dirs(path: str) -> list[str]:
    """The class folders of path (sources.folder_classes), [] when it is
    not a folder."""
    from distribuuuu.data import sources

    try:
        return sources.folder_classes(path)
    except OSError:
        return []


# ---------------------------------------------------------------------------------------------
# The data: a folder of class folders, MODEL.NUM_CLASSES
# ---------------------------------------------------------------------------------------------
def _is_flat_folder(cfg: CfgNode) -> bool:
    """TRAIN.DATASET a folder without a TRAIN.SPLIT/ sub-folder (maybe a
    folder of class folders)."""
    t = cfg.TRAIN
    return bool(
        not cfg.MODEL.DUMMY_INPUT
        and t.SPLIT
        and os.path.isdir(t.DATASET)
        and not os.path.isdir(os.path.join(t.DATASET, t.SPLIT))
    )


def _flat_folder(cfg: CfgNode) -> list[Decision]:
    """A folder of class folders: the folder is the training split, and,
    when no TEST.DATASET is given, a held-out part of it the val set."""
    t = cfg.TRAIN
    classes = _class_dirs(t.DATASET)
    if _kind(t.DATASET) != "folder" or not classes or {"train", "val", "test"} & set(classes):
        # a split layout with another split name, or no class folders:
        # the preflight says what it lacks
        return []
    decided = [
        Decision(
            "TRAIN.SPLIT",
            "''",
            f"from the folder: {t.DATASET} holds {len(classes)} class folders "
            f"and no {t.SPLIT}/, so it is the training split",
        )
    ]
    t.SPLIT = ""
    if cfg.TEST.DATASET == "":
        cfg.TEST.DATASET, cfg.TEST.SPLIT = t.DATASET, ""
        if not t.VAL_SPLIT:
            t.VAL_SPLIT = HOLDOUT_FRACTION
            decided.append(
                Decision("TRAIN.VAL_SPLIT", t.VAL_SPLIT, _holdout_origin(t.DATASET, classes))
            )
    return decided


def _followed(cfg: CfgNode) -> list[Decision]:
    """The line of a config file's TEST.DATASET that load_config dropped
    (config/reading.py: _test_follows_train)."""
    test, train = cfg.__dict__[TEST_FOLLOWED]
    return [
        Decision(
            "TEST.DATASET",
            "follows TRAIN.DATASET",
            f"the config file's {test!r} goes with its TRAIN.DATASET "
            f"{train!r}, which the command line replaced",
        )
    ]


def _holdout_origin(dataset: str, classes: list[str]) -> str:
    """The held-out part's counts, for the setup line (the loaders' own
    listing, which the preflight checks, decides)."""
    from distribuuuu.data import datasets, images

    try:
        listing = images.list_split(dataset, classes)
        counts = {c: listing.count(c) for c in classes}
        held = datasets.check_holdout(counts, HOLDOUT_FRACTION)
    except (UserError, OSError):
        return (
            "from the folder: no val/ folder, so a tenth of each class is held out as the val set"
        )
    return (
        f"from the folder: no val/ folder, so {held} of its {sum(counts.values())} images, a tenth "
        "of each "
        f"class, chosen by a fixed seed, are held out as the val set"
    )


def test_is_training_data(cfg: CfgNode) -> bool:
    """TEST names the TRAIN data itself (a folder of class folders): the
    held-out part is the only evaluation set, and there is no separate
    test set."""
    return (cfg.TEST.DATASET, cfg.TEST.SPLIT) == (cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT)


def train_classes(cfg: CfgNode) -> tuple[list[str] | None, str]:
    """(class names of the TRAIN data, where they were found), or (None,
    why not) when there is no class count to follow (synthetic, dummy
    input) or the data cannot be read here."""
    t = cfg.TRAIN
    if cfg.MODEL.DUMMY_INPUT or t.DATASET == "synthetic":
        return None, (
            "MODEL.DUMMY_INPUT has no classes"
            if cfg.MODEL.DUMMY_INPUT
            else "synthetic data makes MODEL.NUM_CLASSES classes"
        )
    kind = _kind(t.DATASET)
    if kind != "folder":
        return _source_classes(cfg, kind)
    classes = _class_dirs(os.path.join(t.DATASET, t.SPLIT))
    return (classes, "from the folder") if classes else (None, "TRAIN.DATASET is not readable here")


def _source_classes(cfg: CfgNode, kind: str) -> tuple[list[str] | None, str]:
    """train_classes of a TRAIN.DATASET that is not a folder: CIFAR, a
    shard set, a registered source."""
    from distribuuuu.data import datasets, sources
    from distribuuuu.data.shards.index import load_shard_set

    t = cfg.TRAIN
    try:
        if kind == "cifar":
            return datasets.cifar_classes(*sources.find_cifar(t.DATASET)), "from the CIFAR folder"
        if kind == "shards":
            return list(load_shard_set(t.DATASET, t.SPLIT, "TRAIN").classes), "from the shard index"
        source = sources.get_source(t.DATASET)
        if source.classes is not None:
            return list(source.classes), f"stated by the source {t.DATASET!r}"
        return list(sources.build_source(cfg, "TRAIN").classes), f"from the source {t.DATASET!r}"
    except (UserError, OSError):
        return None, "TRAIN.DATASET is not readable here"


def _num_classes(cfg: CfgNode) -> list[Decision]:
    """MODEL.NUM_CLASSES (train_classes, else FALLBACK_CLASSES), then
    TRAIN.TOPK clamped to it."""
    origin = "config"
    if not cfg.MODEL.NUM_CLASSES:
        classes, origin = train_classes(cfg)
        cfg.MODEL.NUM_CLASSES = len(classes) if classes else FALLBACK_CLASSES
        origin = origin if classes else f"{origin}: the former default"
    topk, origin_topk = (
        min(cfg.TRAIN.TOPK, max(1, cfg.MODEL.NUM_CLASSES - 1)),
        "config",
    )  # top-k of k classes: 100%
    if topk < cfg.TRAIN.TOPK:
        origin_topk, cfg.TRAIN.TOPK = (
            (
                f"clamped from {cfg.TRAIN.TOPK}: top-{cfg.TRAIN.TOPK} of {cfg.MODEL.NUM_CLASSES} "
                "classes would always be 100%, saying nothing"
            ),
            topk,
        )
    return [
        Decision("MODEL.NUM_CLASSES", cfg.MODEL.NUM_CLASSES, origin),
        Decision("TRAIN.TOPK", topk, origin_topk),
    ]


# ---------------------------------------------------------------------------------------------
# The images: MODEL.ARCH, MODEL.IN_CHANS, TRAIN.IM_SIZE and a folder's
# recipe
# ---------------------------------------------------------------------------------------------
def _images(cfg: CfgNode) -> list[Decision]:
    """The unset model and recipe keys (module docstring): the card of
    MODEL.WEIGHTS (a fine-tune, an eval), else the values the run in
    OUT_DIR started with (a resume), then a folder's images."""
    m, t, last = cfg.MODEL, cfg.TRAIN, os.path.join(cfg.OUT_DIR, "checkpoints", "last.pth")
    card = m.WEIGHTS and os.path.isfile(
        m.WEIGHTS
    )  # not OUT_DIR's run: an eval may write beside another one
    decided = (
        _from_card(cfg)
        if card
        else _as_started(cfg, last)
        if t.AUTO_RESUME and os.path.isfile(last)
        else []
    )
    if (
        m.ARCH != "auto"
        and m.IN_CHANS
        and t.IM_SIZE
        and t.CROP_SCALE
        and t.FLIP_PROB >= 0
        and t.MEAN
    ):
        return decided
    from distribuuuu.data import image_sample

    split = os.path.join(t.DATASET, t.SPLIT)
    files = image_sample.sample(split, _class_dirs(split)) if _kind(t.DATASET) == "folder" else []
    side, gray, seen = image_sample.looks(files)
    found = (
        image_sample.recipe(cfg, files, side, gray, seen)
        if side
        else image_sample.former_defaults(cfg)
    )
    return decided + [Decision(*d) for d in found]


UNSET = {
    "MODEL.ARCH": "auto",
    "MODEL.IN_CHANS": 0,
    "TRAIN.IM_SIZE": 0,
    "TRAIN.CROP_SCALE": [],
    "TRAIN.FLIP_PROB": -1.0,
    "TRAIN.MEAN": [],
    "TRAIN.STD": [],
}  # the keys _images decides, unset


def _as_started(cfg: CfgNode, path: str) -> list[Decision]:
    """A train that resumes: the UNSET keys take the values its run
    started with (the checkpoint's config), so that a folder changed
    since cannot change the recipe mid-run (the resume's data check
    names the change)."""
    from distribuuuu import weights
    from distribuuuu.run_folder.resume_check import flatten_yaml

    try:
        then = flatten_yaml(weights.peek_checkpoint(path).get("cfg") or "")
    except Exception:  # noqa: BLE001 - the resume itself says what is wrong with the file
        return []
    kept = [
        k
        for k, unset in UNSET.items()
        if cfg[k.split(".")[0]][k.split(".")[1]] == unset != then.get(k, unset)
    ]
    cfg.merge_from_list([word for k in kept for word in (k, then[k])])
    return [Decision(k, then[k], f"as the run started: {path}") for k in kept]


def _from_card(cfg: CfgNode) -> list[Decision]:
    """A fine-tune: the unset keys the card of MODEL.WEIGHTS fills (none
    for a state dict, safetensors)."""
    from distribuuuu import weights
    from distribuuuu.model_card import from_checkpoint

    try:
        card = from_checkpoint(weights.peek_checkpoint(cfg.MODEL.WEIGHTS))
    except Exception:  # noqa: BLE001 - not a checkpoint: loading the weights says what it is
        return []
    taken = card.fill_unset(cfg) if card is not None else []
    origin = f"the model card of {cfg.MODEL.WEIGHTS}"
    return [Decision(k, cfg[k.split(".")[0]][k.split(".")[1]], origin) for k in taken]


# ---------------------------------------------------------------------------------------------
# Evaluation size, loader workers, warmup, IMPORTS
# ---------------------------------------------------------------------------------------------
def _eval_size(cfg: CfgNode) -> Decision:
    size, pct = cfg.TRAIN.IM_SIZE, cfg.TEST.CROP_PCT
    origin = "config"
    if not cfg.TEST.IM_SIZE:
        cfg.TEST.IM_SIZE = int(math.floor(size / (pct or EVAL_CROP_PCT)))
        origin = f"follows TRAIN.IM_SIZE: {size} / {pct or EVAL_CROP_PCT:g}"
    if cfg.MODEL.DUMMY_INPUT or _kind(cfg.TEST.DATASET) not in ("folder", "shards"):
        return Decision(
            "eval size", f"{size} px", f"TRAIN.IM_SIZE; {cfg.TEST.DATASET} images are resized whole"
        )
    resize = int(math.floor(size / pct)) if pct else cfg.TEST.IM_SIZE
    return Decision(
        "eval size",
        f"resize to {resize}, center crop {size} px",
        f"TEST.CROP_PCT {pct:g}" if pct else f"TEST.IM_SIZE {cfg.TEST.IM_SIZE}, {origin}",
    )


def cores_per_process(local_world_size: int) -> int:
    """The CPU cores this process may use (its affinity), shared by the
    processes of this node."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))


def _workers(cfg: CfgNode, local_world_size: int) -> Decision:
    """TRAIN.WORKERS: -1 decided from the cores; a value set is kept up
    to this process's cores (torch's DataLoader warns beyond them) or
    MAX_AUTO_WORKERS (a few more may hide file latency on a small
    machine), else clamped: each loader would start that many processes
    (1,000 took 100 times as long)."""
    asked, cores = cfg.TRAIN.WORKERS, cores_per_process(1)
    if asked > max(cores, MAX_AUTO_WORKERS):
        cfg.TRAIN.WORKERS = max(cores, MAX_AUTO_WORKERS)
        return Decision(
            "TRAIN.WORKERS",
            cfg.TRAIN.WORKERS,
            f"clamped from {asked}: at most this process's {cores} cores, or {MAX_AUTO_WORKERS}",
            warn=True,
        )
    if asked >= 0:
        return Decision("TRAIN.WORKERS", asked, "config")
    cores = cores_per_process(local_world_size)
    cfg.TRAIN.WORKERS = min(MAX_AUTO_WORKERS, cores - 1)
    return Decision(
        "TRAIN.WORKERS",
        cfg.TRAIN.WORKERS,
        f"from the cores: {cores} per process for {local_world_size} "
        "process(es) here, one left to the process itself",
    )


def _threads(cfg: CfgNode, local_world_size: int) -> list[Decision]:
    """NUM_THREADS 0: OMP_NUM_THREADS, else comm.free_threads; above
    this process's cores: clamped to them."""
    asked, cores, omp = cfg.NUM_THREADS, cores_per_process(1), os.environ.get("OMP_NUM_THREADS", "")
    if 0 < asked <= cores:
        return []
    from distribuuuu.launch.comm import free_threads

    if asked:
        cfg.NUM_THREADS, why = cores, f"clamped from {asked}: this process may use {cores} cores"
    elif omp.isdigit() and int(omp) > 0:
        cfg.NUM_THREADS, why = (
            min(int(omp), cores),
            "OMP_NUM_THREADS (torchrun sets 1 for several processes)",
        )
    else:
        cfg.NUM_THREADS, why = free_threads(cores, local_world_size)
    return [Decision("NUM_THREADS", cfg.NUM_THREADS, why, warn=bool(asked))]


def _warmup(cfg: CfgNode) -> list[Decision]:
    """Only the line: the schedule shortens a warmup that does not fit
    (optim.warmup_epochs); the key keeps its value."""
    from distribuuuu.optim import warmup_epochs  # late: torch, only when a config is resolved

    short, o = warmup_epochs(cfg), cfg.OPTIM
    if short == o.WARMUP_EPOCHS:
        return []
    return [
        Decision(
            "OPTIM.WARMUP_EPOCHS",
            f"{short:g} in the schedule",
            f"shortened from {o.WARMUP_EPOCHS:g}: a "
            f"warmup over half of the {o.MAX_EPOCH}-epoch run would leave little of it at the peak "
            "LR",
            warn=True,
        )
    ]


def _absolute_imports(cfg: CfgNode) -> list[Decision]:
    """IMPORTS, and the file of a MODEL.ARCH registered with
    register_model, as absolute paths (_imports_as_paths): the config
    stored in the checkpoints then imports them from any folder."""
    models = sys.modules.get("distribuuuu.models")  # not imported: nothing was registered with it
    model_file = models.user_model_file(cfg.MODEL.ARCH) if models is not None else None
    return _imports_as_paths(cfg, model_file) if cfg.IMPORTS or model_file else []


def _absolute_datasets(cfg: CfgNode) -> None:
    """TRAIN.DATASET and TEST.DATASET that name a path here (not a
    registered source) as absolute paths: config.yaml and the
    checkpoints' cards then find the data, and its held-out part, from
    any folder."""
    for group in (cfg.TRAIN, cfg.TEST):  # (a shard set's brace pattern names no file itself)
        if (os.path.exists(group.DATASET) or "{" in group.DATASET) and _kind(group.DATASET) in (
            "folder",
            "cifar",
            "shards",
        ):
            group.DATASET = os.path.abspath(group.DATASET)


def _imports_as_paths(cfg: CfgNode, model_file: str | None) -> list[Decision]:
    """IMPORTS entries that only this folder finds (a .py path, or a
    module beside it) as absolute paths, and model_file added: eval,
    predict, export and load_model import them from any folder."""
    from distribuuuu.config.user_modules import is_path

    entries = []
    for entry in cfg.IMPORTS:
        if is_path(entry):
            entry = os.path.abspath(entry)
        elif "." not in entry and sys.modules.get(entry) is not None:
            file = getattr(sys.modules[entry], "__file__", None) or ""
            if (
                os.path.dirname(os.path.abspath(file)) == os.getcwd()
            ):  # found beside us, not on sys.path
                entry = os.path.abspath(file)
        entries.append(entry)
    if (
        model_file
        and model_file not in entries
        and not any(getattr(sys.modules.get(e), "__file__", None) == model_file for e in entries)
    ):
        entries.append(model_file)
    if entries == list(cfg.IMPORTS):
        return []
    cfg.IMPORTS = entries
    return [
        Decision(
            "IMPORTS",
            entries,
            "as absolute paths: eval, predict and export find them from any folder",
        )
    ]

"""Defaults that follow the data: the config keys left "unset" get their value here, once.

``resolve(cfg)`` is called by ``config.load_config`` (and again, a no-op then, by ``api.run_command``
for a config built by hand), before any process starts work that depends on these values; every
rank computes the same values from the same config and files. The result is an ordinary config: the
rest of the code never sees an unset value, and the run folder's config.yaml and every checkpoint
hold the values used. What was decided, and from what, is kept with the config (``facts``) and
logged once by rank 0 with the setup lines (``log_facts``):

  MODEL.NUM_CLASSES 0    the training data's class count: class folders, CIFAR's meta, a shard set's
                         index, a registered source (its stated classes, else what it builds); 1000
                         for synthetic and dummy data, or when the data is not readable here (the
                         preflight then names the problem). A value set that differs: exit 2
                         (data/check.py, naming both)
  TEST.DATASET ''        TRAIN.DATASET
  a folder of class      TRAIN.DATASET holding class folders but no TRAIN.SPLIT/ sub-folder: the
  folders                folder itself is the training split (TRAIN.SPLIT ''), and with TEST.DATASET
                         unset a stratified, seeded tenth of it is held out as the val set
                         (TRAIN.VAL_SPLIT 0.1; data/split.py)
  TEST.IM_SIZE 0         TRAIN.IM_SIZE / (TEST.CROP_PCT or 0.875), floored: 256 for 224, 36 for 32
  TRAIN.TOPK             clamped to MODEL.NUM_CLASSES
  TRAIN.WORKERS -1       this process's cores (CPU affinity / processes on this node) less one, at most 8
  OPTIM.WARMUP_EPOCHS    over half of OPTIM.MAX_EPOCH: the schedule's warmup is a fifth of the run
                         (warmup_epochs, used by optim.lr_factor; the key keeps its value)
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

from yacs.config import CfgNode

from distribuuuu.errors import UserError

log = logging.getLogger("distribuuuu")

FALLBACK_CLASSES = 1000  # the former default (ImageNet's): synthetic and dummy data, unreadable data
EVAL_CROP_PCT = 0.875  # 224 / 256, Distribuuuu's (and torchvision's) eval resize
HOLDOUT_FRACTION = 0.1  # a folder of class folders: the share held out as the val set
MAX_AUTO_WORKERS = 8
_FACTS = "_inferred_facts"  # where the facts live on the resolved CfgNode (an attribute, not a key)


@dataclass(frozen=True)
class Fact:
    """One decided value: the key, the value, where it came from (e.g. "from the folder", "config")."""

    key: str
    value: Any
    origin: str
    warn: bool = False

    def line(self) -> str:
        return f"{self.key} {self.value} ({self.origin})"


def facts(cfg: CfgNode) -> list[Fact]:
    """The facts resolve() recorded on cfg ([] for a config it did not resolve)."""
    return list(cfg.__dict__.get(_FACTS, []))


def log_facts(cfg: CfgNode) -> None:
    """One setup line per decided value (rank 0 calls it once)."""
    for fact in facts(cfg):
        (log.warning if fact.warn else log.info)("setup: %s", fact.line())


def resolve(cfg: CfgNode, local_world_size: int | None = None) -> CfgNode:
    """A frozen copy of cfg with every unset key decided (module docstring), the facts recorded on it.
    A config already resolved is returned as it is. Raises UserError where the data forbids a value."""
    if _FACTS in cfg.__dict__:
        return cfg
    out = cfg.clone()
    out.defrost()
    found: list[Fact] = []
    _flat_folder(out, found)
    _test_dataset(out, found)
    _num_classes(out, found)
    _eval_size(out, found)
    _workers(out, found, local_world_size)
    _warmup(out, found)
    _absolute_imports(out, found)
    out.freeze()
    out.__dict__[_FACTS] = tuple(found)
    return out


# ---------------------------------------------------------------------------------------------
# The data: a folder of class folders, TEST.DATASET, MODEL.NUM_CLASSES
# ---------------------------------------------------------------------------------------------
def _kind(dataset: str) -> str:
    from distribuuuu.data import sources  # late: torch, only when a config is resolved

    return sources.source_kind(dataset)


def _class_dirs(path: str) -> list[str]:
    """The visible sub-folders of path (sources.folder_classes' rule), [] when it is not a folder."""
    try:
        return sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))
    except OSError:
        return []


def _flat_folder(cfg: CfgNode, found: list[Fact]) -> None:
    """TRAIN.DATASET a folder of class folders without TRAIN.SPLIT/: the folder is the split, and,
    when no TEST.DATASET is given, a held-out part of it the val set."""
    t = cfg.TRAIN
    if cfg.MODEL.DUMMY_INPUT or not t.SPLIT or os.path.isdir(os.path.join(t.DATASET, t.SPLIT)):
        return
    if not os.path.isdir(t.DATASET) or _kind(t.DATASET) != "folder":
        return
    classes = _class_dirs(t.DATASET)
    if not classes or {"train", "val", "test"} & set(classes):
        return  # a split layout with another split name, or no class folders: the preflight says what it lacks
    found.append(Fact("TRAIN.SPLIT", "''", f"from the folder: {t.DATASET} holds {len(classes)} class folders and no "
                                           f"{t.SPLIT}/, so it is the training split"))
    t.SPLIT = ""
    if cfg.TEST.DATASET == "":
        cfg.TEST.DATASET, cfg.TEST.SPLIT = t.DATASET, ""
        if not t.VAL_SPLIT:
            t.VAL_SPLIT = HOLDOUT_FRACTION
            found.append(Fact("TRAIN.VAL_SPLIT", t.VAL_SPLIT, _holdout_origin(t.DATASET, classes)))


def _holdout_origin(dataset: str, classes: list[str]) -> str:
    """The held-out part's counts, for the setup line (a listing by extension; the loaders' own
    listing, which the preflight checks, decides)."""
    from distribuuuu.data import integrity, split

    try:
        listing = integrity.list_split(dataset, classes)
        counts = {c: listing.count(c) for c in classes}
        held = split.check_holdout(counts, HOLDOUT_FRACTION)
    except (UserError, OSError):
        return "from the folder: no val/ folder, so a tenth of each class is held out as the val set"
    return (f"from the folder: no val/ folder, so {held} of its {sum(counts.values())} images, a tenth of each "
            f"class, chosen by a fixed seed, are held out as the val set")


def test_is_training_data(cfg: CfgNode) -> bool:
    """TEST names the TRAIN data itself (a folder of class folders): the held-out part is the only
    evaluation set, and there is no separate test set."""
    return (cfg.TEST.DATASET, cfg.TEST.SPLIT) == (cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT)


def _test_dataset(cfg: CfgNode, found: list[Fact]) -> None:
    if cfg.TEST.DATASET == "":
        cfg.TEST.DATASET = cfg.TRAIN.DATASET
        found.append(Fact("TEST.DATASET", cfg.TEST.DATASET, f"TRAIN.DATASET, split {cfg.TEST.SPLIT or '(itself)'!r}"))


def train_classes(cfg: CfgNode) -> tuple[list[str] | None, str]:
    """(class names of the TRAIN data, where they were found), or (None, why not) when there is no
    class count to follow (synthetic, dummy input) or the data cannot be read here."""
    t = cfg.TRAIN
    if cfg.MODEL.DUMMY_INPUT:
        return None, "MODEL.DUMMY_INPUT has no classes"
    if t.DATASET == "synthetic":
        return None, "synthetic data makes MODEL.NUM_CLASSES classes"
    from distribuuuu.data import registry, sources
    from distribuuuu.data.shards.index import load_shard_set

    kind = sources.source_kind(t.DATASET)
    try:
        if kind == "folder":
            classes = _class_dirs(os.path.join(t.DATASET, t.SPLIT))
            return (classes, "from the folder") if classes else (None, "TRAIN.DATASET is not readable here")
        if kind == "cifar":
            return sources.cifar_classes(*sources.find_cifar(t.DATASET)), "from the CIFAR folder"
        if kind == "shards":
            return list(load_shard_set(t.DATASET, t.SPLIT, "TRAIN").classes), "from the shard index"
        source = registry.get_source(t.DATASET)
        if source is not None and source.classes is not None:
            return list(source.classes), f"stated by the source {t.DATASET!r}"
        return list(registry.build_source(cfg, "TRAIN").classes), f"from the source {t.DATASET!r}"
    except (UserError, OSError):
        return None, "TRAIN.DATASET is not readable here"


def _num_classes(cfg: CfgNode, found: list[Fact]) -> None:
    if cfg.MODEL.NUM_CLASSES:
        found.append(Fact("MODEL.NUM_CLASSES", cfg.MODEL.NUM_CLASSES, "config"))
    else:
        classes, origin = train_classes(cfg)
        if classes:
            cfg.MODEL.NUM_CLASSES = len(classes)
        else:
            cfg.MODEL.NUM_CLASSES = FALLBACK_CLASSES
            origin = f"{origin}: the former default"
        found.append(Fact("MODEL.NUM_CLASSES", cfg.MODEL.NUM_CLASSES, origin))
    if cfg.TRAIN.TOPK > cfg.MODEL.NUM_CLASSES:
        found.append(Fact("TRAIN.TOPK", cfg.MODEL.NUM_CLASSES, f"clamped from {cfg.TRAIN.TOPK} to MODEL.NUM_CLASSES"))
        cfg.TRAIN.TOPK = cfg.MODEL.NUM_CLASSES
    else:
        found.append(Fact("TRAIN.TOPK", cfg.TRAIN.TOPK, "config"))


# ---------------------------------------------------------------------------------------------
# Evaluation size, loader workers, warmup
# ---------------------------------------------------------------------------------------------
def _eval_size(cfg: CfgNode, found: list[Fact]) -> None:
    size, pct = cfg.TRAIN.IM_SIZE, cfg.TEST.CROP_PCT
    if cfg.TEST.IM_SIZE:
        origin = "config"
    else:
        cfg.TEST.IM_SIZE = int(math.floor(size / (pct or EVAL_CROP_PCT)))
        origin = f"follows TRAIN.IM_SIZE: {size} / {pct or EVAL_CROP_PCT:g}"
    if cfg.MODEL.DUMMY_INPUT or _kind(cfg.TEST.DATASET) not in ("folder", "shards"):
        found.append(Fact("eval size", f"{size} px", f"TRAIN.IM_SIZE; {cfg.TEST.DATASET} images are resized whole"))
        return
    resize = int(math.floor(size / pct)) if pct else cfg.TEST.IM_SIZE
    via = f"TEST.CROP_PCT {pct:g}" if pct else f"TEST.IM_SIZE {cfg.TEST.IM_SIZE}, {origin}"
    found.append(Fact("eval size", f"resize to {resize}, center crop {size} px", via))


def cores_per_process(local_world_size: int) -> int:
    """The CPU cores this process may use (its affinity), shared by the processes of this node."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))


def _workers(cfg: CfgNode, found: list[Fact], local_world_size: int | None) -> None:
    if cfg.TRAIN.WORKERS >= 0:
        found.append(Fact("TRAIN.WORKERS", cfg.TRAIN.WORKERS, "config"))
        return
    if local_world_size is None:
        from distribuuuu.launch.launcher import detect  # light: reads the launcher's variables

        local_world_size = detect().local_world_size
    cores = cores_per_process(local_world_size)
    cfg.TRAIN.WORKERS = min(MAX_AUTO_WORKERS, cores - 1)
    found.append(Fact("TRAIN.WORKERS", cfg.TRAIN.WORKERS,
                      f"from the cores: {cores} per process for {local_world_size} process(es) here, one left "
                      "to the process itself"))


WARMUP_MAX_SHARE = 0.5  # a warmup longer than this share of the run does not fit ...
WARMUP_SHORT_SHARE = 0.2  # ... and is shortened to this share of it


def warmup_epochs(cfg: CfgNode) -> float:
    """The warmup the schedule runs: OPTIM.WARMUP_EPOCHS, or a fifth of the run when that is over half
    of OPTIM.MAX_EPOCH (5 warmup epochs of a 3-epoch run never reached the printed peak LR). Computed
    where used, not written into the config: a run resumed with a longer OPTIM.MAX_EPOCH (a safe key:
    the schedule follows it, its decay too) is not refused for a changed OPTIM.WARMUP_EPOCHS."""
    o = cfg.OPTIM
    if o.WARMUP_EPOCHS <= WARMUP_MAX_SHARE * o.MAX_EPOCH:
        return float(o.WARMUP_EPOCHS)
    return round(WARMUP_SHORT_SHARE * o.MAX_EPOCH, 4)


def _warmup(cfg: CfgNode, found: list[Fact]) -> None:
    """Only the line: the schedule shortens a warmup that does not fit (warmup_epochs, optim.lr_factor); the key
    keeps its value."""
    short, o = warmup_epochs(cfg), cfg.OPTIM
    if short != o.WARMUP_EPOCHS:
        found.append(Fact("OPTIM.WARMUP_EPOCHS", f"{short:g} in the schedule", f"shortened from {o.WARMUP_EPOCHS:g}: "
                          f"a warmup over half of the {o.MAX_EPOCH}-epoch run would leave little of it at the peak LR",
                          warn=True))


def _absolute_imports(cfg: CfgNode, found: list[Fact]) -> None:
    """IMPORTS entries that only this folder finds (a .py path, or a module beside it) as absolute
    paths, and the file of a MODEL.ARCH registered with register_model added: the config stored in
    the checkpoints then imports them from any folder (eval, predict, export, load_model)."""
    import sys

    from distribuuuu.config.user_modules import is_path

    entries = []
    for entry in cfg.IMPORTS:
        if is_path(entry):
            entry = os.path.abspath(entry)
        elif "." not in entry and sys.modules.get(entry) is not None:
            file = getattr(sys.modules[entry], "__file__", None) or ""
            if os.path.dirname(os.path.abspath(file)) == os.getcwd():  # found beside us, not on sys.path
                entry = os.path.abspath(file)
        entries.append(entry)
    models = sys.modules.get("distribuuuu.models")  # not imported: nothing was registered with it
    model_file = models.user_model_file(cfg.MODEL.ARCH) if models is not None else None
    if model_file and model_file not in entries and not any(
            getattr(sys.modules.get(e), "__file__", None) == model_file for e in entries):
        entries.append(model_file)
    if entries != list(cfg.IMPORTS):
        cfg.IMPORTS = entries
        found.append(Fact("IMPORTS", entries, "as absolute paths: eval, predict and export find them from any folder"))

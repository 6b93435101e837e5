"""Using a trained model from its checkpoint alone: the config it was
trained with, its model card (class names and preprocessing,
model_card.py) and the model itself, ready for inference.

The one path from a checkpoint to a model, for eval, predict, export,
calibrate and ``api.load_model``:
  chosen_weights  the file: MODEL.WEIGHTS, else OUT_DIR's chosen
                  checkpoint (run_folder.best_or_last); eval resolves
                  its weights here too (preflight, api.run_eval)
  prepared        predict's, export's and calibrate's (config, card):
                  load_config, chosen_weights, card_for
  build           (config, card) -> LoadedModel: the model on a device
                  in eval mode, its transform, classes
  load            ``api.load_model``: a checkpoint file -> its stored
                  config and card -> build

``eval``, ``predict`` and ``export`` without ``--cfg`` take the config
stored in the checkpoint that MODEL.WEIGHTS names (or OUT_DIR's chosen
one): the card's copy, else the checkpoint's ``cfg`` entry (every
distribuuuu checkpoint has one), else the config.yaml of the run folder
the file lies in; KEY VALUE overrides apply on top, and ``--cfg FILE``
replaces it all. OUT_DIR defaults to the checkpoint's run folder (the
folder above checkpoints/).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from yacs.config import CfgNode

from distribuuuu import config, inferred, models, run_folder, weights
from distribuuuu.config.reading import parse_literal
from distribuuuu.errors import UserError
from distribuuuu.model_card import ModelCard, describe, from_checkpoint
from distribuuuu.run_folder import BEST, CHECKPOINTS, LAST, best_path

log = logging.getLogger("distribuuuu")

EXPECTED = (
    f"a checkpoint written by `distribuuuu train` ({best_path('OUT_DIR')}, {LAST} or "
    "epoch_NNNN.pth)"
)
# Overrides of these keys change what the card says: it is then
# described from the config again.
DATA_KEYS = frozenset({"TRAIN.DATASET", "TRAIN.SPLIT"})  # the class names too
PREPROCESS_KEYS = frozenset(
    {
        "TRAIN.IM_SIZE",
        "TEST.IM_SIZE",
        "TEST.CROP_PCT",
        "TRAIN.MEAN",
        "TRAIN.STD",
        "TRAIN.INTERPOLATION",
        "MODEL.IN_CHANS",
    }
)

_last_read: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # one file: read once per command


def read(path: str, label: str = "checkpoint", remember: bool = False) -> dict[str, Any]:
    """The checkpoint's dict (weights.load_checkpoint: tensors only,
    digest verified); a file that is not a checkpoint is a UserError
    naming it and what was expected. remember: keep it for the next call
    on the same unchanged file (a command reads its config, then its
    card: one read)."""
    global _last_read
    if os.path.isdir(path):
        raise UserError(f"{label} {path} is a folder, not a file; expected {EXPECTED}")
    stat = os.stat(path) if os.path.isfile(path) else None
    key = (os.path.abspath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns) if stat else None
    if key is not None and _last_read is not None and _last_read[0] == key:
        return _last_read[1]
    try:
        obj = weights.load_checkpoint(path, label)
    except weights.DamagedCheckpoint:
        raise
    except weights.UnreadableCheckpoint as e:
        raise weights.UnreadableCheckpoint(f"{e}; expected {EXPECTED}") from None
    if not isinstance(obj, dict):
        raise UserError(
            f"{label} {path} holds a {type(obj).__name__}, not a checkpoint; expected {EXPECTED}"
        )
    if remember:
        _last_read = (key, obj)
    return obj


def run_folder_of(path: str) -> str:
    """OUT_DIR of a file OUT_DIR/checkpoints/NAME.pth; else the file's
    own folder."""
    folder = os.path.normpath(os.path.dirname(path) or ".")
    if os.path.basename(folder) == CHECKPOINTS:
        return os.path.dirname(folder) or "."
    return folder


def stored_config(ckpt: dict[str, Any], path: str) -> tuple[str, str] | None:
    """(YAML text, where it was found) of the run's config, or None when
    there is none."""
    card = from_checkpoint(ckpt)
    if card is not None and card.config:
        return card.config, f"the model card of {path}"
    if isinstance(ckpt.get("cfg"), str):
        return ckpt["cfg"], path
    beside = os.path.join(run_folder_of(path), "config.yaml")
    if os.path.isfile(beside):
        log.info(
            "%s holds no config: using %s, the config of the run folder it lies in", path, beside
        )
        with open(beside, encoding="utf-8") as f:
            return f.read(), beside
    return None


def config_from_text(text: str, source: str, opts: list[str]) -> CfgNode:
    """Defaults, then the stored YAML (keys added since keep their
    default), then opts; validated, frozen."""
    cfg = config.get_defaults()
    # checked as a --cfg file is: yacs's own merge would refuse a
    # MODEL.PRETRAINED path over False
    try:
        config.merge_text(cfg, text, f"the config stored in {source}")
    except UserError as e:
        raise UserError(
            f"the config stored in {source} does not fit this version of distribuuuu ({e}); give "
            "the run's config with --cfg FILE"
        ) from None
    config.merge_opts(cfg, opts)
    config.validate(cfg)
    cfg.freeze()
    _require_imported_files(cfg, source)
    config.import_user_modules(
        cfg.IMPORTS
    )  # a model registered by the user's module is found by name
    return inferred.resolve(cfg)  # a stored config is resolved already: only what opts left unset


def _require_imported_files(cfg: CfgNode, source: str) -> None:
    """The run imported its own .py files (IMPORTS, stored as absolute
    paths: a registered model or dataset source): one that is gone is a
    UserError saying so, before anything else is tried."""
    from distribuuuu.config.user_modules import is_path

    gone = [e for e in cfg.IMPORTS if is_path(e) and not os.path.isfile(e)]
    if gone:
        raise UserError(
            f"{source}: the run imported {gone[0]} (IMPORTS; it registers code the model or data "
            f"need, e.g. MODEL.ARCH {cfg.MODEL.ARCH!r}), and that file is gone; put it back there, "
            "or name the module that registers it with --import FILE (replacing IMPORTS)"
        )


def weights_in(opts: list[str]) -> str | None:
    """The checkpoint the overrides name: MODEL.WEIGHTS, else OUT_DIR's
    chosen one."""
    pairs = dict(zip(opts[0::2], opts[1::2]))
    if pairs.get("MODEL.WEIGHTS"):
        return str(parse_literal(pairs["MODEL.WEIGHTS"]))
    if pairs.get("OUT_DIR"):
        return run_folder.best_or_last(str(parse_literal(pairs["OUT_DIR"])))
    return None


def require_weights_file(weights: str) -> None:
    """MODEL.WEIGHTS names a file (eval, predict, export, and train's
    starting weights): a folder or a missing path is a UserError saying
    which."""
    if os.path.isdir(weights):  # a run folder, most likely: name its file
        found = run_folder.checkpoint_in(weights)
        hint = f"e.g. {found}"
        if found is None:
            hint = f"it holds no {BEST} or {LAST}, nor a {CHECKPOINTS}/ folder with one"
        raise UserError(f"MODEL.WEIGHTS {weights!r} is a folder; give a checkpoint file ({hint})")
    if not os.path.isfile(weights):
        raise UserError(
            f"MODEL.WEIGHTS {weights!r} does not exist; give the path of a checkpoint (e.g. "
            f"{best_path('OUT_DIR')}) or of a weights file"
        )


def chosen_weights(cfg: CfgNode, command: str) -> CfgNode:
    """cfg with MODEL.WEIGHTS naming an existing file: as given, else
    OUT_DIR's chosen checkpoint (run_folder.best_or_last). Missing
    weights are a UserError saying how to name them; command ("eval",
    "predict", "export") names who needs them."""
    if cfg.MODEL.WEIGHTS:
        require_weights_file(cfg.MODEL.WEIGHTS)
        return cfg
    chosen = run_folder.best_or_last(cfg.OUT_DIR)
    if chosen is None:
        needs = (
            "a checkpoint" if command == "eval" else "trained weights"
        )  # predict and export take safetensors
        example = f"distribuuuu {command} --checkpoint {best_path('runs/demo')}"
        example += " photo.png" if command == "predict" else ""
        raise UserError(
            f"{command} needs {needs}: give --checkpoint PATH (or MODEL.WEIGHTS PATH), e.g. "
            f"`{example}`, or the OUT_DIR of a run ({os.path.join(cfg.OUT_DIR, CHECKPOINTS)} holds "
            f"no {BEST} or {LAST})"
        )
    cfg = cfg.clone()
    cfg.defrost()
    cfg.MODEL.WEIGHTS = chosen
    cfg.freeze()
    return cfg


def require_model_classes(cfg: CfgNode) -> None:
    """eval of a folder of class folders: every class folder is one of
    the model's classes (its card's; some of them is fine), else a
    UserError naming the others. The labels follow the training folder
    when it is here, else the folder's own order: then some of the
    classes must be the model's first ones, or the labels would shift."""
    from distribuuuu.data import sources
    from distribuuuu.data.sources.folder import folder_classes
    from distribuuuu.data.sources.labels import SUFFIXES
    from distribuuuu.inferred.data import SPLIT_NAMES

    split_dir = os.path.normpath(os.path.join(cfg.TEST.DATASET, cfg.TEST.SPLIT))
    if sources.kind_of(cfg, "TEST") != "folder" or not os.path.isdir(split_dir):
        return  # not a folder, or the preflight says what is missing
    card = file_card(cfg.MODEL.WEIGHTS)
    if card is None or not card.classes:
        return
    model, found = list(card.classes), folder_classes(split_dir)
    unknown = [c for c in found if c not in model]
    if unknown:
        hint = ""
        if set(unknown) <= set(SPLIT_NAMES):
            hint = f" (a split layout: name the split, TEST.SPLIT {unknown[-1]})"
        listed = sorted(n for n in os.listdir(split_dir) if n.lower().endswith(SUFFIXES))
        if listed:
            label_file = os.path.join(split_dir, listed[0])
            hint = f" (images listed with labels: TEST.DATASET {label_file})"
        raise UserError(
            f"TEST.DATASET {split_dir} has class folders that are not classes of the model "
            f"({cfg.MODEL.WEIGHTS}: {_listed(model)}): {_listed(unknown)}{hint}; score a folder "
            "of the model's classes (some of them is fine)"
        )
    train_dir = os.path.join(cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT)
    if sources.kind_of(cfg, "TRAIN") == "folder" and os.path.isdir(train_dir):
        return  # the labels follow the training folder (sources.split_classes)
    if found != model[: len(found)]:
        raise UserError(
            f"TEST.DATASET {split_dir}'s labels would follow its own class folders "
            f"({_listed(found)}), not the model's classes ({_listed(model)}): only the training "
            f"folder numbers them the model's way, and TRAIN.DATASET {cfg.TRAIN.DATASET} is not "
            "one here; evaluate where it is, or on a folder of every class of the model"
        )


def _listed(names: list[str], shown: int = 5) -> str:
    """At most ``shown`` names, and how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def safetensors_card(path: str) -> ModelCard | None:
    """The card in the metadata of a safetensors file that `export`
    wrote (None for other files)."""
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            text = (f.metadata() or {}).get("model_card")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise UserError(f"MODEL.WEIGHTS {path} is not a readable safetensors file ({e})") from None
    return ModelCard.from_dict(json.loads(text)) if text else None


def file_card(path: str) -> ModelCard | None:
    """The model card of a checkpoint, or of a safetensors file from
    `export`; None when it has none."""
    if path.endswith(".safetensors"):
        return safetensors_card(path)
    return from_checkpoint(read(path, "MODEL.WEIGHTS", remember=True))


def load_config(cfg_file: str | None, opts: list[str]) -> CfgNode:
    """The config of eval, predict and export: --cfg FILE with opts as
    always; without --cfg, the config stored with the checkpoint that
    opts name (see the module docstring), else the defaults."""
    path = None if cfg_file else weights_in(opts)
    if path is None:
        return inferred.resolve(config.load_config(cfg_file, opts))
    require_weights_file(path)
    if path.endswith(".safetensors"):
        card = safetensors_card(path)
        found = (
            (card.config, f"the model card of {path}") if card is not None and card.config else None
        )
    else:
        found = stored_config(read(path, "MODEL.WEIGHTS", remember=True), path)
    if found is None:
        raise UserError(
            f"MODEL.WEIGHTS {path} holds no config (a bare state dict, and no config.yaml in "
            f"{run_folder_of(path)}): give the config it was trained with, --cfg FILE"
        )
    return config_from_text(
        found[0], found[1], ["OUT_DIR", run_folder_of(path), "MODEL.WEIGHTS", path, *opts]
    )


def card_from_config(cfg: CfgNode, classes: list[str] | None = None) -> ModelCard:
    """The card described from the config's data: the TRAIN folder's
    class names when it is here (else numbers), or the TEST data of a
    built-in / registered source (as predict always did)."""
    from distribuuuu.data import build_dataset, sources
    from distribuuuu.data.shards.index import load_shard_set
    from distribuuuu.data.sources.folder import folder_classes

    kind = sources.kind_of(cfg, "TRAIN")
    if kind == "shards" and classes is None:
        classes = load_shard_set(cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT, "TRAIN").classes
    if kind == "folder":
        train_dir = os.path.join(cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT)
        if classes is None and os.path.isdir(train_dir):
            classes = folder_classes(train_dir)
    if kind == "labels" and classes is None:
        try:
            classes = sources.image_files(cfg, "TRAIN").classes
        except (OSError, UserError):
            classes = None  # the label file is not here: numbers as names
    if kind in ("shards", *sources.IMAGE_FILES):
        return describe(cfg, None, classes)
    return describe(cfg, build_dataset(cfg, train=False), classes)


def prepared(cfg_file: str | None, opts: list[str], command: str) -> tuple[CfgNode, ModelCard]:
    """predict's and export's config (MODEL.WEIGHTS resolved,
    chosen_weights) and model card (card_for)."""
    cfg = chosen_weights(load_config(cfg_file, opts), command)
    return cfg, card_for(cfg, cfg_file, opts)


def card_for(cfg: CfgNode, cfg_file: str | None, opts: list[str]) -> ModelCard:
    """The card predict and export use: the checkpoint's card when the
    config came from it (described again when the overrides change the
    data or the preprocessing: the stored class names are kept unless
    the data changed); else, for --cfg or an older checkpoint, described
    from the config. The temperature belongs to the weights: the stored
    card's, whenever the file has one."""
    weights = cfg.MODEL.WEIGHTS
    stored = file_card(weights) if weights and os.path.isfile(weights) else None
    given = set(opts[0::2])
    if stored is None:
        return card_from_config(cfg)
    if cfg_file or given & DATA_KEYS:
        card = card_from_config(cfg)
    elif given & PREPROCESS_KEYS:
        card = card_from_config(cfg, stored.classes)
    else:
        return stored  # its config stays the one the model was trained with
    return replace(card, temperature=stored.temperature, calibration=stored.calibration)


def _older_card(cfg: CfgNode, path: str) -> ModelCard:
    """The card of a checkpoint written before cards: described from its
    config (MODEL.PRETRAINED kept, for timm's recipe); when its data is
    not here, the folder defaults, with a warning."""
    try:
        return card_from_config(cfg)
    except (UserError, OSError) as e:
        log.warning(
            "%s has no model card and its data cannot be read here (%s): its transform uses the "
            "config's recipe with ImageNet's defaults, and its classes are numbers",
            path,
            e,
        )
        return describe(cfg, None)


@dataclass
class LoadedModel:
    """load_model's result: the model (eval mode) and what it needs to
    be used."""

    model: torch.nn.Module
    transform: Callable[
        [Any], torch.Tensor
    ]  # PIL image -> input tensor [C, H, W] (card.transform())
    classes: list[str]  # the name of each output
    # the config it was built from (load_model: the run's, MODEL.WEIGHTS
    # and PRETRAINED cleared)
    config: CfgNode
    card: ModelCard


def device_for(cfg: CfgNode) -> torch.device:
    """One process, no process group (predict): the GPU when DEVICE
    allows and one is there, else the CPU."""
    if cfg.DEVICE == "cuda" and not torch.cuda.is_available():
        raise UserError("DEVICE is cuda but no CUDA GPU is visible; use DEVICE cpu or auto")
    return torch.device("cuda" if cfg.DEVICE != "cpu" and torch.cuda.is_available() else "cpu")


def build(
    cfg: CfgNode,
    card: ModelCard,
    device: str | torch.device = "cpu",
    state: dict[str, Any] | None = None,
) -> LoadedModel:
    """The model of a resolved config, ready for inference: cfg's
    architecture with MODEL.WEIGHTS (every tensor checked,
    weights.load_file), or with state (a checkpoint's weights read
    already: load), in eval mode on device, with the card's transform
    and class names."""
    model = models.build_model(cfg, with_weights=state is None)
    if state is not None:
        model.load_state_dict(models.strip_wrapper_prefixes(state))  # strict: every tensor must fit
    return LoadedModel(model.to(device).eval(), card.transform(), list(card.classes), cfg, card)


def load(path: str, device: str | torch.device = "cpu", ema: bool = False) -> LoadedModel:
    """The model of a checkpoint with its weights, in eval mode on
    device, and its preprocessing."""
    ckpt = read(path)
    found = stored_config(ckpt, path)
    if found is None:
        raise UserError(
            f"{path} holds no run config: it is a plain state dict, not a distribuuuu checkpoint, "
            f"and its folder has no config.yaml; build the model with config.load_config(...) and "
            "models.build_model(cfg) instead"
        )
    # The weights come from the checkpoint itself, never from files the
    # stored config names.
    cfg = config_from_text(
        found[0], found[1], ["MODEL.WEIGHTS", "None", "MODEL.PRETRAINED", "False"]
    )
    if ckpt.get("sharded"):
        raise UserError(
            f"{path} is a sharded FSDP checkpoint (weights in {ckpt['sharded']}); load_model needs "
            "a whole one: train with DIST.FSDP_STATE_DICT full, or use evaluate()"
        )
    key = "ema" if ema else "model"
    state = ckpt.get(key)
    if (
        state is None
        and not ema
        and "cfg" not in ckpt
        and any(isinstance(v, torch.Tensor) for v in ckpt.values())
    ):
        state = ckpt  # a bare state dict beside its run's config.yaml
    if state is None:
        raise UserError(
            f"{path} holds no EMA weights (the run had TRAIN.EMA_DECAY 0)"
            if ema
            else f"{path} holds no model weights"
        )
    card = from_checkpoint(ckpt) or _older_card(config_from_text(found[0], found[1], []), path)
    return build(cfg, card, device, state)

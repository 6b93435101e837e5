"""Resume checks what it resumes, before it touches anything of the run.

A checkpoint holds ``cfg`` (the YAML it was written under) and, under
the key ``facts``, its data identity (RunFolder.data_identity: what the
config alone does not prove: the sizes of the training and validation
sets, and the training classes in label order). Auto-resume compares
them with the new run's, the config flattened to keys such as
``OPTIM.BASE_LR``:

  IDENTITY_KEYS  change WHAT is trained (model, data, optimizer type, strategy, seed): refused,
                 with each key ``KEY: old -> new`` and how to start a fresh run (another OUT_DIR)
                 or a new run from these weights (MODEL.WEIGHTS path/to/checkpoint.pth)
  SAFE_KEYS      change how long, how often, how fast or where, not what: the run goes on and logs
                 ``resume: KEY changed old -> new`` once per key
  any other key  (learning rate, weight decay, augmentation, class balance, ...) changes the recipe
                 in the middle of the run: refused too, unless named in TRAIN.RESUME_ALLOW, the
                 explicit request to mix. RESUME_ALLOW may also name an identity key (a dataset that
                 moved to another path); the data identity and the shapes of the saved state are
                 checked all the same.

A differing dataset size, a class renamed, reordered or relabelled (the
first label that differs), a model whose state dict does not fit, and an
optimizer state of another optimizer are refused with one message each
(never a traceback from deep inside torch). Every rank reads the same
file and takes the same decision. ``check_resumable_config`` runs the
config comparison in the launching process (run_folder.check_folder,
when there is a checkpoint to resume), before config.yaml or any
checkpoint is written; ``check`` runs it again inside
``engine.trainer.Trainer.resume`` (for callers of engine.fit) together
with the data and the state.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import torch
import yaml

from distribuuuu import config
from distribuuuu.errors import UserError
from distribuuuu.weights import peek_checkpoint

log = logging.getLogger("distribuuuu")

# Keys that decide what the run trains; a checkpoint is only continued
# under the same values.
IDENTITY_KEYS = frozenset(
    {
        # the network: its layers, their shapes, where its first weights
        # came from
        "MODEL.ARCH",
        "MODEL.NUM_CLASSES",
        "MODEL.IN_CHANS",
        "MODEL.SMALL_STEM",
        "MODEL.PRETRAINED",
        "MODEL.WEIGHTS",
        "MODEL.DUMMY_INPUT",
        # the data: which images, which split, at what size, which part
        # is held out for validation
        "TRAIN.DATASET",
        "TRAIN.SPLIT",
        "TRAIN.SYNTHETIC_SAMPLES",
        "TRAIN.IM_SIZE",
        "TRAIN.VAL_SPLIT",
        "TEST.DATASET",
        "TEST.SPLIT",
        "TEST.SYNTHETIC_SAMPLES",
        "TEST.IM_SIZE",
        # what the optimizer state and the checkpoint files are made of
        "OPTIM.OPTIMIZER",
        "DIST.STRATEGY",
        "DIST.FSDP_STATE_DICT",
        # what best.pth means, and the data order and augmentations
        # drawn
        "TRAIN.BEST_METRIC",
        "RNG_SEED",
    }
)

# Keys that may change between a run and its resumption: the run goes on
# and logs each change.
SAFE_KEYS = frozenset(
    {
        # how long and when to stop (the LR schedule follows
        # OPTIM.MAX_EPOCH)
        "OPTIM.MAX_EPOCH",
        "TRAIN.PATIENCE",
        "TRAIN.TARGET_TOP1",
        "TRAIN.EVAL_PERIOD",
        # what is printed and kept, and where else it is sent (the
        # trackers' runs go on, or start)
        "TRAIN.TRACKERS",
        "TRAIN.TRACKER_CHECKPOINTS",
        "TRAIN.PRINT_FREQ",
        "TEST.OUT_DIR",
        "TEST.PRINT_FREQ",
        "TRAIN.TOPK",
        "TRAIN.CKPT_KEEP",
        "TRAIN.CKPT_PERIOD_STEPS",
        "TRAIN.CKPT_PERIOD_MIN",
        "TRAIN.AUTO_RESUME",
        "TRAIN.RESUME_ALLOW",
        "CFG_DEST",
        # batch and world size, as resume has always handled them (the
        # LR is recomputed and logged)
        "TRAIN.BATCH_SIZE",
        "TEST.BATCH_SIZE",
        # speed and placement, same arithmetic
        "TRAIN.WORKERS",
        "TRAIN.PIN_MEMORY",
        "TRAIN.DATA_PIPELINE",
        "TRAIN.COMPILE",
        "TRAIN.CHANNELS_LAST",
        "TRAIN.ACTIVATION_CHECKPOINTING",
        "NUM_THREADS",
        "DEVICE",
        "CUDNN.BENCHMARK",
        "CUDNN.DETERMINISTIC",
        "CUDNN.TF32",
        "DIST.BACKEND",
        "DIST.TIMEOUT_S",
        "DIST.BUCKET_CAP_MB",
        "DIST.GRADIENT_AS_BUCKET_VIEW",
        "DIST.STATIC_GRAPH",
        "DIST.FIND_UNUSED_PARAMETERS",
        "DIST.FSDP_RESHARD_AFTER_FORWARD",
        "DIST.CPU_OFFLOAD",
        # how faults are handled
        "TRAIN.NONFINITE",
        "TRAIN.NONFINITE_MAX_SKIPS",
        "TRAIN.PREEMPT_SIGNALS",
        "TRAIN.REQUEUE",
        "TRAIN.BAD_IMAGES",
        "TRAIN.LOAD_OPT",
        "DIST.VOTE_PERIOD_STEPS",
        # a data check: a change that alters the samples shows as
        # another dataset size (data identity)
        "TRAIN.DUPLICATE_IMAGES",
        "TRAIN.OVERLAP",
        # where the user's code is found (what it builds is compared:
        # MODEL.ARCH, the state's shapes)
        "IMPORTS",
    }
)

# Not compared at all: the run folder is where the checkpoint was found.
IGNORED_KEYS = frozenset({"OUT_DIR"})


def flatten_yaml(text: str) -> dict[str, Any]:
    """{"OPTIM.BASE_LR": 0.1, ...} of a config dumped as YAML (plain
    values: lists, not tuples)."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value

    walk(yaml.safe_load(text) or {}, "")
    return out


def config_changes(old_yaml: str, cfg: Any) -> list[tuple[str, Any, Any]]:
    """(key, old, new) for every key whose value differs; a key the old
    config lacks (written by an older version) counts as its default, a
    key the new one lacks (since removed) is skipped."""
    old, new = flatten_yaml(old_yaml), flatten_yaml(cfg.dump())
    defaults = flatten_yaml(config.get_defaults().dump())
    for key in (
        "TRAIN.DATASET",
        "TEST.DATASET",
    ):  # stored as typed before they were stored absolute (inferred/)
        if isinstance(old.get(key), str) and os.path.abspath(old[key]) == new.get(key):
            old[key] = new[key]
    return [
        (k, old.get(k, defaults.get(k)), v)
        for k, v in new.items()
        if k not in IGNORED_KEYS and old.get(k, defaults.get(k)) != v
    ]


def _fmt(value: Any) -> str:
    return repr(value) if isinstance(value, str) or value is None else str(value)


def refusal(path: str, out_dir: str, lines: Iterable[str], allow: list[str] | None = None) -> str:
    """The one message of a refused resume: what differs, then what to
    type instead."""
    other = out_dir.rstrip("/") + "_2"
    msg = (
        f"cannot resume the run in {out_dir} from {path}:\n"
        + "\n".join(f"  {ln}" for ln in lines)
        + f"\nTo start a fresh run, give another OUT_DIR (e.g. OUT_DIR {other}); to start a new "
        f"run from these weights: OUT_DIR {other} MODEL.WEIGHTS {path}"
    )
    if allow:
        msg += (
            f'; to continue this run with the changed recipe anyway: TRAIN.RESUME_ALLOW "{allow}"'
        )
    return msg


def compare_configs(old_yaml: str, cfg: Any, path: str) -> list[tuple[str, Any, Any]]:
    """Raise UserError when a change is not allowed; return the allowed
    changes (to be logged)."""
    allowed = set(cfg.TRAIN.RESUME_ALLOW or [])
    changes = config_changes(old_yaml, cfg)
    identity = [c for c in changes if c[0] in IDENTITY_KEYS and c[0] not in allowed]
    recipe = [c for c in changes if c[0] not in IDENTITY_KEYS | SAFE_KEYS and c[0] not in allowed]
    if identity or recipe:
        lines = [f"{k}: {_fmt(o)} -> {_fmt(n)}   (changes what is trained)" for k, o, n in identity]
        lines += [
            f"{k}: {_fmt(o)} -> {_fmt(n)}   (changes the recipe mid-run)" for k, o, n in recipe
        ]
        allow = sorted(allowed | {k for k, _, _ in recipe}) if recipe and not identity else None
        raise UserError(refusal(path, cfg.OUT_DIR, lines, allow))
    return [c for c in changes if c not in identity and c not in recipe]


def check_resumable_config(cfg: Any, candidates: list[str]) -> None:
    """In the launching process, before config.yaml or any checkpoint is
    written: refuse a resume whose config differs where it may not,
    against the first of the resume candidates whose config can be read
    (the full check runs again in Trainer.resume)."""
    for path in candidates:
        try:  # mmap: the config only, not the tensors
            text = peek_checkpoint(path).get("cfg")
        except Exception:  # noqa: BLE001 - Trainer.resume decides about unreadable files, with a warning
            continue
        if text is not None:
            compare_configs(text, cfg, path)
            return


def check_data(saved: dict[str, Any] | None, now: dict[str, Any], cfg: Any, path: str) -> None:
    """Refuse a checkpoint whose data identity (RunFolder.data_identity)
    is not this run's, or whose position in its epoch lies beyond the
    training set. A checkpoint without an entry (an older version's) is
    not checked on it."""
    names = {
        "train_samples": f"the training set ({cfg.TRAIN.DATASET}, split {cfg.TRAIN.SPLIT!r})",
        "val_samples": f"the validation set ({cfg.TEST.DATASET}, split {cfg.TEST.SPLIT!r})",
    }
    saved = saved or {}
    lines = [
        f"{names[k]} has {now[k]} samples now, {saved[k]} when the checkpoint was written"
        for k in names
        if k in saved and k in now and saved[k] != now[k]
    ]
    then, classes = saved.get("classes"), now.get("classes")
    if (
        then and classes and len(then) == len(classes) and then != classes
    ):  # (another count: NUM_CLASSES, shapes)
        i = next(
            i for i, (a, b) in enumerate(zip(then, classes)) if a != b
        )  # a rename shifts every later label
        lines.append(
            f"the training classes are not the checkpoint's: label {i} is {classes[i]!r} now, "
            f"{then[i]!r} when it was written"
        )
    position = saved.get("samples_in_epoch", 0)
    if not lines and position > now.get(
        "train_samples", position
    ):  # a checkpoint without the data's sizes
        lines = [
            f"{names['train_samples']} has {now['train_samples']} samples now, but the checkpoint "
            f"is {position} samples into its epoch"
        ]
    if lines:
        raise UserError(refusal(path, cfg.OUT_DIR, lines))


def _shape(t: Any) -> tuple:
    return tuple(getattr(t, "shape", ()))


def state_dict_mismatch(own: dict[str, Any], saved: dict[str, Any]) -> str | None:
    """One line saying how a saved state dict does not fit the model
    (None when it fits)."""
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    shapes = [
        f"{k} {_shape(saved[k])} in the file, {_shape(own[k])} in the model"
        for k in own
        if k in saved and _shape(saved[k]) != _shape(own[k])
    ]
    if not (missing or unexpected or shapes):
        return None
    parts = [
        f"{len(missing)} missing (e.g. {', '.join(missing[:3])})" if missing else "0 missing",
        f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})"
        if unexpected
        else "0 unexpected",
        f"{len(shapes)} of another shape" + (f" ({'; '.join(shapes[:3])})" if shapes else ""),
    ]
    return "the saved weights do not fit the model: " + ", ".join(parts)


def optimizer_mismatch(optimizer: torch.optim.Optimizer, saved: Any) -> str | None:
    """One line when a saved optimizer state belongs to another
    optimizer (other group options, other number of groups or
    parameters), which torch would report as KeyError: 'step' or worse."""
    try:
        own = optimizer.state_dict()
    except Exception:  # noqa: BLE001 - ZeRO before consolidation: leave the check to load_state_dict
        return None
    if not (isinstance(saved, dict) and "param_groups" in saved and "param_groups" in own):
        return None
    mine, theirs = own["param_groups"], saved["param_groups"]
    if len(mine) != len(theirs):
        groups = f"{len(theirs)} parameter groups, this optimizer {len(mine)}"
        return f"the saved optimizer state has {groups}"
    for a, b in zip(mine, theirs):
        extra, lacking = sorted(set(b) - set(a)), sorted(set(a) - set(b))
        if extra or lacking:
            return (
                "the saved optimizer state belongs to another optimizer (its options "
                f"{', '.join(extra) or '-'} are not this one's; it lacks "
                f"{', '.join(lacking) or '-'})"
            )
        if len(a.get("params", [])) != len(b.get("params", [])):
            return (
                f"the saved optimizer state holds {len(b.get('params', []))} parameters in a group "
                f"where this model has {len(a.get('params', []))}"
            )
    return None


def check(
    ckpt: dict[str, Any],
    path: str,
    cfg: Any,
    data_identity: dict[str, Any],
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """Everything Trainer.resume verifies before it loads: config, data
    identity, model and optimizer state. Raises UserError; logs
    ``resume: KEY changed old -> new`` for each accepted change."""
    if ckpt.get("cfg"):
        for key, old, new in compare_configs(ckpt["cfg"], cfg, path):
            log.info("resume: %s changed %s -> %s", key, _fmt(old), _fmt(new))
    saved = {
        **ckpt.get("facts", {}),
        "samples_in_epoch": ckpt.get("samples_in_epoch", 0),
    }  # "facts": its key
    check_data(saved, data_identity, cfg, path)
    if model is not None and isinstance(ckpt.get("model"), dict):
        why = state_dict_mismatch(model.state_dict(), ckpt["model"])
        if why:
            raise UserError(refusal(path, cfg.OUT_DIR, [why]))
    if optimizer is not None and "optimizer" in ckpt:
        why = optimizer_mismatch(optimizer, ckpt["optimizer"])
        if why:
            raise UserError(
                refusal(path, cfg.OUT_DIR, [why + f" (OPTIM.OPTIMIZER {cfg.OPTIM.OPTIMIZER})"])
            )

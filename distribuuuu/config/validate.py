"""The rules a merged config follows beyond each key's own type
(reading.py checks the names and types).

RULES is a table of (key, condition, message). ``validate(cfg)`` goes
down it and raises the first rule broken as a ``UserError`` (exit status
2): "KEY message", the message formatted with the key's value (``v``)
and the config (``c``). The order of the rows decides which of two
problems is reported.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from yacs.config import CfgNode as CN

from distribuuuu.config.defaults import _C
from distribuuuu.errors import UserError

LR_POLICIES = ("cos", "steps", "linear", "constant")
AMP_MODES = ("off", "bf16", "fp16")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs")
OPTIMIZERS = ("sgd", "adamw", "lamb", "lars")
BEST_METRICS = ("top1", "ema_top1")
LR_SCALINGS = ("none", "linear")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "nccl", "gloo")
STRATEGIES = ("ddp", "zero1", "fsdp", "dp")  # strategies.strategy_class's names (and "single")
DATA_PIPELINES = ("auto", "memory", "loader")  # data.loading.pipeline_class's choices
IMAGE_DECODERS = ("fast", "pil", "gpu", "auto")
AUTO_AUGMENTS = ("none", "randaugment", "trivialaugment", "autoaugment")
CLASS_BALANCES = ("none", "sampler", "loss")  # data/loading/balance.py
FSDP_STATE_DICTS = ("full", "sharded")
NONFINITE_MODES = ("skip", "stop", "off")
BAD_IMAGE_MODES = ("skip", "fail")
DUPLICATE_IMAGE_MODES = ("fail", "keep")
OVERLAP_MODES = ("warn", "error", "off")
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")
INTERPOLATIONS = ("nearest", "bilinear", "bicubic")  # TRAIN.INTERPOLATION ('' = the default)
TRACKERS = ("mlflow", "wandb")  # trackers.CLIENTS's names

Condition = Callable[[Any, CN], bool]  # (the key's value, the config) -> the rule holds
Rule = tuple[
    str, Condition, str | Callable[[Any, CN], str]
]  # a message, or one computed from (value, config)


def _positive(v: Any, c: CN) -> bool:
    return v > 0


def _non_negative(v: Any, c: CN) -> bool:
    return v >= 0


def _not_blank(v: Any, c: CN) -> bool:
    return v.strip() != ""


def _one_of(choices: tuple[str, ...], each: bool = False) -> tuple[Condition, str]:
    """The condition and message of a key that takes one of a few names
    (each=True: a list of such names)."""
    holds = (lambda v, c: all(x in choices for x in v)) if each else (lambda v, c: v in choices)
    return holds, f"{'may hold' if each else 'must be one of'} {', '.join(choices)}, got {{v!r}}"


def _is_range(v: Any) -> bool:
    """A [low, high] pair of numbers with low <= high."""
    return (
        isinstance(v, (list, tuple))
        and len(v) == 2
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
        and v[0] <= v[1]
    )


def _per_channel(v: Any, c: CN) -> bool:
    """[] (the source's own), or one number per input channel (1 or 3
    while MODEL.IN_CHANS is 0: undecided)."""
    chans = (c.MODEL.IN_CHANS,) if c.MODEL.IN_CHANS else (1, 3)
    return not v or (len(v) in chans and all(isinstance(x, (int, float)) for x in v))


def _is_key(name: Any) -> bool:
    """A full key name of the config, such as OPTIM.BASE_LR."""
    if not isinstance(name, str):
        return False
    node = _C
    for part in name.split("."):
        if not isinstance(node, CN) or part not in node:
            return False
        node = node[part]
    return not isinstance(node, CN)


def _not_a_key(v: list, c: CN) -> str:
    return (
        f"names {next(k for k in v if not _is_key(k))!r}, which is not a config key (write full "
        "names such as OPTIM.BASE_LR)"
    )


def _steps(condition: Condition) -> Condition:
    """OPTIM.STEPS's rules hold for the 'steps' policy only."""
    return lambda v, c: c.OPTIM.LR_POLICY != "steps" or condition(v, c)


_POSITIVE, _NON_NEGATIVE = "must be positive, got {v}", "must be >= 0, got {v}"

RULES: list[Rule] = [
    # Counts and sizes. 0 means "decided from the data" for
    # MODEL.NUM_CLASSES, MODEL.IN_CHANS, TRAIN.IM_SIZE, TEST.IM_SIZE and
    # OPTIM.MAX_EPOCH (inferred/)
    *[
        (key, _positive, _POSITIVE)
        for key in (
            "TRAIN.BATCH_SIZE",
            "TEST.BATCH_SIZE",
            "TRAIN.PRINT_FREQ",
            "TEST.PRINT_FREQ",
            "TRAIN.TOPK",
            "TRAIN.SYNTHETIC_SAMPLES",
            "TEST.SYNTHETIC_SAMPLES",
            "TRAIN.EVAL_PERIOD",
            "OPTIM.REF_BATCH_SIZE",
            "DIST.TIMEOUT_S",
            "TRAIN.REPEATED_AUG",
            "TRAIN.SHARD_SHUFFLE",
        )
    ],
    *[
        (key, _non_negative, _NON_NEGATIVE)
        for key in (
            "MODEL.NUM_CLASSES",
            "MODEL.IN_CHANS",
            "TRAIN.IM_SIZE",
            "TEST.IM_SIZE",
            "TRAIN.CKPT_PERIOD_STEPS",
            "TRAIN.CKPT_PERIOD_MIN",
            "TRAIN.NONFINITE_MAX_SKIPS",
            "TRAIN.CKPT_KEEP",
            "NUM_THREADS",
            "OPTIM.WEIGHT_DECAY",
            "OPTIM.WARMUP_EPOCHS",
            "OPTIM.DAMPENING",
            "DIST.BUCKET_CAP_MB",
            "TRAIN.VAL_SPLIT",
            "DIST.VOTE_PERIOD_STEPS",
        )
    ],
    (
        "TRAIN.WORKERS",
        lambda v, c: v >= -1,
        "must be >= 0, or -1 for what the cores allow, got {v}",
    ),
    # TRAIN.TOPK above MODEL.NUM_CLASSES is clamped to it (inferred/),
    # not refused. The optimizer and its schedule
    ("OPTIM.BASE_LR", _positive, _POSITIVE),
    (
        "OPTIM.MIN_LR",
        lambda v, c: 0 <= v <= 1,
        "is a fraction of the base LR and must be in [0, 1], got {v}",
    ),
    ("OPTIM.MOMENTUM", lambda v, c: 0 <= v < 1, "must be in [0, 1), got {v}"),
    ("OPTIM.WARMUP_FACTOR", lambda v, c: 0 < v <= 1, "must be in (0, 1], got {v}"),
    (
        "OPTIM.NESTEROV",
        lambda v, c: not v or (c.OPTIM.MOMENTUM > 0 and c.OPTIM.DAMPENING == 0),
        "True needs OPTIM.MOMENTUM > 0 and OPTIM.DAMPENING 0 (got MOMENTUM {c.OPTIM.MOMENTUM}, "
        "DAMPENING {c.OPTIM.DAMPENING})",
    ),
    ("OPTIM.LR_POLICY", *_one_of(LR_POLICIES)),
    (
        "OPTIM.STEPS",
        _steps(lambda v, c: len(v) > 0 and v[0] == 0),
        "must start at 0 for the 'steps' policy (e.g. [0, 30, 60, 90]), got {v}",
    ),
    (
        "OPTIM.STEPS",
        _steps(lambda v, c: all(isinstance(s, (int, float)) for s in v)),
        "must hold numbers, got {v}",
    ),
    (
        "OPTIM.STEPS",
        _steps(lambda v, c: list(v) == sorted(v) and len(set(v)) == len(v)),
        "must be strictly increasing, got {v}",
    ),
    (
        "OPTIM.STEPS",
        _steps(lambda v, c: not c.OPTIM.MAX_EPOCH or v[-1] < c.OPTIM.MAX_EPOCH),
        "must lie below OPTIM.MAX_EPOCH ({c.OPTIM.MAX_EPOCH}), got {v}",
    ),
    (
        "OPTIM.MAX_EPOCH",
        lambda v, c: v or c.OPTIM.LR_POLICY != "steps",
        "must be given with the 'steps' policy, whose OPTIM.STEPS are epochs, got {v}",
    ),
    ("OPTIM.LR_SCALING", *_one_of(LR_SCALINGS)),
    # Names
    ("TRAIN.AMP", *_one_of(AMP_MODES)),
    ("TRAIN.COMPILE_BACKEND", *_one_of(COMPILE_BACKENDS)),
    ("OPTIM.OPTIMIZER", *_one_of(OPTIMIZERS)),
    ("DIST.STRATEGY", *_one_of(STRATEGIES)),
    ("TRAIN.DATA_PIPELINE", *_one_of(DATA_PIPELINES)),
    ("TRAIN.IMAGE_DECODE", *_one_of(IMAGE_DECODERS)),
    (
        "TRAIN.IMAGE_DECODE",
        lambda v, c: v != "gpu" or c.TRAIN.AUTO_AUGMENT == "none",
        "gpu decodes after the loader workers, where TRAIN.AUTO_AUGMENT's per-image policy runs "
        "on decoded images; use TRAIN.IMAGE_DECODE fast (or auto), or TRAIN.AUTO_AUGMENT none",
    ),
    ("TRAIN.BEST_METRIC", *_one_of(BEST_METRICS)),
    ("TRAIN.AUTO_AUGMENT", *_one_of(AUTO_AUGMENTS)),
    ("TRAIN.CLASS_BALANCE", *_one_of(CLASS_BALANCES)),
    ("DIST.FSDP_STATE_DICT", *_one_of(FSDP_STATE_DICTS)),
    ("TRAIN.RESUME_ALLOW", lambda v, c: all(_is_key(k) for k in v), _not_a_key),
    # Training
    ("TRAIN.ACCUM_STEPS", lambda v, c: v >= 1, "must be at least 1, got {v}"),
    ("TRAIN.EMA_DECAY", lambda v, c: 0 <= v < 1, "must be in [0, 1), got {v}"),
    (
        "TRAIN.BEST_METRIC",
        lambda v, c: v != "ema_top1" or c.TRAIN.EMA_DECAY > 0,
        "ema_top1 needs an EMA: set TRAIN.EMA_DECAY (e.g. 0.9998)",
    ),
    ("TRAIN.LABEL_SMOOTHING", lambda v, c: 0 <= v < 1, "must be in [0, 1), got {v}"),
    (
        "TRAIN.BATCH_SIZE",
        lambda v, c: v % 2 == 0 or not (c.TRAIN.MIXUP_ALPHA > 0 or c.TRAIN.CUTMIX_ALPHA > 0),
        "must be even for mixup/cutmix, which pair the samples of a batch, got {v}",
    ),
    *[
        (key, _non_negative, _NON_NEGATIVE)
        for key in (
            "TRAIN.CLIP_GRAD_NORM",
            "TRAIN.MIXUP_ALPHA",
            "TRAIN.CUTMIX_ALPHA",
            "TRAIN.TARGET_TOP1",
            "OPTIM.MAX_EPOCH",
        )
    ],
    ("TRAIN.PATIENCE", lambda v, c: v >= -1, "must be >= 0, or -1 (decided), got {v}"),
    ("TRAIN.RANDAUG_MAGNITUDE", lambda v, c: 0 <= v <= 30, "must be in [0, 30], got {v}"),
    ("TRAIN.RANDOM_ERASE", lambda v, c: 0 <= v <= 1, "is a probability in [0, 1], got {v}"),
    (
        "TRAIN.VAL_SPLIT",
        lambda v, c: v < 1 or v == int(v),
        "is a fraction below 1 (e.g. 0.1) or a whole number of images (e.g. 500), got {v}",
    ),
    # The data recipe (docs/recipes.md, Data recipe)
    (
        "TRAIN.CROP_SCALE",
        lambda v, c: not v or (_is_range(v) and 0 < v[0] and v[1] <= 1),
        'is [min, max] crop area fractions with 0 < min <= max <= 1 (e.g. "[0.8, 1.0]"), or [] for '
        "the source's "
        "own, got {v}",
    ),
    (
        "TRAIN.CROP_RATIO",
        lambda v, c: _is_range(v) and v[0] > 0,
        'is [min, max] aspect ratios with 0 < min <= max (e.g. "[0.75, 1.333]"), got {v}',
    ),
    (
        "TRAIN.FLIP_PROB",
        lambda v, c: v == -1 or 0 <= v <= 1,
        "is a probability in [0, 1], or -1 for the source's own, got {v}",
    ),
    (
        "TRAIN.INTERPOLATION",
        lambda v, c: v in ("", *INTERPOLATIONS),
        f"must be one of {', '.join(INTERPOLATIONS)} (or '' for the default), got {{v!r}}",
    ),
    *[
        (
            key,
            _per_channel,
            'needs one number per channel (MODEL.IN_CHANS {c.MODEL.IN_CHANS}), e.g. "[0.5]" for '
            '1, "[0.5, 0.5, 0.5]" for 3, or [] for the source\'s own; got {v}',
        )
        for key in ("TRAIN.MEAN", "TRAIN.STD")
    ],
    (
        "TRAIN.MEAN",
        lambda v, c: bool(v) == bool(c.TRAIN.STD),
        "and TRAIN.STD go together: set both (one number per channel) or neither",
    ),
    ("TRAIN.STD", lambda v, c: all(x > 0 for x in v), "values must be positive, got {v}"),
    (
        "TEST.CROP_PCT",
        lambda v, c: v == 0 or 0.1 <= v <= 1,
        "is the center-crop fraction in [0.1, 1] (e.g. 0.875), or 0 to use TEST.IM_SIZE, got {v}",
    ),
    # Fine-tuning (docs/recipes.md, Fine-tuning)
    (
        "MODEL.PRETRAINED",
        lambda v, c: (
            not isinstance(v, str) or v.strip().lower() not in ("", "true", "false", "none")
        ),
        "is True, False or the path of a weights file, got the text {v!r}; write True or False "
        "without quotes",
    ),
    (
        "TRAIN.FREEZE_BACKBONE_EPOCHS",
        lambda v, c: isinstance(v, int) and v >= -1,
        "is a number of epochs (0: off), or -1 to keep the backbone frozen for good, got {v}",
    ),
    (
        "OPTIM.BACKBONE_LR_SCALE",
        _positive,
        "is the backbone's fraction of the LR and must be positive (e.g. 0.1), got {v}; to keep "
        "the backbone fixed use TRAIN.FREEZE_BACKBONE_EPOCHS -1",
    ),
    (
        "TRAIN.FREEZE_BACKBONE_EPOCHS",
        lambda v, c: v <= 0 or not c.DIST.STATIC_GRAPH,
        "{v} changes the parameters that get gradients after epoch {v}, which DIST.STATIC_GRAPH "
        "True forbids; set DIST.STATIC_GRAPH False",
    ),
    # Bad data, non-finite steps, stop signals
    ("TRAIN.BAD_IMAGES", *_one_of(BAD_IMAGE_MODES)),
    ("TRAIN.DUPLICATE_IMAGES", *_one_of(DUPLICATE_IMAGE_MODES)),
    ("TRAIN.OVERLAP", *_one_of(OVERLAP_MODES)),
    ("TRAIN.NONFINITE", *_one_of(NONFINITE_MODES)),
    ("TRAIN.PREEMPT_SIGNALS", *_one_of(PREEMPT_SIGNALS, each=True)),
    ("TRAIN.TRACKERS", *_one_of(TRACKERS, each=True)),
    (
        "TRAIN.TRACKERS",
        lambda v, c: len(set(v)) == len(v),
        "names a tracker twice, got {v!r}: each tracker writes one run; name it once",
    ),
    ("TRAIN.TRACKER_START_S", _positive, _POSITIVE),
    (
        "TRAIN.TRACKER_START_S",
        lambda v, c: v < c.DIST.TIMEOUT_S,
        "{v} must be below DIST.TIMEOUT_S {c.DIST.TIMEOUT_S}: the other ranks wait for the "
        "trackers' start in a collective",
    ),
    # Device, backend, names and paths
    ("DEVICE", *_one_of(DEVICES)),
    ("DIST.BACKEND", *_one_of(BACKENDS)),
    (
        "DIST.BACKEND",
        lambda v, c: not (v == "nccl" and c.DEVICE == "cpu"),
        "nccl needs GPUs, but DEVICE is cpu; use DIST.BACKEND gloo or auto",
    ),
    ("MODEL.ARCH", _not_blank, "must name a model, e.g. resnet18"),
    ("OUT_DIR", _not_blank, "must be a folder path, e.g. ./exp"),
    (
        "CFG_DEST",
        lambda v, c: v.strip() != "" and os.sep not in v and v not in (".", ".."),
        "{v!r} must be a plain file name inside OUT_DIR, such as config.yaml",
    ),
    ("TRAIN.DATASET", _not_blank, "must be a folder path or one of mnist5k, synthetic"),
    (
        "TEST.DATASET",
        lambda v, c: v == "" or v.strip() != "",
        "must be a folder path, one of mnist5k, synthetic, or '' for TRAIN.DATASET",
    ),
    (
        "IMPORTS",
        lambda v, c: all(isinstance(m, str) and m.strip() for m in v),
        "holds module names or .py file paths (e.g. ['mypkg.models']), got {v}",
    ),
]


def validate(cfg: CN) -> None:
    """Raise the first rule of RULES that cfg breaks, as a UserError
    naming the key, its value and a fix."""
    for key, holds, message in RULES:
        value = cfg
        for part in key.split("."):
            value = value[part]
        if not holds(value, cfg):
            text = message(value, cfg) if callable(message) else message.format(v=value, c=cfg)
            raise UserError(f"{key} {text}")

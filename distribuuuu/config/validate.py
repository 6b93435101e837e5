"""Semantic checks of a merged config: what needs more than the type of one key.

``validate(cfg)`` runs one small check per group of keys, in a fixed order; the first problem
found is raised as ``UserError`` (exit status 2) with a message naming the key and a fix.
"""

from __future__ import annotations

import os
from typing import Any

from yacs.config import CfgNode as CN

from distribuuuu.config.defaults import get_defaults
from distribuuuu.config.reading import flatten
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
DATA_PIPELINES = ("auto", "memory", "loader")  # 'auto', then the names of data.pipeline.PIPELINES
IMAGE_DECODERS = ("fast", "pil")
AUTO_AUGMENTS = ("none", "randaugment", "trivialaugment", "autoaugment")
FSDP_STATE_DICTS = ("full", "sharded")
NONFINITE_MODES = ("skip", "stop", "off")
BAD_IMAGE_MODES = ("skip", "fail")
DUPLICATE_IMAGE_MODES = ("fail", "keep")
OVERLAP_MODES = ("warn", "error", "off")
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")
INTERPOLATIONS = ("nearest", "bilinear", "bicubic")  # TRAIN.INTERPOLATION, or '' for the default

_POSITIVE = ("TRAIN.BATCH_SIZE", "TRAIN.IM_SIZE", "TEST.BATCH_SIZE", "TRAIN.PRINT_FREQ", "TEST.PRINT_FREQ",
             "TRAIN.TOPK", "OPTIM.MAX_EPOCH", "MODEL.IN_CHANS", "TRAIN.SYNTHETIC_SAMPLES",
             "TEST.SYNTHETIC_SAMPLES", "TRAIN.EVAL_PERIOD", "OPTIM.REF_BATCH_SIZE", "DIST.TIMEOUT_S",
             "TRAIN.REPEATED_AUG", "TRAIN.SHARD_SHUFFLE")
# 0 means "infer" for the first two (inferred.py)
_NON_NEGATIVE = ("MODEL.NUM_CLASSES", "TEST.IM_SIZE", "TRAIN.CKPT_PERIOD_STEPS", "TRAIN.CKPT_PERIOD_MIN",
                 "TRAIN.NONFINITE_MAX_SKIPS", "TRAIN.CKPT_KEEP", "NUM_THREADS", "OPTIM.WEIGHT_DECAY",
                 "OPTIM.WARMUP_EPOCHS", "OPTIM.DAMPENING", "DIST.BUCKET_CAP_MB", "TRAIN.VAL_SPLIT",
                 "DIST.VOTE_PERIOD_STEPS")
# Checked after the recipe keys (their order decides which of two problems is reported first)
_NON_NEGATIVE_RECIPE = ("TRAIN.CLIP_GRAD_NORM", "TRAIN.MIXUP_ALPHA", "TRAIN.CUTMIX_ALPHA", "TRAIN.PATIENCE",
                        "TRAIN.TARGET_TOP1")
_CHOICES = (("TRAIN.AMP", AMP_MODES), ("TRAIN.COMPILE_BACKEND", COMPILE_BACKENDS), ("OPTIM.OPTIMIZER", OPTIMIZERS), ("DIST.STRATEGY", STRATEGIES),
            ("TRAIN.DATA_PIPELINE", DATA_PIPELINES), ("TRAIN.IMAGE_DECODE", IMAGE_DECODERS),
            ("TRAIN.BEST_METRIC", BEST_METRICS), ("TRAIN.AUTO_AUGMENT", AUTO_AUGMENTS),
            ("DIST.FSDP_STATE_DICT", FSDP_STATE_DICTS))


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise UserError(msg)


def _get(cfg: CN, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def validate(cfg: CN) -> None:
    """Semantic checks that need more than the type of one key."""
    _check_counts(cfg)
    _check_optim(cfg)
    _check_steps(cfg)
    _check_choices(cfg)
    _check_train(cfg)
    _check_recipe(cfg)
    _check_finetune(cfg)
    _check_data_modes(cfg)
    _check_run(cfg)


def _check_counts(cfg: CN) -> None:
    for key in _POSITIVE:
        value = _get(cfg, key)
        _need(value > 0, f"config key {key} must be positive, got {value}")
    for key in _NON_NEGATIVE:
        value = _get(cfg, key)
        _need(value >= 0, f"config key {key} must be >= 0, got {value}")
    # TRAIN.TOPK above MODEL.NUM_CLASSES is clamped to it (inferred.py), not refused
    _need(cfg.TRAIN.WORKERS >= -1, f"config key TRAIN.WORKERS must be >= 0, or -1 for what the cores allow, "
          f"got {cfg.TRAIN.WORKERS}")


def _check_optim(cfg: CN) -> None:
    o = cfg.OPTIM
    _need(o.BASE_LR > 0, f"OPTIM.BASE_LR must be positive, got {o.BASE_LR}")
    _need(0.0 <= o.MIN_LR <= 1.0, f"OPTIM.MIN_LR is a fraction of the base LR and must be in [0, 1], got {o.MIN_LR}")
    _need(0.0 <= o.MOMENTUM < 1.0, f"OPTIM.MOMENTUM must be in [0, 1), got {o.MOMENTUM}")
    _need(0.0 < o.WARMUP_FACTOR <= 1.0, f"OPTIM.WARMUP_FACTOR must be in (0, 1], got {o.WARMUP_FACTOR}")
    if o.NESTEROV:
        _need(o.MOMENTUM > 0 and o.DAMPENING == 0,
              "OPTIM.NESTEROV True needs OPTIM.MOMENTUM > 0 and OPTIM.DAMPENING 0 "
              f"(got MOMENTUM {o.MOMENTUM}, DAMPENING {o.DAMPENING})")
    _need(o.LR_POLICY in LR_POLICIES,
          f"OPTIM.LR_POLICY must be one of {', '.join(LR_POLICIES)}, got {o.LR_POLICY!r}")


def _check_steps(cfg: CN) -> None:
    """The 'steps' policy's epochs, then the LR scaling rule."""
    if cfg.OPTIM.LR_POLICY == "steps":
        steps = list(cfg.OPTIM.STEPS)
        _need(len(steps) > 0 and steps[0] == 0,
              f"OPTIM.STEPS must start at 0 for the 'steps' policy (e.g. [0, 30, 60, 90]), got {steps}")
        _need(all(isinstance(s, (int, float)) for s in steps), f"OPTIM.STEPS must hold numbers, got {steps}")
        _need(steps == sorted(steps) and len(set(steps)) == len(steps),
              f"OPTIM.STEPS must be strictly increasing, got {steps}")
        _need(steps[-1] < cfg.OPTIM.MAX_EPOCH,
              f"OPTIM.STEPS must lie below OPTIM.MAX_EPOCH ({cfg.OPTIM.MAX_EPOCH}), got {steps}")
    _need(cfg.OPTIM.LR_SCALING in LR_SCALINGS,
          f"OPTIM.LR_SCALING must be one of {', '.join(LR_SCALINGS)}, got {cfg.OPTIM.LR_SCALING!r}")


def _check_choices(cfg: CN) -> None:
    for key, allowed in _CHOICES:
        _need(_get(cfg, key) in allowed, f"{key} must be one of {', '.join(allowed)}, got {_get(cfg, key)!r}")
    known = flatten(get_defaults())
    for key in cfg.TRAIN.RESUME_ALLOW:
        _need(isinstance(key, str) and key in known,
              f"TRAIN.RESUME_ALLOW names {key!r}, which is not a config key (write full names such as OPTIM.BASE_LR)")


def _check_train(cfg: CN) -> None:
    t = cfg.TRAIN
    _need(t.ACCUM_STEPS >= 1, f"TRAIN.ACCUM_STEPS must be at least 1, got {t.ACCUM_STEPS}")
    _need(0.0 <= t.EMA_DECAY < 1.0, f"TRAIN.EMA_DECAY must be in [0, 1), got {t.EMA_DECAY}")
    _need(t.BEST_METRIC != "ema_top1" or t.EMA_DECAY > 0,
          "TRAIN.BEST_METRIC ema_top1 needs an EMA: set TRAIN.EMA_DECAY (e.g. 0.9998)")
    _need(0.0 <= t.LABEL_SMOOTHING < 1.0, f"TRAIN.LABEL_SMOOTHING must be in [0, 1), got {t.LABEL_SMOOTHING}")
    mixing = t.MIXUP_ALPHA > 0 or t.CUTMIX_ALPHA > 0
    _need(not mixing or t.BATCH_SIZE % 2 == 0,
          f"mixup/cutmix pair samples within a batch: TRAIN.BATCH_SIZE must be even, got {t.BATCH_SIZE}")
    for key in _NON_NEGATIVE_RECIPE:
        _need(_get(cfg, key) >= 0, f"config key {key} must be >= 0, got {_get(cfg, key)}")
    _need(0 <= t.RANDAUG_MAGNITUDE <= 30, f"TRAIN.RANDAUG_MAGNITUDE must be in [0, 30], got {t.RANDAUG_MAGNITUDE}")
    _need(0.0 <= t.RANDOM_ERASE <= 1.0, f"TRAIN.RANDOM_ERASE is a probability in [0, 1], got {t.RANDOM_ERASE}")
    split = t.VAL_SPLIT
    _need(split < 1 or split == int(split),
          f"TRAIN.VAL_SPLIT is a fraction below 1 (e.g. 0.1) or a whole number of images (e.g. 500), got {split}")


def _is_range(values: Any) -> bool:
    """A [low, high] pair of numbers with low <= high."""
    return (isinstance(values, (list, tuple)) and len(values) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) and values[0] <= values[1])


def _check_recipe(cfg: CN) -> None:
    """The data recipe keys (docs/recipes.md, Data recipe): ranges, names, one mean/std per channel."""
    t, chans = cfg.TRAIN, cfg.MODEL.IN_CHANS
    scale, ratio = list(t.CROP_SCALE), list(t.CROP_RATIO)
    _need(not scale or (_is_range(scale) and 0 < scale[0] and scale[1] <= 1),
          f"TRAIN.CROP_SCALE is [min, max] crop area fractions with 0 < min <= max <= 1 (e.g. \"[0.8, 1.0]\"), "
          f"or [] for the source's own, got {scale}")
    _need(_is_range(ratio) and ratio[0] > 0,
          f"TRAIN.CROP_RATIO is [min, max] aspect ratios with 0 < min <= max (e.g. \"[0.75, 1.333]\"), got {ratio}")
    _need(t.FLIP_PROB == -1 or 0.0 <= t.FLIP_PROB <= 1.0,
          f"TRAIN.FLIP_PROB is a probability in [0, 1], or -1 for the source's own, got {t.FLIP_PROB}")
    _need(t.INTERPOLATION in ("",) + INTERPOLATIONS, f"TRAIN.INTERPOLATION must be one of "
          f"{', '.join(INTERPOLATIONS)} (or '' for the default), got {t.INTERPOLATION!r}")
    for name, values in (("MEAN", t.MEAN), ("STD", t.STD)):
        _need(not values or (len(values) == chans and all(isinstance(v, (int, float)) for v in values)),
              f"TRAIN.{name} needs one number per channel (MODEL.IN_CHANS {chans}), e.g. "
              f"\"{[0.5] * chans}\", or [] for the source's own; got {list(values)}")
    _need(bool(t.MEAN) == bool(t.STD), "TRAIN.MEAN and TRAIN.STD go together: set both (one number per channel) "
          "or neither")
    _need(all(v > 0 for v in t.STD), f"TRAIN.STD values must be positive, got {list(t.STD)}")
    _need(0.0 <= cfg.TEST.CROP_PCT <= 1.0 and (cfg.TEST.CROP_PCT == 0 or cfg.TEST.CROP_PCT >= 0.1),
          f"TEST.CROP_PCT is the center-crop fraction in [0.1, 1] (e.g. 0.875), or 0 to use TEST.IM_SIZE, "
          f"got {cfg.TEST.CROP_PCT}")


def _check_finetune(cfg: CN) -> None:
    """MODEL.PRETRAINED, TRAIN.FREEZE_BACKBONE_EPOCHS and OPTIM.BACKBONE_LR_SCALE (docs/recipes.md, Fine-tuning)."""
    pretrained = cfg.MODEL.PRETRAINED
    _need(not isinstance(pretrained, str) or pretrained.strip().lower() not in ("", "true", "false", "none"),
          f"MODEL.PRETRAINED is True, False or the path of a weights file, got the text {pretrained!r}; "
          "write True or False without quotes")
    freeze = cfg.TRAIN.FREEZE_BACKBONE_EPOCHS
    _need(isinstance(freeze, int) and freeze >= -1, "TRAIN.FREEZE_BACKBONE_EPOCHS is a number of epochs (0: off), "
          f"or -1 to keep the backbone frozen for good, got {freeze}")
    _need(cfg.OPTIM.BACKBONE_LR_SCALE > 0, "OPTIM.BACKBONE_LR_SCALE is the backbone's fraction of the LR and must "
          f"be positive (e.g. 0.1), got {cfg.OPTIM.BACKBONE_LR_SCALE}; to keep the backbone fixed use "
          "TRAIN.FREEZE_BACKBONE_EPOCHS -1")
    _need(freeze <= 0 or not cfg.DIST.STATIC_GRAPH, f"TRAIN.FREEZE_BACKBONE_EPOCHS {freeze} changes the parameters "
          f"that get gradients after epoch {freeze}, which DIST.STATIC_GRAPH True forbids; set DIST.STATIC_GRAPH False")


def _check_data_modes(cfg: CN) -> None:
    """How bad data, non-finite steps and stop signals are handled."""
    t = cfg.TRAIN
    _need(t.BAD_IMAGES in BAD_IMAGE_MODES,
          f"TRAIN.BAD_IMAGES must be one of {', '.join(BAD_IMAGE_MODES)}, got {t.BAD_IMAGES!r}")
    _need(t.DUPLICATE_IMAGES in DUPLICATE_IMAGE_MODES, "TRAIN.DUPLICATE_IMAGES must be one of "
          f"{', '.join(DUPLICATE_IMAGE_MODES)}, got {t.DUPLICATE_IMAGES!r}")
    _need(t.OVERLAP in OVERLAP_MODES, f"TRAIN.OVERLAP must be one of {', '.join(OVERLAP_MODES)}, got {t.OVERLAP!r}")
    _need(t.NONFINITE in NONFINITE_MODES,
          f"TRAIN.NONFINITE must be one of {', '.join(NONFINITE_MODES)}, got {t.NONFINITE!r}")
    bad = [s for s in t.PREEMPT_SIGNALS if s not in PREEMPT_SIGNALS]
    _need(not bad, f"TRAIN.PREEMPT_SIGNALS may hold {', '.join(PREEMPT_SIGNALS)}, got {bad}")


def _check_run(cfg: CN) -> None:
    """Device, backend, names and paths."""
    _need(cfg.DEVICE in DEVICES, f"DEVICE must be one of {', '.join(DEVICES)}, got {cfg.DEVICE!r}")
    _need(cfg.DIST.BACKEND in BACKENDS,
          f"DIST.BACKEND must be one of {', '.join(BACKENDS)}, got {cfg.DIST.BACKEND!r}")
    _need(not (cfg.DIST.BACKEND == "nccl" and cfg.DEVICE == "cpu"),
          "DIST.BACKEND nccl needs GPUs, but DEVICE is cpu; use DIST.BACKEND gloo or auto")
    _need(cfg.MODEL.ARCH.strip() != "", "MODEL.ARCH must name a model, e.g. resnet18")
    _need(cfg.OUT_DIR.strip() != "", "OUT_DIR must be a folder path, e.g. ./exp")
    _need(cfg.CFG_DEST.strip() != "" and os.sep not in cfg.CFG_DEST and cfg.CFG_DEST not in (".", ".."),
          f"CFG_DEST {cfg.CFG_DEST!r} must be a plain file name inside OUT_DIR, such as config.yaml")
    _need(cfg.TRAIN.DATASET.strip() != "", "TRAIN.DATASET must be a folder path or one of mnist5k, synthetic")
    _need(cfg.TEST.DATASET == "" or cfg.TEST.DATASET.strip() != "",
          "TEST.DATASET must be a folder path, one of mnist5k, synthetic, or '' for TRAIN.DATASET")
    bad = [m for m in cfg.IMPORTS if not isinstance(m, str) or not m.strip()]
    _need(not bad, f"IMPORTS holds module names or .py file paths (e.g. ['mypkg.models']), got {bad}")

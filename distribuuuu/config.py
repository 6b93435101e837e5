"""The configuration: one yacs tree, every key with a one-line comment.

Call order: ``load_config(cfg_file, opts)`` = defaults -> merge file -> merge ``KEY VALUE`` list
-> ``validate`` -> freeze. Every Distribuuuu key keeps its name, type, default and meaning, so
Distribuuuu's YAML files load unchanged. Errors are ``UserError`` (exit status 2).
"""

from __future__ import annotations

import ast
import codecs
import difflib
import os
from typing import Any, Iterable

import yaml
from yacs.config import CfgNode as CN

from distribuuuu.errors import UserError

_C = CN()

# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
_C.MODEL = CN()
# Architecture name: a torchvision model, a timm model, or one of the aliases in models.py
_C.MODEL.ARCH = "resnet18"
# Number of output classes (the size of the classifier head)
_C.MODEL.NUM_CLASSES = 1000
# Start from pretrained weights found as a LOCAL file in torch.hub.get_dir()/checkpoints (never downloaded)
_C.MODEL.PRETRAINED = False
# Convert BatchNorm layers to SyncBatchNorm (statistics over the global batch; helps small per-GPU batches)
_C.MODEL.SYNCBN = False
# Path to a weights file (a checkpoint or a bare state dict) to load before training or evaluating
_C.MODEL.WEIGHTS = None
# Feed random tensors instead of real data (times the model alone; Distribuuuu's key)
_C.MODEL.DUMMY_INPUT = False
# Number of input channels (1 for grayscale models; data with other channel counts is converted)
_C.MODEL.IN_CHANS = 3
# Replace the stride-4 ImageNet stem by a stride-1 3x3 conv for 28-32 px images (ResNet family)
_C.MODEL.SMALL_STEM = False

# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
_C.TRAIN = CN()
# Mini-batch size PER PROCESS; the global batch is BATCH_SIZE x world size
_C.TRAIN.BATCH_SIZE = 32
# Training crop size in pixels (RandomResizedCrop for folders, pad-crop for small built-in images)
_C.TRAIN.IM_SIZE = 224
# Training data: a folder path (<DATASET>/<SPLIT>/<class>/*), a CIFAR folder, or mnist5k / synthetic
_C.TRAIN.DATASET = "./data/ILSVRC/"
# Sub-folder (or split name) of DATASET used for training
_C.TRAIN.SPLIT = "train"
# Resume from OUT_DIR/checkpoints/last.pth when it exists; False starts afresh, and refuses an
# OUT_DIR that already holds a run (checkpoints or metrics records) rather than overwrite it
_C.TRAIN.AUTO_RESUME = True
# Config keys allowed to differ from the checkpoint's on resume beyond the safe ones (e.g.
# ["OPTIM.BASE_LR"]): the explicit request to change the recipe mid-run (see resume_check.py)
_C.TRAIN.RESUME_ALLOW = []
# On resume, also restore the optimizer state (False: weights, epoch and schedule only)
_C.TRAIN.LOAD_OPT = True
# DataLoader worker processes per training process
_C.TRAIN.WORKERS = 4
# Pin host memory of batches (only has an effect with CUDA)
_C.TRAIN.PIN_MEMORY = True
# Print a progress line every PRINT_FREQ iterations (rank 0 only)
_C.TRAIN.PRINT_FREQ = 30
# The k of the top-k accuracy reported next to top-1 (clipped to the number of classes)
_C.TRAIN.TOPK = 5
# Unreadable image files: 'skip' (log, count, use the next readable one) or 'fail' (stop the run)
_C.TRAIN.BAD_IMAGES = "skip"
# The same real image file listed twice in a folder split (through symlinks): 'fail' (stop before
# training, naming them) or 'keep' (every listed path is a sample, as ImageFolder does: oversampling)
_C.TRAIN.DUPLICATE_IMAGES = "fail"
# Number of samples of the synthetic training set (TRAIN.DATASET synthetic)
_C.TRAIN.SYNTHETIC_SAMPLES = 1024
# Evaluate on the val split every EVAL_PERIOD epochs (and always after the last epoch)
_C.TRAIN.EVAL_PERIOD = 1
# Keep the newest CKPT_KEEP per-epoch (and per-step) checkpoints (last.pth and best.pth are kept besides)
_C.TRAIN.CKPT_KEEP = 3
# Also checkpoint every CKPT_PERIOD_STEPS optimizer steps, mid-epoch (0: only at epoch ends)
_C.TRAIN.CKPT_PERIOD_STEPS = 0
# Also checkpoint every CKPT_PERIOD_MIN minutes of wall time, mid-epoch (0: off)
_C.TRAIN.CKPT_PERIOD_MIN = 0.0
# Non-finite loss or gradients: 'skip' the step, 'stop' the run, or 'off' (no check per step: one host
# sync less; an epoch whose loss is not finite still ends the run). Ending the run is exit status 2
_C.TRAIN.NONFINITE = "skip"
# With NONFINITE 'skip': stop the run after this many consecutive non-finite steps
_C.TRAIN.NONFINITE_MAX_SKIPS = 10
# Signals that mean "checkpoint now and exit" (preemption), e.g. Slurm's --signal=USR1@90
_C.TRAIN.PREEMPT_SIGNALS = ["SIGTERM", "SIGUSR1"]
# Under Slurm, after a preemption checkpoint rank 0 runs `scontrol requeue $SLURM_JOB_ID`
_C.TRAIN.REQUEUE = False

# Mixed precision: 'off', 'bf16' (autocast; also on CPU) or 'fp16' (autocast + GradScaler; CUDA)
_C.TRAIN.AMP = "off"
# Keep activations in channels_last memory format (faster convolutions on recent GPUs)
_C.TRAIN.CHANNELS_LAST = False
# Compile the model with torch.compile (compile time is logged apart, not counted as throughput)
_C.TRAIN.COMPILE = False
# Gradient accumulation: micro-batches per optimizer step (global batch = BATCH_SIZE x world x ACCUM_STEPS)
_C.TRAIN.ACCUM_STEPS = 1
# Clip the global gradient norm to this value (0: no clipping)
_C.TRAIN.CLIP_GRAD_NORM = 0.0
# Label smoothing of the cross-entropy loss (0: none)
_C.TRAIN.LABEL_SMOOTHING = 0.0
# Mixup alpha (0: off); with mixup/cutmix, top-1 is still counted against the hard labels
_C.TRAIN.MIXUP_ALPHA = 0.0
# CutMix alpha (0: off)
_C.TRAIN.CUTMIX_ALPHA = 0.0
# Automatic augmentation policy (torchvision v2): 'none', 'randaugment', 'trivialaugment' or 'autoaugment' (ImageNet policy)
_C.TRAIN.AUTO_AUGMENT = "none"
# RandAugment magnitude (0-30, 2 operations per image) for TRAIN.AUTO_AUGMENT randaugment
_C.TRAIN.RANDAUG_MAGNITUDE = 9
# Random erasing: probability per training image of erasing one random rectangle (0: off; timm uses 0.25)
_C.TRAIN.RANDOM_ERASE = 0.0
# Repeated augmentation: each image is drawn this many times per epoch, on different ranks (1: off; 3 in DeiT)
_C.TRAIN.REPEATED_AUG = 1
# Recompute each block's activations in the backward pass instead of storing them (less memory, more compute)
_C.TRAIN.ACTIVATION_CHECKPOINTING = False
# Hold out this fraction (< 1) or number (>= 1) of the training set, stratified by class, as the validation
# split (0: none). Then best.pth and early stopping use it, and TEST is the test set, evaluated once at the end
_C.TRAIN.VAL_SPLIT = 0.0
# EMA of the weights: decay per step at OPTIM.REF_BATCH_SIZE (0: no EMA); the decay used is
# EMA_DECAY ** (global batch / REF_BATCH_SIZE), so the average spans the same number of samples
_C.TRAIN.EMA_DECAY = 0.0
# Metric that picks best.pth and drives early stopping: 'top1' (raw model) or 'ema_top1'
_C.TRAIN.BEST_METRIC = "top1"
# Stop after PATIENCE evaluations without a new best (0: never)
_C.TRAIN.PATIENCE = 0
# Stop once val top-1 reaches this (percent; 0: never); the time to reach it is logged
_C.TRAIN.TARGET_TOP1 = 0.0

# Input pipeline (train and val): 'auto' (in memory for mnist5k and CIFAR up to 2 GiB per process, else DataLoader),
# 'memory' (the whole set as one tensor on the device, batched augmentation; not for folders) or 'loader'
_C.TRAIN.DATA_PIPELINE = "auto"
# Image folders: 'fast' (libjpeg-turbo decode, reduced-size JPEG decoding when the crop allows,
# uint8 batches normalized on the device) or 'pil' (torchvision's per-sample PIL recipe)
_C.TRAIN.IMAGE_DECODE = "fast"

# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------
_C.TEST = CN()
# Validation data: a folder path, a CIFAR folder, or mnist5k / synthetic
_C.TEST.DATASET = "./data/ILSVRC/"
# Sub-folder (or split name) of DATASET used for validation
_C.TEST.SPLIT = "val"
# Mini-batch size per process for evaluation
_C.TEST.BATCH_SIZE = 200
# Resize the shorter side to IM_SIZE, then center-crop TRAIN.IM_SIZE (folders only)
_C.TEST.IM_SIZE = 256
# Print an evaluation progress line every PRINT_FREQ iterations (rank 0 only)
_C.TEST.PRINT_FREQ = 10
# Number of samples of the synthetic validation set (TEST.DATASET synthetic)
_C.TEST.SYNTHETIC_SAMPLES = 256

# ---------------------------------------------------------------------------------------------
# cuDNN
# ---------------------------------------------------------------------------------------------
_C.CUDNN = CN()
# Let cuDNN pick the fastest convolution algorithms (fixed input sizes)
_C.CUDNN.BENCHMARK = True
# Ask cuDNN and torch for deterministic algorithms (slower; overrides BENCHMARK)
_C.CUDNN.DETERMINISTIC = False
# TF32 for float32 matmuls and convolutions on Ampere and newer GPUs (faster, 10-bit mantissa; False: full fp32)
_C.CUDNN.TF32 = True

# ---------------------------------------------------------------------------------------------
# Optimizer and learning-rate schedule (SGD)
# ---------------------------------------------------------------------------------------------
_C.OPTIM = CN()
# Number of training epochs
_C.OPTIM.MAX_EPOCH = 100
# LR policy: 'cos' (half-period cosine), 'steps' (x LR_MULT at each of STEPS), 'linear' (to MIN_LR), 'constant'
_C.OPTIM.LR_POLICY = "cos"
# Base learning rate (used as is, or scaled by the global batch when LR_SCALING is 'linear')
_C.OPTIM.BASE_LR = 0.1
# Final learning rate of the cosine policy, as a fraction of the base learning rate
_C.OPTIM.MIN_LR = 0.0
# Epochs at which the 'steps' policy multiplies the LR by LR_MULT (sorted, starting at 0)
_C.OPTIM.STEPS = []
# Optimizer: 'sgd' (torch, with MOMENTUM/DAMPENING/NESTEROV), 'adamw', 'lamb' or 'lars' (timm's)
_C.OPTIM.OPTIMIZER = "sgd"
# Exempt normalization weights and biases from weight decay
_C.OPTIM.NO_WD_NORM_BIAS = False
# Multiplier applied at each step of the 'steps' policy
_C.OPTIM.LR_MULT = 0.1
# SGD momentum
_C.OPTIM.MOMENTUM = 0.9
# SGD dampening (must be 0 with Nesterov momentum)
_C.OPTIM.DAMPENING = 0.0
# Use Nesterov momentum
_C.OPTIM.NESTEROV = True
# The LR starts at WARMUP_FACTOR x LR and rises linearly to LR over WARMUP_EPOCHS
_C.OPTIM.WARMUP_FACTOR = 0.1
# Length of the linear warmup in epochs (may be fractional; 0 disables it)
_C.OPTIM.WARMUP_EPOCHS = 5
# L2 weight decay
_C.OPTIM.WEIGHT_DECAY = 5e-5
# 'none': the LR is BASE_LR; 'linear': BASE_LR x global batch / REF_BATCH_SIZE (Goyal et al., 2017)
_C.OPTIM.LR_SCALING = "none"
# The global batch size at which BASE_LR was tuned (for the linear scaling rule)
_C.OPTIM.REF_BATCH_SIZE = 128

# ---------------------------------------------------------------------------------------------
# Distributed run
# ---------------------------------------------------------------------------------------------
_C.DIST = CN()
# Process-group backend: 'auto' (nccl on CUDA, gloo on CPU), 'nccl' or 'gloo'
_C.DIST.BACKEND = "auto"
# Seconds a collective may wait for the other ranks before the run is aborted
_C.DIST.TIMEOUT_S = 1800
# Ranks agree on stop signals and time-based checkpoints every VOTE_PERIOD_STEPS optimizer steps and at
# each epoch's end (one small gloo all-reduce per vote, benchmarks/vote_cost.py); 0: auto, every step
# with up to 8 processes, every 10 steps with more
_C.DIST.VOTE_PERIOD_STEPS = 0
# Data parallelism: 'ddp' (DistributedDataParallel), 'zero1' (DDP + optimizer state sharded with
# ZeroRedundancyOptimizer), 'fsdp' (FSDP2 fully_shard: parameters, gradients and optimizer state
# sharded), or 'dp' (DataParallel over this machine's GPUs in ONE process)
_C.DIST.STRATEGY = "ddp"
# DDP gradient bucket size in MiB (0: torch's default of 25, with its small first bucket)
_C.DIST.BUCKET_CAP_MB = 0
# FSDP: free the gathered parameters after the forward pass (ZeRO-3; False: keep them for the backward)
_C.DIST.FSDP_RESHARD_AFTER_FORWARD = True
# FSDP: keep parameters, gradients and optimizer state on the CPU (the optimizer step runs there)
_C.DIST.CPU_OFFLOAD = False
# FSDP checkpoints: 'full' (one .pth like ddp's, gathered on rank 0) or 'sharded' (a torch.distributed.checkpoint folder)
_C.DIST.FSDP_STATE_DICT = "full"
# DDP: gradients are views into the all-reduce buckets (saves one copy of the gradients)
_C.DIST.GRADIENT_AS_BUCKET_VIEW = False
# DDP: the graph is the same every step (lets DDP skip per-step bookkeeping)
_C.DIST.STATIC_GRAPH = False
# DDP: allow parameters that get no gradient in a step (costs an extra graph traversal)
_C.DIST.FIND_UNUSED_PARAMETERS = False

# ---------------------------------------------------------------------------------------------
# Run-level options
# ---------------------------------------------------------------------------------------------
# Output folder: config.yaml, log.txt, metrics.jsonl, checkpoints/; one train run at a time (run.lock)
_C.OUT_DIR = "./exp"
# File name of the full config written into OUT_DIR
_C.CFG_DEST = "config.yaml"
# Seed of every RNG (None: a fresh random seed, logged so the run can be repeated)
_C.RNG_SEED = None
# Device: 'auto' (CUDA when available, else CPU), 'cpu' or 'cuda'
_C.DEVICE = "auto"
# Intra-op CPU threads per process (0: the machine's cores / processes on this node)
_C.NUM_THREADS = 0

# Keys whose default is None, and the type a value given for them must have.
_NULLABLE_TYPES: dict[str, type] = {"MODEL.WEIGHTS": str, "RNG_SEED": int}

LR_POLICIES = ("cos", "steps", "linear", "constant")
AMP_MODES = ("off", "bf16", "fp16")
OPTIMIZERS = ("sgd", "adamw", "lamb", "lars")
BEST_METRICS = ("top1", "ema_top1")
LR_SCALINGS = ("none", "linear")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "nccl", "gloo")
STRATEGIES = ("ddp", "zero1", "fsdp", "dp")
AUTO_AUGMENTS = ("none", "randaugment", "trivialaugment", "autoaugment")
FSDP_STATE_DICTS = ("full", "sharded")
NONFINITE_MODES = ("skip", "stop", "off")
BAD_IMAGE_MODES = ("skip", "fail")
DUPLICATE_IMAGE_MODES = ("fail", "keep")
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT")
# What a run writes into OUT_DIR itself (CFG_DEST must not replace one of them)
RUN_FOLDER_NAMES = ("checkpoints", "log.txt", "metrics.jsonl", "metrics.csv", "tb", "config_diff.yaml",
                    "env.json", "model.txt", "run.lock", "plots", "bench", "export")


def get_defaults() -> CN:
    """A fresh, mutable copy of the default config."""
    return _C.clone()


def _flatten(node: CN, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        full = f"{prefix}{key}"
        if isinstance(value, CN):
            out.update(_flatten(value, full + "."))
        else:
            out[full] = value
    return out


def _flatten_plain(data: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in data.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict):
            out.extend(_flatten_plain(value, full + "."))
        else:
            out.append((full, value))
    return out


def _type_name(t: type) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list"}.get(t, t.__name__)


def _coerce(key: str, value: Any, default: Any, source: str) -> Any:
    """Return value converted to the type of the key's default, or raise UserError."""
    expected = _NULLABLE_TYPES.get(key, type(default))
    if value is None:
        if key in _NULLABLE_TYPES:
            return None
        raise UserError(f"config key {key} cannot be None ({source}); expected {_a(_type_name(expected))}")
    if expected is tuple:
        expected = list
    if isinstance(value, tuple):
        value = list(value)
    ok = isinstance(value, expected)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True  # 1 is a fine float
    if expected is int and isinstance(value, bool):
        ok = False  # True is not a count
    if expected is str and key in _NULLABLE_TYPES and isinstance(value, str) and value.lower() in ("none", "null", ""):
        return None
    if not ok:
        raise UserError(
            f"config key {key} expects {_a(_type_name(expected))}, got {value!r} "
            f"({_type_name(type(value))}) from {source}"
        )
    return value


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _parse_literal(text: str) -> Any:
    """Command-line values are Python literals; anything else is a plain string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _set(cfg: CN, pairs: Iterable[tuple[str, Any]], source: str) -> None:
    known = _flatten(_C)
    for key, value in pairs:
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else " (run `distribuuuu config` to list the keys)"
            raise UserError(f"unknown config key {key}{hint} in {source}")
        value = _coerce(key, value, known[key], source)
        node = cfg
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value


# Byte-order marks and their codecs; the UTF-32 ones first (UTF-32 LE's begins with UTF-16 LE's).
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
_MAX_CFG_BYTES = 16 << 20  # far above any config; a bigger --cfg is some other file
# Leading bytes of files that users pass to --cfg by mistake
_MAGIC = ((b"PK\x03\x04", "a zip archive (a PyTorch checkpoint?)"), (b"\x80", "a pickle (a PyTorch checkpoint?)"),
          (b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"\x1f\x8b", "gzip data"),
          (b"\x7fELF", "a program"))


def _looks_like(raw: bytes) -> str:
    """A guess at what a file that is not UTF-8 YAML text is, for the error message."""
    for magic, what in _MAGIC:
        if raw.startswith(magic):
            return what
    head = raw[:4096]
    if len(head) >= 4 and head[1::2].count(0) > len(head) // 4:
        return "UTF-16 text without a byte-order mark"
    return "binary data" if b"\x00" in head else "text in another encoding (e.g. Latin-1)"


def _read_text(path: str) -> str:
    """The text of a config file: UTF-8, or UTF-8/16/32 with a byte-order mark (what Windows
    editors and PowerShell's `>` write). Anything else is a UserError saying what it looks like."""
    with open(path, "rb") as f:
        raw = f.read(_MAX_CFG_BYTES + 1)
    fix = "save it as UTF-8 text, or pass a YAML file such as config/resnet18.yaml"
    if len(raw) > _MAX_CFG_BYTES:
        raise UserError(f"config file {path!r} is larger than {_MAX_CFG_BYTES >> 20} MiB, so it is not a YAML "
                        f"config (it looks like {_looks_like(raw)}); pass a YAML file such as config/resnet18.yaml")
    codec = next((c for bom, c in _BOMS if raw.startswith(bom)), "utf-8")
    try:
        text = raw.decode(codec)
    except UnicodeDecodeError as e:
        raise UserError(f"config file {path!r} is not {codec.upper().replace('-SIG', '')} YAML text (byte "
                        f"0x{raw[e.start]:02x} at offset {e.start}; it looks like {_looks_like(raw)}); {fix}") from None
    if "\x00" in text:  # valid UTF-8, but YAML text never holds NUL: UTF-16 without a BOM, or binary
        raise UserError(f"config file {path!r} is not UTF-8 YAML text (NUL bytes; it looks like "
                        f"{_looks_like(raw)}); {fix}")
    return text


def merge_file(cfg: CN, path: str) -> None:
    """Merge a YAML file into cfg, checking every key and type."""
    if os.path.isdir(path):
        raise UserError(f"config file {path!r} is a folder; pass --cfg with a YAML file such as config/resnet18.yaml")
    if not os.path.isfile(path):
        raise UserError(f"config file {path!r} does not exist; pass --cfg with a YAML file such as config/resnet18.yaml")
    text = _read_text(path)
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise UserError(f"config file {path!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path!r} must hold a mapping of KEY: value, not {type(data).__name__}")
    _set(cfg, _flatten_plain(data), f"config file {path}")


def merge_opts(cfg: CN, opts: list[str]) -> None:
    """Merge a ``KEY VALUE KEY VALUE ...`` list; values are parsed as Python literals."""
    if len(opts) % 2:
        raise UserError(
            f"overrides come in KEY VALUE pairs, but {len(opts)} words were given: {' '.join(opts)!r}"
        )
    pairs = [(opts[i], _parse_literal(opts[i + 1])) for i in range(0, len(opts), 2)]
    _set(cfg, pairs, "the command line")


def validate(cfg: CN) -> None:
    """Semantic checks that need more than the type of one key."""
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise UserError(msg)

    for key in ("MODEL.NUM_CLASSES", "TRAIN.BATCH_SIZE", "TRAIN.IM_SIZE", "TEST.BATCH_SIZE",
                "TEST.IM_SIZE", "TRAIN.PRINT_FREQ", "TEST.PRINT_FREQ", "TRAIN.TOPK",
                "OPTIM.MAX_EPOCH", "MODEL.IN_CHANS", "TRAIN.SYNTHETIC_SAMPLES",
                "TEST.SYNTHETIC_SAMPLES", "TRAIN.EVAL_PERIOD", "OPTIM.REF_BATCH_SIZE", "DIST.TIMEOUT_S",
                "TRAIN.REPEATED_AUG"):
        value = _get(cfg, key)
        need(value > 0, f"config key {key} must be positive, got {value}")
    for key in ("TRAIN.CKPT_PERIOD_STEPS", "TRAIN.CKPT_PERIOD_MIN", "TRAIN.NONFINITE_MAX_SKIPS",
                "TRAIN.WORKERS", "TRAIN.CKPT_KEEP", "NUM_THREADS", "OPTIM.WEIGHT_DECAY",
                "OPTIM.WARMUP_EPOCHS", "OPTIM.DAMPENING", "DIST.BUCKET_CAP_MB", "TRAIN.VAL_SPLIT",
                "DIST.VOTE_PERIOD_STEPS"):
        value = _get(cfg, key)
        need(value >= 0, f"config key {key} must be >= 0, got {value}")
    need(cfg.TRAIN.TOPK <= cfg.MODEL.NUM_CLASSES,
         f"TRAIN.TOPK ({cfg.TRAIN.TOPK}) must be <= MODEL.NUM_CLASSES ({cfg.MODEL.NUM_CLASSES})")
    need(cfg.OPTIM.BASE_LR > 0, f"OPTIM.BASE_LR must be positive, got {cfg.OPTIM.BASE_LR}")
    need(0.0 <= cfg.OPTIM.MIN_LR <= 1.0,
         f"OPTIM.MIN_LR is a fraction of the base LR and must be in [0, 1], got {cfg.OPTIM.MIN_LR}")
    need(0.0 <= cfg.OPTIM.MOMENTUM < 1.0, f"OPTIM.MOMENTUM must be in [0, 1), got {cfg.OPTIM.MOMENTUM}")
    need(0.0 < cfg.OPTIM.WARMUP_FACTOR <= 1.0,
         f"OPTIM.WARMUP_FACTOR must be in (0, 1], got {cfg.OPTIM.WARMUP_FACTOR}")
    if cfg.OPTIM.NESTEROV:
        need(cfg.OPTIM.MOMENTUM > 0 and cfg.OPTIM.DAMPENING == 0,
             "OPTIM.NESTEROV True needs OPTIM.MOMENTUM > 0 and OPTIM.DAMPENING 0 "
             f"(got MOMENTUM {cfg.OPTIM.MOMENTUM}, DAMPENING {cfg.OPTIM.DAMPENING})")
    need(cfg.OPTIM.LR_POLICY in LR_POLICIES,
         f"OPTIM.LR_POLICY must be one of {', '.join(LR_POLICIES)}, got {cfg.OPTIM.LR_POLICY!r}")
    if cfg.OPTIM.LR_POLICY == "steps":
        steps = list(cfg.OPTIM.STEPS)
        need(len(steps) > 0 and steps[0] == 0,
             f"OPTIM.STEPS must start at 0 for the 'steps' policy (e.g. [0, 30, 60, 90]), got {steps}")
        need(all(isinstance(s, (int, float)) for s in steps), f"OPTIM.STEPS must hold numbers, got {steps}")
        need(steps == sorted(steps) and len(set(steps)) == len(steps),
             f"OPTIM.STEPS must be strictly increasing, got {steps}")
        need(steps[-1] < cfg.OPTIM.MAX_EPOCH,
             f"OPTIM.STEPS must lie below OPTIM.MAX_EPOCH ({cfg.OPTIM.MAX_EPOCH}), got {steps}")
    need(cfg.OPTIM.LR_SCALING in LR_SCALINGS,
         f"OPTIM.LR_SCALING must be one of {', '.join(LR_SCALINGS)}, got {cfg.OPTIM.LR_SCALING!r}")
    for key, allowed in (("TRAIN.AMP", AMP_MODES), ("OPTIM.OPTIMIZER", OPTIMIZERS), ("DIST.STRATEGY", STRATEGIES),
                         ("TRAIN.DATA_PIPELINE", ("auto", "memory", "loader")), ("TRAIN.IMAGE_DECODE", ("fast", "pil")),
                         ("TRAIN.BEST_METRIC", BEST_METRICS), ("TRAIN.AUTO_AUGMENT", AUTO_AUGMENTS),
                         ("DIST.FSDP_STATE_DICT", FSDP_STATE_DICTS)):
        need(_get(cfg, key) in allowed, f"{key} must be one of {', '.join(allowed)}, got {_get(cfg, key)!r}")
    known = _flatten(get_defaults())
    for key in cfg.TRAIN.RESUME_ALLOW:
        need(isinstance(key, str) and key in known,
             f"TRAIN.RESUME_ALLOW names {key!r}, which is not a config key (write full names such as OPTIM.BASE_LR)")
    need(cfg.TRAIN.ACCUM_STEPS >= 1, f"TRAIN.ACCUM_STEPS must be at least 1, got {cfg.TRAIN.ACCUM_STEPS}")
    need(0.0 <= cfg.TRAIN.EMA_DECAY < 1.0, f"TRAIN.EMA_DECAY must be in [0, 1), got {cfg.TRAIN.EMA_DECAY}")
    need(cfg.TRAIN.BEST_METRIC != "ema_top1" or cfg.TRAIN.EMA_DECAY > 0,
         "TRAIN.BEST_METRIC ema_top1 needs an EMA: set TRAIN.EMA_DECAY (e.g. 0.9998)")
    need(0.0 <= cfg.TRAIN.LABEL_SMOOTHING < 1.0,
         f"TRAIN.LABEL_SMOOTHING must be in [0, 1), got {cfg.TRAIN.LABEL_SMOOTHING}")
    mixing = cfg.TRAIN.MIXUP_ALPHA > 0 or cfg.TRAIN.CUTMIX_ALPHA > 0
    need(not mixing or cfg.TRAIN.BATCH_SIZE % 2 == 0,
         f"mixup/cutmix pair samples within a batch: TRAIN.BATCH_SIZE must be even, got {cfg.TRAIN.BATCH_SIZE}")
    for key in ("TRAIN.CLIP_GRAD_NORM", "TRAIN.MIXUP_ALPHA", "TRAIN.CUTMIX_ALPHA", "TRAIN.PATIENCE",
                "TRAIN.TARGET_TOP1"):
        need(_get(cfg, key) >= 0, f"config key {key} must be >= 0, got {_get(cfg, key)}")
    need(0 <= cfg.TRAIN.RANDAUG_MAGNITUDE <= 30,
         f"TRAIN.RANDAUG_MAGNITUDE must be in [0, 30], got {cfg.TRAIN.RANDAUG_MAGNITUDE}")
    need(0.0 <= cfg.TRAIN.RANDOM_ERASE <= 1.0, f"TRAIN.RANDOM_ERASE is a probability in [0, 1], got {cfg.TRAIN.RANDOM_ERASE}")
    split = cfg.TRAIN.VAL_SPLIT
    need(split < 1 or split == int(split),
         f"TRAIN.VAL_SPLIT is a fraction below 1 (e.g. 0.1) or a whole number of images (e.g. 500), got {split}")
    fsdp = cfg.DIST.STRATEGY == "fsdp"
    need(not cfg.DIST.CPU_OFFLOAD or fsdp, "DIST.CPU_OFFLOAD True needs DIST.STRATEGY fsdp "
         f"(got {cfg.DIST.STRATEGY!r}); ddp and zero1 keep everything on the device")
    need(not fsdp or cfg.TRAIN.EMA_DECAY == 0, "TRAIN.EMA_DECAY needs whole parameters on every rank, which "
         "DIST.STRATEGY fsdp does not keep; use DIST.STRATEGY ddp or zero1 with EMA, or TRAIN.EMA_DECAY 0")
    need(not fsdp or cfg.TRAIN.AMP != "fp16", "DIST.STRATEGY fsdp supports TRAIN.AMP off or bf16 "
         "(fp16 needs a sharded gradient scaler); use TRAIN.AMP bf16")
    need(cfg.TRAIN.BAD_IMAGES in BAD_IMAGE_MODES,
         f"TRAIN.BAD_IMAGES must be one of {', '.join(BAD_IMAGE_MODES)}, got {cfg.TRAIN.BAD_IMAGES!r}")
    need(cfg.TRAIN.DUPLICATE_IMAGES in DUPLICATE_IMAGE_MODES, "TRAIN.DUPLICATE_IMAGES must be one of "
         f"{', '.join(DUPLICATE_IMAGE_MODES)}, got {cfg.TRAIN.DUPLICATE_IMAGES!r}")
    need(cfg.TRAIN.NONFINITE in NONFINITE_MODES,
         f"TRAIN.NONFINITE must be one of {', '.join(NONFINITE_MODES)}, got {cfg.TRAIN.NONFINITE!r}")
    bad = [s for s in cfg.TRAIN.PREEMPT_SIGNALS if s not in PREEMPT_SIGNALS]
    need(not bad, f"TRAIN.PREEMPT_SIGNALS may hold {', '.join(PREEMPT_SIGNALS)}, got {bad}")
    need(cfg.DEVICE in DEVICES, f"DEVICE must be one of {', '.join(DEVICES)}, got {cfg.DEVICE!r}")
    need(cfg.DIST.BACKEND in BACKENDS,
         f"DIST.BACKEND must be one of {', '.join(BACKENDS)}, got {cfg.DIST.BACKEND!r}")
    need(not (cfg.DIST.BACKEND == "nccl" and cfg.DEVICE == "cpu"),
         "DIST.BACKEND nccl needs GPUs, but DEVICE is cpu; use DIST.BACKEND gloo or auto")
    need(cfg.MODEL.ARCH.strip() != "", "MODEL.ARCH must name a model, e.g. resnet18")
    need(cfg.OUT_DIR.strip() != "", "OUT_DIR must be a folder path, e.g. ./exp")
    need(cfg.CFG_DEST.strip() != "" and os.sep not in cfg.CFG_DEST and cfg.CFG_DEST not in (".", ".."),
         f"CFG_DEST {cfg.CFG_DEST!r} must be a plain file name inside OUT_DIR, such as config.yaml")
    need(cfg.CFG_DEST not in RUN_FOLDER_NAMES,
         f"CFG_DEST {cfg.CFG_DEST!r} is a name the run folder uses for something else; "
         "use a name such as config.yaml")
    for key in ("TRAIN.DATASET", "TEST.DATASET"):
        need(_get(cfg, key).strip() != "", f"{key} must be a folder path or one of mnist5k, synthetic")


def _get(cfg: CN, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def load_config(cfg_file: str | None = None, opts: list[str] | None = None) -> CN:
    """Defaults, then the file, then the overrides; validated and frozen."""
    cfg = get_defaults()
    if cfg_file:
        merge_file(cfg, cfg_file)
    merge_opts(cfg, list(opts or []))
    validate(cfg)
    cfg.freeze()
    return cfg


def diff_from_defaults(cfg: CN) -> dict[str, Any]:
    """Flat {KEY: value} of the keys whose value differs from the default."""
    defaults = _flatten(_C)
    return {k: v for k, v in _flatten(cfg).items() if defaults.get(k) != v}


def to_yaml(cfg: CN) -> str:
    return cfg.dump()


def dump_to_run_folder(cfg: CN, out_dir: str) -> None:
    """Write the full config (CFG_DEST) and the diff from the defaults (config_diff.yaml)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, cfg.CFG_DEST), "w") as f:
        f.write(to_yaml(cfg))
    nested: dict[str, Any] = {}
    for key, value in diff_from_defaults(cfg).items():
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    with open(os.path.join(out_dir, "config_diff.yaml"), "w") as f:
        yaml.safe_dump(nested, f, sort_keys=True)

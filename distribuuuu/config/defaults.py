"""The default config: one yacs tree, every key with a one-line comment
above it.

Every Distribuuuu key keeps its name, type, default and meaning, so
Distribuuuu's YAML files load unchanged. The checks that need more than
a key's type live in validate.py; ``get_defaults()`` (reading.py) hands
out a copy.
"""

from __future__ import annotations

from yacs.config import CfgNode as CN

_C = CN()

# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
_C.MODEL = CN()
# Architecture name: a torchvision model, a timm model, one of the
# aliases in models.py, or a function that an IMPORTS module registered
# with distribuuuu.models.register_model; 'auto' = a fine-tune's
# checkpoint card's, else resnet_tiny for a folder of images of 64 px or
# less on a CPU, else resnet18 (inferred/)
_C.MODEL.ARCH = "auto"
# Number of output classes (the size of the classifier head); 0 = the
# training data's class count (folders, CIFAR, shard sets, registered
# sources; 1000 for synthetic or dummy data); a value that differs is
# refused
_C.MODEL.NUM_CLASSES = 0
# Start from pretrained weights (never downloaded): True = MODEL.ARCH's
# file in torch.hub.get_dir()/checkpoints, or the path of a weights
# file; a head of another class count is re-initialised, the stem
# adapted (docs/recipes.md)
_C.MODEL.PRETRAINED = False
# Convert BatchNorm layers to SyncBatchNorm (statistics over the global
# batch; helps small per-GPU batches)
_C.MODEL.SYNCBN = False
# Path to a weights file (a checkpoint, a state dict .pt/.pth, or
# .safetensors) to load before training or evaluating (--checkpoint PATH
# of eval, predict, export); in training a classifier of another class
# count is re-initialised and a stem of other input channels (1 <-> 3)
# adapted (fine-tuning), elsewhere both refused
_C.MODEL.WEIGHTS = None
# Feed random tensors instead of real data (times the model alone;
# Distribuuuu's key)
_C.MODEL.DUMMY_INPUT = False
# Number of input channels (1 for grayscale models; data with other
# channel counts is converted); 0 = a fine-tune's card's, else from a
# folder's images (1 when most are grayscale), else TRAIN.MEAN's length,
# else 3
_C.MODEL.IN_CHANS = 0
# Replace the stride-4 ImageNet stem by a stride-1 3x3 conv for 28-32 px
# images (ResNet family)
_C.MODEL.SMALL_STEM = False
# Residual networks start with the last BatchNorm weight of each
# residual block at zero, so each block starts as the identity (Goyal et
# al., 2017; timm's zero_init_last; measured: docs/recipes.md); False:
# all at 1
_C.MODEL.ZERO_INIT_RESIDUAL = True

# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
_C.TRAIN = CN()
# Mini-batch size PER PROCESS; the global batch is BATCH_SIZE x world
# size
_C.TRAIN.BATCH_SIZE = 32
# Training crop size in pixels (RandomResizedCrop for folders, pad-crop
# for small built-in images); 0 = a fine-tune's card's, else a folder's
# typical image side, at least 32 (8 with MODEL.SMALL_STEM) and at most
# the model's default size (224 for resnet18), else 224
_C.TRAIN.IM_SIZE = 0
# Training data: a folder of class folders (<DATASET>/<SPLIT>/<class>/*, or <DATASET>/<class>/*),
# a label file (labels.csv, metadata.jsonl, ...), a Hugging Face dataset (a save_to_disk folder or
# Parquet files), a CIFAR folder, a shard set, or mnist5k / synthetic (docs/data-formats.md)
_C.TRAIN.DATASET = "./data/ILSVRC/"
# Sub-folder (or split name) of DATASET used for training; a folder of
# class folders without it is the split itself
_C.TRAIN.SPLIT = "train"
# The image column of a label file (a Hugging Face dataset's image feature; the image member of a
# tar's samples, e.g. jpg); '' = the usual names (a tar set: the field its index was made with)
_C.TRAIN.IMAGE_FIELD = ""
# The label column of a label file (a dataset's label feature; for tars cls or json:KEY, as
# `distribuuuu data index --label-field` indexed them); '' = the usual names
_C.TRAIN.LABEL_FIELD = ""
# Resume from OUT_DIR/checkpoints/last.pth when it exists; False starts
# afresh, and refuses an OUT_DIR that already holds a run (checkpoints
# or metrics records) rather than overwrite it
_C.TRAIN.AUTO_RESUME = True
# Config keys allowed to differ from the checkpoint's on resume beyond
# the safe ones (e.g. ["OPTIM.BASE_LR"]): the explicit request to change
# the recipe mid-run (see run_folder/resume_check.py)
_C.TRAIN.RESUME_ALLOW = []
# On resume, also restore the optimizer state (False: weights, epoch and
# schedule only)
_C.TRAIN.LOAD_OPT = True
# DataLoader worker processes per training process; -1 = what this
# process's cores allow (its CPU affinity / processes on this node, one
# core left to the process itself, at most 8); a value above both this
# process's cores and 8 is clamped to the larger, with a warning
_C.TRAIN.WORKERS = -1
# Shard sets: each loader worker reads this many consecutive samples at
# a time and yields them in a random order (per epoch; memory: this x
# the mean record size per worker); 1 = stream order only
_C.TRAIN.SHARD_SHUFFLE = 1000
# Pin host memory of batches (only has an effect with CUDA)
_C.TRAIN.PIN_MEMORY = True
# Print a progress line every PRINT_FREQ iterations (rank 0 only; also
# after the first step and every 10 s)
_C.TRAIN.PRINT_FREQ = 30
# The k of the top-k accuracy reported next to top-1 (clamped below
# MODEL.NUM_CLASSES: top-k of k is always 100%)
_C.TRAIN.TOPK = 5
# Unreadable image files: 'skip' (log, count, use the next readable one)
# or 'fail' (stop the run)
_C.TRAIN.BAD_IMAGES = "skip"
# The same real image file listed twice in a folder split (through
# symlinks): 'fail' (stop before training, naming them) or 'keep' (every
# listed path is a sample, as ImageFolder does: oversampling)
_C.TRAIN.DUPLICATE_IMAGES = "fail"
# TEST.DATASET images also in TRAIN.DATASET (hard link, symlink or same
# bytes; image folders): 'warn', 'error', 'off'
_C.TRAIN.OVERLAP = "warn"
# Number of samples of the synthetic training set (TRAIN.DATASET
# synthetic)
_C.TRAIN.SYNTHETIC_SAMPLES = 1024
# Evaluate on the val split every EVAL_PERIOD epochs (and always after
# the last epoch)
_C.TRAIN.EVAL_PERIOD = 1
# Keep the newest CKPT_KEEP per-epoch (and per-step) checkpoints
# (last.pth and best.pth are kept besides)
_C.TRAIN.CKPT_KEEP = 3
# Also checkpoint every CKPT_PERIOD_STEPS optimizer steps, mid-epoch (0:
# only at epoch ends)
_C.TRAIN.CKPT_PERIOD_STEPS = 0
# Also checkpoint every CKPT_PERIOD_MIN minutes of wall time, mid-epoch
# (0: off)
_C.TRAIN.CKPT_PERIOD_MIN = 0.0
# Non-finite loss or gradients: 'skip' the step (it leaves no trace;
# decided on the device with SGD/AdamW), 'stop' the run, or 'off' (no
# check per step; an epoch whose loss is not finite still ends the run).
# Ending the run is exit status 2
_C.TRAIN.NONFINITE = "skip"
# With NONFINITE 'skip': stop the run after more than this many
# non-finite steps in a row
_C.TRAIN.NONFINITE_MAX_SKIPS = 10
# Signals that mean "checkpoint now and exit" (preemption), e.g. Slurm's
# --signal=USR1@90
_C.TRAIN.PREEMPT_SIGNALS = ["SIGTERM", "SIGUSR1"]
# Under Slurm, after a preemption checkpoint rank 0 runs `scontrol
# requeue $SLURM_JOB_ID`
_C.TRAIN.REQUEUE = False

# Mixed precision: 'off', 'bf16' (autocast; also on CPU) or 'fp16'
# (autocast + GradScaler; CUDA)
_C.TRAIN.AMP = "off"
# Keep activations in channels_last memory format (faster convolutions
# on recent GPUs)
_C.TRAIN.CHANNELS_LAST = False
# Compile the model with torch.compile (compile time is logged apart,
# not counted as throughput)
_C.TRAIN.COMPILE = False
# torch.compile's backend: inductor (generates fused code), or aot_eager
# / eager (checks that the model compiles, without code generation:
# seconds instead of minutes on a CPU), cudagraphs
_C.TRAIN.COMPILE_BACKEND = "inductor"
# Gradient accumulation: micro-batches per optimizer step (global batch
# = BATCH_SIZE x world x ACCUM_STEPS)
_C.TRAIN.ACCUM_STEPS = 1
# Clip the global gradient norm to this value (0: no clipping)
_C.TRAIN.CLIP_GRAD_NORM = 0.0
# Label smoothing of the cross-entropy loss (0: none)
_C.TRAIN.LABEL_SMOOTHING = 0.0
# Mixup alpha (0: off); with mixup/cutmix, top-1 is still counted
# against the hard labels
_C.TRAIN.MIXUP_ALPHA = 0.0
# CutMix alpha (0: off)
_C.TRAIN.CUTMIX_ALPHA = 0.0
# Automatic augmentation policy (torchvision v2): 'none', 'randaugment',
# 'trivialaugment' or 'autoaugment' (ImageNet policy)
_C.TRAIN.AUTO_AUGMENT = "none"
# RandAugment magnitude (0-30, 2 operations per image) for
# TRAIN.AUTO_AUGMENT randaugment
_C.TRAIN.RANDAUG_MAGNITUDE = 9
# Random erasing: probability per training image of erasing one random
# rectangle (0: off; timm uses 0.25)
_C.TRAIN.RANDOM_ERASE = 0.0
# Repeated augmentation: each image is drawn this many times per epoch,
# on different ranks (1: off; 3 in DeiT)
_C.TRAIN.REPEATED_AUG = 1
# Imbalanced classes: 'none', 'sampler' (every class drawn equally
# often) or 'loss' (inverse-size class weights)
_C.TRAIN.CLASS_BALANCE = "none"
# Recompute each block's activations in the backward pass instead of
# storing them (less memory, more compute)
_C.TRAIN.ACTIVATION_CHECKPOINTING = False
# Hold out this fraction (< 1) or number (>= 1) of the training set,
# stratified by class, as the validation split (0: none). Then best.pth
# and early stopping use it, and TEST is the test set, evaluated once at
# the end. A folder of class folders (no SPLIT/ in it) with TEST.DATASET
# unset: 0.1, that held-out part is the val set
_C.TRAIN.VAL_SPLIT = 0.0
# EMA of the weights: decay per step at OPTIM.REF_BATCH_SIZE (0: no
# EMA); the decay used is EMA_DECAY ** (global batch / REF_BATCH_SIZE),
# so the average spans the same number of samples
_C.TRAIN.EMA_DECAY = 0.0
# The weights whose evaluations pick best.pth and drive early stopping:
# 'top1' (the model's) or 'ema_top1' (the EMA's); judged by balanced
# top-1 (the mean of the per-class top-1), ties broken by the lower val
# loss, then the later epoch
_C.TRAIN.BEST_METRIC = "top1"
# Stop after PATIENCE evaluations in the second half of the run without
# progress: a better balanced top-1 or a 1% lower val loss (0: never;
# -1: 5 when OPTIM.MAX_EPOCH is from the data, else 0)
_C.TRAIN.PATIENCE = -1
# Stop once val top-1 reaches this (percent; 0: never); the time to
# reach it is logged
_C.TRAIN.TARGET_TOP1 = 0.0
# Freeze the backbone (every parameter but the classifier; its BatchNorm
# statistics too) for the first N epochs (-1: for good; 0: never)
_C.TRAIN.FREEZE_BACKBONE_EPOCHS = 0
# Extra training hooks, "package.module:ClassName" (a
# distribuuuu.engine.HookBase made with no arguments)
_C.TRAIN.HOOKS = []
# Experiment trackers that get the run (rank 0;
# distribuuuu/trackers.py): [] or any of "mlflow", "wandb", each
# installed as an extra (pip install "distribuuuu[mlflow]"); offline
# into OUT_DIR unless MLFLOW_TRACKING_URI / WANDB_MODE say otherwise; a
# resumed run continues the same tracker run
_C.TRAIN.TRACKERS = []
# Also send best.pth and last.pth to the trackers as files when the run
# finishes (off: their paths only, as tags)
_C.TRAIN.TRACKER_CHECKPOINTS = False
# Seconds a tracker may take to start (a server that refuses or does
# not answer is tried again until then; then exit 2): widen it for a
# slow or restarting server
_C.TRAIN.TRACKER_START_S = 10.0

# Input pipeline (train and val): 'auto' (in memory for mnist5k and
# CIFAR up to 2 GiB per process, else DataLoader), 'memory' (the whole
# set as one tensor on the device, batched augmentation; not for
# folders) or 'loader'
_C.TRAIN.DATA_PIPELINE = "auto"
# Image folders and shards: 'fast' (libjpeg-turbo decode, reduced-size
# JPEG decoding when the crop allows, uint8 batches normalized on the
# device), 'pil' (torchvision's per-sample PIL recipe), 'gpu' (the
# workers crop, JPEGs decoded a batch at a time on the device:
# docs/performance.md) or 'auto' (gpu on CUDA when the CPU cannot keep
# up with the model, measured; else fast)
_C.TRAIN.IMAGE_DECODE = "fast"
# Data recipe (docs/recipes.md): RandomResizedCrop area range of
# training crops; [] = the source's own (pad-and-crop for mnist5k, CIFAR
# and a TensorSource, replaced when set); a folder decides: 0.8-1 for
# images smaller than the model's default size, else 0.08-1
_C.TRAIN.CROP_SCALE = []
# Aspect ratio range (w/h) of training crops whenever RandomResizedCrop
# is used
_C.TRAIN.CROP_RATIO = [0.75, 1.3333333333333333]
# Horizontal flip probability in training; -1 = the source's own (0.5
# for CIFAR, 0 for mnist5k); a folder decides: 0 for images smaller than
# the model's default size (often glyphs: digits, letters, signs), else
# 0.5
_C.TRAIN.FLIP_PROB = -1.0
# Interpolation of train crops and eval resizes: nearest, bilinear,
# bicubic; '' = bilinear (a pretrained timm model's)
_C.TRAIN.INTERPOLATION = ""
# Normalization mean per channel (one per MODEL.IN_CHANS); [] = the
# source's; a folder decides: a seeded sample of its images' for images
# smaller than the model's default size, else ImageNet's (a fine-tune:
# the card's)
_C.TRAIN.MEAN = []
# Normalization std per channel (one per MODEL.IN_CHANS); [] = the
# source's; a folder decides as TRAIN.MEAN
_C.TRAIN.STD = []

# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------
_C.TEST = CN()
# Validation data: a folder path, a CIFAR folder, a shard set, or
# mnist5k / synthetic; '' = TRAIN.DATASET (its TEST.SPLIT; for a folder
# of class folders, the part TRAIN.VAL_SPLIT holds out). A --cfg file's
# value is dropped (so it follows) when the command line gives another
# TRAIN.DATASET and no TEST.DATASET
_C.TEST.DATASET = ""
# Sub-folder (or split name) of DATASET used for validation
_C.TEST.SPLIT = "val"
# Mini-batch size per process for evaluation
_C.TEST.BATCH_SIZE = 200
# Resize the shorter side to IM_SIZE, then center-crop TRAIN.IM_SIZE
# (folders, shards; TEST.CROP_PCT overrides); 0 = follow TRAIN.IM_SIZE:
# TRAIN.IM_SIZE / 0.875 (256 for 224)
_C.TEST.IM_SIZE = 0
# Eval center-crop fraction: resize the shorter side to TRAIN.IM_SIZE /
# CROP_PCT (folders); 0 = use TEST.IM_SIZE
_C.TEST.CROP_PCT = 0.0
# Print an evaluation progress line every PRINT_FREQ iterations (rank 0
# only)
_C.TEST.PRINT_FREQ = 10
# Number of samples of the synthetic validation set (TEST.DATASET
# synthetic)
_C.TEST.SYNTHETIC_SAMPLES = 256
# eval: a folder for confusion.csv (rows: true class, columns:
# predicted); '' for none (eval --out DIR)
_C.TEST.OUT_DIR = ""

# ---------------------------------------------------------------------------------------------
# cuDNN
# ---------------------------------------------------------------------------------------------
_C.CUDNN = CN()
# Let cuDNN pick the fastest convolution algorithms (fixed input sizes)
_C.CUDNN.BENCHMARK = True
# Ask cuDNN and torch for deterministic algorithms (slower; overrides
# BENCHMARK)
_C.CUDNN.DETERMINISTIC = False
# TF32 for float32 matmuls and convolutions on Ampere and newer GPUs
# (faster, 10-bit mantissa; False: full fp32)
_C.CUDNN.TF32 = True

# ---------------------------------------------------------------------------------------------
# Optimizer and learning-rate schedule (SGD)
# ---------------------------------------------------------------------------------------------
_C.OPTIM = CN()
# Number of training epochs; 0 = from the data: about 20,000 training
# images seen, 10 to 100 epochs (inferred/length.py)
_C.OPTIM.MAX_EPOCH = 0
# LR policy: 'cos' (half-period cosine), 'steps' (x LR_MULT at each of
# STEPS), 'linear' (to MIN_LR), 'constant'
_C.OPTIM.LR_POLICY = "cos"
# Base learning rate (used as is, or scaled by the global batch when
# LR_SCALING is 'linear')
_C.OPTIM.BASE_LR = 0.1
# Final learning rate of the cosine policy, as a fraction of the base
# learning rate
_C.OPTIM.MIN_LR = 0.0
# Epochs at which the 'steps' policy multiplies the LR by LR_MULT
# (sorted, starting at 0)
_C.OPTIM.STEPS = []
# Optimizer: 'sgd' (torch, with MOMENTUM/DAMPENING/NESTEROV), 'adamw',
# 'lamb' or 'lars' (timm's)
_C.OPTIM.OPTIMIZER = "sgd"
# Exempt normalization weights and biases from weight decay
_C.OPTIM.NO_WD_NORM_BIAS = False
# LR of the backbone (every parameter but the classifier) as a fraction
# of the LR (1.0: one LR for all)
_C.OPTIM.BACKBONE_LR_SCALE = 1.0
# Multiplier applied at each step of the 'steps' policy
_C.OPTIM.LR_MULT = 0.1
# SGD momentum
_C.OPTIM.MOMENTUM = 0.9
# SGD dampening (must be 0 with Nesterov momentum)
_C.OPTIM.DAMPENING = 0.0
# Use Nesterov momentum
_C.OPTIM.NESTEROV = True
# The LR starts at WARMUP_FACTOR x LR and rises linearly to LR over
# WARMUP_EPOCHS
_C.OPTIM.WARMUP_FACTOR = 0.1
# Length of the linear warmup in epochs (a float: may be fractional, 5
# reads as 5.0; 0 disables it); the LR reaches its peak at its end. One
# over half of OPTIM.MAX_EPOCH is shortened to a fifth of the run,
# logged
_C.OPTIM.WARMUP_EPOCHS = 5.0
# L2 weight decay
_C.OPTIM.WEIGHT_DECAY = 5e-5
# 'none': the LR is BASE_LR; 'linear': BASE_LR x global batch /
# REF_BATCH_SIZE (Goyal et al., 2017)
_C.OPTIM.LR_SCALING = "none"
# The global batch size at which BASE_LR was tuned (for the linear
# scaling rule)
_C.OPTIM.REF_BATCH_SIZE = 128

# ---------------------------------------------------------------------------------------------
# Distributed run
# ---------------------------------------------------------------------------------------------
_C.DIST = CN()
# Process-group backend: 'auto' (nccl on CUDA, gloo on CPU), 'nccl' or
# 'gloo'
_C.DIST.BACKEND = "auto"
# Seconds a collective may wait for the other ranks before the run is
# aborted
_C.DIST.TIMEOUT_S = 1800
# Ranks agree on stop signals and time-based checkpoints every
# VOTE_PERIOD_STEPS optimizer steps and at each epoch's end (one small
# gloo all-reduce per vote, benchmarks/vote_cost.py); 0: auto, every
# step with up to 8 processes, every 10 steps with more
_C.DIST.VOTE_PERIOD_STEPS = 0
# Data parallelism: 'ddp' (DistributedDataParallel), 'zero1' (DDP +
# optimizer state sharded with ZeroRedundancyOptimizer), 'fsdp' (FSDP2
# fully_shard: parameters, gradients and optimizer state sharded), or
# 'dp' (DataParallel over this machine's GPUs in ONE process)
_C.DIST.STRATEGY = "ddp"
# DDP gradient bucket size in MiB (0: torch's default of 25, with its
# small first bucket)
_C.DIST.BUCKET_CAP_MB = 0
# FSDP: free the gathered parameters after the forward pass (ZeRO-3;
# False: keep them for the backward)
_C.DIST.FSDP_RESHARD_AFTER_FORWARD = True
# FSDP: keep parameters, gradients and optimizer state on the CPU (the
# optimizer step runs there)
_C.DIST.CPU_OFFLOAD = False
# FSDP checkpoints: 'full' (one .pth like ddp's, gathered on rank 0) or
# 'sharded' (a torch.distributed.checkpoint folder)
_C.DIST.FSDP_STATE_DICT = "full"
# DDP: gradients are views into the all-reduce buckets (saves one copy
# of the gradients)
_C.DIST.GRADIENT_AS_BUCKET_VIEW = False
# DDP: the graph is the same every step (lets DDP skip per-step
# bookkeeping)
_C.DIST.STATIC_GRAPH = False
# DDP: allow parameters that get no gradient in a step (costs an extra
# graph traversal)
_C.DIST.FIND_UNUSED_PARAMETERS = False

# ---------------------------------------------------------------------------------------------
# Run-level options
# ---------------------------------------------------------------------------------------------
# Output folder: config.yaml, log.txt, metrics.jsonl, checkpoints/; one
# train run at a time (run.lock)
_C.OUT_DIR = "./exp"
# File name of the full config written into OUT_DIR
_C.CFG_DEST = "config.yaml"
# Seed of every RNG and of the shuffle (None: a fresh seed, logged and
# kept in env.json and checkpoints; resume keeps it)
_C.RNG_SEED = None
# Device: 'auto' (CUDA when available, else CPU), 'cpu' or 'cuda'
_C.DEVICE = "auto"
# Intra-op CPU threads per process (0: OMP_NUM_THREADS when set, else
# the cores free to this process: its CPU affinity (Slurm's
# --cpus-per-task) less the load average's share, split between the
# processes on this node; above this process's cores: clamped to them,
# with a warning)
_C.NUM_THREADS = 0
# Python modules imported in every process before the model and data are
# built (dotted names, or paths of .py files, stored as absolute paths),
# e.g. ['mypkg.models'] to register a model
# (distribuuuu.models.register_model or timm's) that MODEL.ARCH names,
# or a dataset source (distribuuuu.data.register_source)
_C.IMPORTS = []

# Keys whose default is None, and the type a value given for them must
# have.
NULLABLE_TYPES: dict[str, type] = {"MODEL.WEIGHTS": str, "RNG_SEED": int}
# Keys that take a value of either type (MODEL.PRETRAINED: True/False,
# or a file path).
EITHER_TYPES: dict[str, tuple[type, ...]] = {"MODEL.PRETRAINED": (bool, str)}

"""What the `distribuuuu` command shows its users: each command's line
in `distribuuuu --help`, its options (add_argument's arguments, as
data), the examples that end its --help, and what ``config --explain
KEY`` prints.

cli.py builds the parser from these tables, the chosen command's options
only; nothing here imports torch, or cli.py.
"""

from __future__ import annotations

import argparse
import re
from importlib import resources
from typing import Any

from distribuuuu.errors import UserError

Option = tuple[tuple[str, ...], dict[str, Any]]  # add_argument's (names, keywords)

_CFG_HELP = (
    "YAML config file, or a shipped config's name (`distribuuuu config --list`); default: none, "
)
CFG: Option = (
    ("--cfg",),
    dict(dest="cfg_file", default=None, help=_CFG_HELP + "the built-in defaults"),
)
# eval, predict, export: a checkpoint's stored config is the default
# (inference.load_config)
CFG_STORED: Option = (
    ("--cfg",),
    dict(
        dest="cfg_file",
        default=None,
        help=_CFG_HELP
        + (
            "the config stored in the checkpoint that MODEL.WEIGHTS names (else the built-in "
            "defaults)"
        ),
    ),
)
CHECKPOINT: Option = (
    ("--checkpoint",),
    dict(
        default=None,
        metavar="PATH",
        help=(
            "the checkpoint (or weights file) to use: the same as MODEL.WEIGHTS PATH (default: "
            "none, MODEL.WEIGHTS, else the checkpoint OUT_DIR's run chose)"
        ),
    ),
)
NPROC: Option = (
    ("--nproc-per-node", "--nproc_per_node"),
    dict(
        dest="nproc",
        default=None,
        help=(
            "start N processes on this machine with the built-in spawner ('auto': one per GPU, "
            "else one per CPU core); default: none, one process (or what torchrun / srun started)"
        ),
    ),
)
MASTER_PORT: Option = (
    ("--master-port", "--master_port"),
    dict(
        dest="master_port",
        type=int,
        default=None,
        help=(
            "with --nproc-per-node: the rendezvous port (default: MASTER_PORT if set, else a free "
            "one); a port in use is replaced by a free one"
        ),
    ),
)
# torch.distributed.launch passes --local-rank=N (or --local_rank); the
# rank is read from the environment instead (see
# launch.launcher.detect), so the value is accepted and ignored.
LOCAL_RANK: Option = (
    ("--local-rank", "--local_rank"),
    dict(dest="local_rank", default=None, help=argparse.SUPPRESS),
)
IMPORT: Option = (
    ("--import",),
    dict(
        dest="imports",
        action="append",
        default=None,
        metavar="MODULE",
        help=(
            "import MODULE (a dotted name or a .py file) in every process before the model and "
            "data are built, e.g. to register a timm model; repeatable, adds to IMPORTS (default: "
            "none beyond the config's IMPORTS)"
        ),
    ),
)
OPTS: Option = (
    ("opts",),
    dict(nargs=argparse.REMAINDER, help="KEY VALUE pairs overriding the config"),
)

BENCH_OPTIONS: list[Option] = [
    (
        ("--iters",),
        dict(
            type=int,
            default=20,
            help=(
                "timed iterations per measurement (the model's: at least this many calls' time, "
                "in blocks chosen by torch.utils.benchmark.Timer)"
            ),
        ),
    ),
    (("--warmup",), dict(type=int, default=3, help="untimed iterations first")),
    (
        ("--scaling",),
        dict(
            default=None,
            metavar="LIST",
            help=(
                "process counts such as 1,2,4: train the same short run with each (default: none, "
                "no scaling sweep)"
            ),
        ),
    ),
    (
        ("--compare",),
        dict(
            default=None,
            metavar="LIST",
            help=(
                "methods such as single,dp,ddp,ddp+amp: train the same short job each way "
                "(default: none, no comparison)"
            ),
        ),
    ),
    (
        ("--epochs",),
        dict(
            type=int,
            default=None,
            help=(
                "epochs of each run: --scaling times the last (default 1), --compare all but the "
                "first (default 2)"
            ),
        ),
    ),
    (
        ("--nproc",),
        dict(
            type=int,
            default=None,
            help=("--compare: processes of the ddp runs (default one per GPU, 2 on the CPU)"),
        ),
    ),
    (
        ("--global-batch",),
        dict(
            dest="global_batch",
            type=int,
            default=None,
            help=(
                "--compare: the batch of each optimizer step, split over the processes (default "
                "TRAIN.BATCH_SIZE)"
            ),
        ),
    ),
    (
        ("--amp",),
        dict(
            default="auto",
            choices=["auto", "bf16", "fp16"],
            help=(
                "--compare: autocast type of ddp+amp (auto: bf16 on CPU and on GPUs with native "
                "bf16, else fp16)"
            ),
        ),
    ),
    (
        ("--io",),
        dict(
            action="store_true",
            help=(
                "time the training data loader alone against the number of loader workers, image "
                "folder vs shards of the same images (io.csv, io.png)"
            ),
        ),
    ),
    (
        ("--workers",),
        dict(
            default=None,
            metavar="LIST",
            help=(
                "--io: loader worker counts such as 0,1,2 (default 0, then 1, 2, 4, ... up to the "
                "cores)"
            ),
        ),
    ),
    (
        ("--repeats",),
        dict(type=int, default=3, help="--io: timed stretches of --iters batches each"),
    ),
    (
        ("--io-shards",),
        dict(
            dest="io_shards",
            default=None,
            metavar="DIR",
            help=(
                "--io: keep the shards of a folder dataset in DIR and reuse them (default: none, "
                "written to a temporary folder and removed)"
            ),
        ),
    ),
    (
        ("--io-tars",),
        dict(
            dest="io_tars",
            default=None,
            metavar="DIR",
            help=(
                "--io: also time tars of the same images made by another tool and indexed by "
                "`distribuuuu data index DIR` (default: none)"
            ),
        ),
    ),
    (("--out",), dict(default=None, help="results folder (default OUT_DIR/bench)")),
]

# Each command: its line in `distribuuuu --help`, and its options in the
# order its --help lists them.
COMMANDS: dict[str, tuple[str, list[Option]]] = {
    "train": ("train a model", [CFG, NPROC, MASTER_PORT, LOCAL_RANK, IMPORT, OPTS]),
    "eval": (
        "evaluate a checkpoint (--checkpoint PATH) on the val split (without --cfg: with the "
        "config stored in the checkpoint)",
        [
            CFG_STORED,
            CHECKPOINT,
            NPROC,
            MASTER_PORT,
            LOCAL_RANK,
            IMPORT,
            (
                ("--out",),
                dict(
                    default=None,
                    metavar="DIR",
                    help=(
                        "also write confusion.csv (rows: true class, columns: predicted) into "
                        "DIR: the same as TEST.OUT_DIR DIR (default: none)"
                    ),
                ),
            ),
            OPTS,
        ],
    ),
    "config": (
        "print the merged, validated config as YAML",
        [
            (
                ("--list",),
                dict(
                    dest="list_shipped",
                    action="store_true",
                    help="list the shipped configs (usable as --cfg NAME) instead",
                ),
            ),
            (
                ("--explain",),
                dict(
                    default=None,
                    metavar="KEY",
                    help="print KEY's comment, type and default instead (default: none)",
                ),
            ),
            CFG,
            LOCAL_RANK,
            IMPORT,
            OPTS,
        ],
    ),
    "data": ("dataset utilities", []),  # its subcommands: DATA_COMMANDS
    "plot": (
        "learning-curve PNGs of one or more run folders",
        [
            (("run_dirs",), dict(nargs="+", metavar="RUN_DIR", help="OUT_DIR of a training run")),
            (
                ("--out",),
                dict(default=None, help="folder for the PNGs (default RUN_DIR/plots, or ./plots)"),
            ),
        ],
    ),
    "bench": (
        "time the model, the data loader and the step; --scaling sweeps processes",
        [CFG, LOCAL_RANK, IMPORT, OPTS, *BENCH_OPTIONS],
    ),
    "predict": (
        "top-k classes of image files, folders and globs (without --cfg: the checkpoint's config, "
        "class names and preprocessing)",
        [
            CFG_STORED,
            CHECKPOINT,
            LOCAL_RANK,
            IMPORT,
            (
                ("opts",),
                dict(
                    nargs=argparse.REMAINDER,
                    help=(
                        "KEY VALUE pairs overriding the config, and the images: files, folders, "
                        "'globs'"
                    ),
                ),
            ),
            (
                ("--model",),
                dict(
                    default=None,
                    metavar="FILE",
                    help=(
                        "run a file of `distribuuuu export` (model.pt2 or model.onnx) with the "
                        "card it carries, instead of a checkpoint (default: none)"
                    ),
                ),
            ),
            (("--topk",), dict(type=int, default=5, help="how many classes to print per image")),
            (
                ("--output",),
                dict(
                    default=None,
                    metavar="FILE",
                    help=(
                        "write the predictions to FILE, CSV or JSON by its suffix (preds.csv, "
                        "preds.json); default: none, a table on stdout"
                    ),
                ),
            ),
            (
                ("--format",),
                dict(
                    dest="fmt",
                    default=None,
                    choices=["csv", "json"],
                    help=(
                        "csv or json, whatever --output's suffix; without --output: to stdout "
                        "(default: from --output's suffix)"
                    ),
                ),
            ),
        ],
    ),
    "export": (
        "torch.export, ONNX and safetensors files of MODEL.WEIGHTS, checked, each with the model "
        "card (without --cfg: the checkpoint's config)",
        [
            CFG_STORED,
            CHECKPOINT,
            LOCAL_RANK,
            IMPORT,
            OPTS,
            (("--out",), dict(default=None, help="output folder (default OUT_DIR/export)")),
            (
                ("--format",),
                dict(
                    dest="fmt",
                    default=None,
                    metavar="LIST",
                    help=(
                        "comma-separated formats among pt2, onnx, safetensors and torchscript "
                        "(deprecated by torch: only when named) (default: pt2,onnx,safetensors; "
                        "onnx only when its extra is installed)"
                    ),
                ),
            ),
            (
                ("--tol",),
                dict(
                    type=float,
                    default=1e-4,
                    help="largest allowed |exported - eager| on the logits",
                ),
            ),
            (("--batch",), dict(type=int, default=4, help="batch size of the check")),
        ],
    ),
    "calibrate": (
        "fit MODEL.WEIGHTS' temperature on the validation split and write it into its model "
        "card (training does it at its end)",
        [CFG_STORED, CHECKPOINT, LOCAL_RANK, IMPORT, OPTS],
    ),
}

# `distribuuuu data ...`: export a built-in dataset as files, write tar
# shards, index tars made elsewhere.
DATA_COMMANDS: dict[str, tuple[str, list[Option]]] = {
    "export": (
        "write a dataset a package ships as an ImageFolder tree",
        [
            (
                ("source",),
                dict(
                    choices=["mnist5k", "digits", "faces"],
                    metavar="SOURCE",
                    help=(
                        "mnist5k (28x28), digits: scikit-learn's 1,797 8x8 digits (needs "
                        "scikit-learn), or faces: scikit-image's 200 25x25 gray crops of LFW "
                        "photos, faces and backgrounds (needs scikit-image)"
                    ),
                ),
            ),
            (
                ("dest",),
                dict(
                    help=(
                        "output folder (mnist5k: train/<class>/*.png and val/<class>/*.png; "
                        "digits, faces: <class>/*.png)"
                    )
                ),
            ),
        ],
    ),
    "shard": (
        "write an image folder (or mnist5k) as WebDataset tar shards + index.json "
        "(data/shards/write.py)",
        [
            (
                ("source",),
                dict(
                    metavar="SRC",
                    help=(
                        "an image folder (<class>/<image>), a dataset root holding train/ val/ "
                        "[test/], or mnist5k"
                    ),
                ),
            ),
            (
                ("dest",),
                dict(
                    metavar="DEST",
                    help="output folder: DEST/<split>/<split>-000000.tar ... + index.json",
                ),
            ),
            (
                ("--shard-size",),
                dict(
                    dest="shard_size",
                    default="256MB",
                    help=("largest shard, in bytes with K/M/G (a shard holds at least one image)"),
                ),
            ),
            (
                ("--shard-samples",),
                dict(
                    dest="shard_samples",
                    type=int,
                    default=None,
                    help=("at most this many images per shard (default: no limit)"),
                ),
            ),
            (
                ("--seed",),
                dict(
                    type=int,
                    default=0,
                    help="the one shuffle before writing (same seed, same bytes)",
                ),
            ),
        ],
    ),
    "index": (
        "write the index.json that WebDataset tars made by other tools need to be TRAIN.DATASET "
        "(data/shards/external.py)",
        [
            (
                ("source",),
                dict(
                    metavar="DIR",
                    help=(
                        "DIR/<split>/*.tar, DIR/*.tar (one split), or tars listed by timm's "
                        "DIR/_info.json; counts from _info.json or a wids index when there, else "
                        "read from the tar headers"
                    ),
                ),
            ),
            (
                ("--image-field",),
                dict(
                    dest="image_field",
                    default="",
                    metavar="EXT",
                    help=(
                        "the image member's extension, e.g. jpg or input.png (default: the first "
                        "of jpg, jpeg, png, webp, ... in each sample)"
                    ),
                ),
            ),
            (
                ("--label-field",),
                dict(
                    dest="label_field",
                    default="cls",
                    metavar="FIELD",
                    help=(
                        "the label: a member holding it as text (cls: the class index, "
                        "webdataset's convention), or json:KEY for a key of the .json member"
                    ),
                ),
            ),
        ],
    ),
    "split": (
        "the split a run held out (TRAIN.VAL_SPLIT), as DEST/train/ and DEST/val/ of links",
        [
            (("run_dir",), dict(metavar="RUN_DIR", help="OUT_DIR of a run (its heldout.txt)")),
            (
                ("dest",),
                dict(
                    metavar="DEST",
                    help=(
                        "a new or empty folder: DEST/{train,val}/<class>/ of absolute symlinks "
                        "to the run's images"
                    ),
                ),
            ),
        ],
    ),
}

# Options that take no value; every other --option takes one (or is
# written --option=value): cli.arrange.
FLAGS = frozenset({"--help", "-h", "--io", "--list"})

# The end of each subcommand's --help: commands that work as printed
# (the data from `data export`).
EXAMPLES: dict[str, str] = {
    "train": """examples:
  distribuuuu data export digits digits_folder   # a folder of class folders to try it on
  distribuuuu train TRAIN.DATASET digits_folder TRAIN.TARGET_TOP1 95
      (the model, classes, image size, recipe, val set and workers follow the data:
       see the setup lines, README)
  distribuuuu train --cfg mnist5k_fast --nproc-per-node 2 OUT_DIR runs/demo
  distribuuuu train --cfg my.yaml OPTIM.BASE_LR 0.05 --nproc-per-node 2   # options after pairs
  distribuuuu train --import my_models.py MODEL.ARCH my_net TRAIN.DATASET digits_folder""",
    "eval": """examples:
  distribuuuu eval --checkpoint runs/demo/checkpoints/best.pth
  distribuuuu eval --checkpoint best.pth TEST.DATASET other_images TEST.SPLIT test --out out/
  distribuuuu eval OUT_DIR runs/demo --nproc-per-node 2         # the run's best.pth""",
    "config": """examples:
  distribuuuu config --list                        # the shipped configs
  distribuuuu config --cfg mnist5k_fast            # a merged config, its unset keys decided
  distribuuuu config --explain MODEL.NUM_CLASSES   # a key's comment, type and default""",
    "predict": """examples:
  distribuuuu predict --checkpoint runs/demo/checkpoints/best.pth photo.png photos/ 'more/*.jpg'
  distribuuuu predict --checkpoint best.pth photos/ --topk 3 --output preds.csv
  distribuuuu predict --model runs/demo/export/model.onnx photos/   # an exported file alone""",
    "export": """examples:
  distribuuuu export --checkpoint runs/demo/checkpoints/best.pth --out exported/
      (model.onnx needs the onnx extra: pip install 'distribuuuu[onnx]')
  distribuuuu export --checkpoint best.pth --format pt2,torchscript""",
    "calibrate": """examples:
  distribuuuu calibrate --checkpoint runs/demo/checkpoints/best.pth""",
    "bench": """examples:
  distribuuuu bench --cfg mnist5k_fast
  distribuuuu bench --cfg mnist5k_fast --scaling 1,2
  distribuuuu bench --io --cfg my.yaml --workers 0,1,2""",
    "plot": """examples:
  distribuuuu plot runs/demo
  distribuuuu plot runs/a runs/b --out plots/""",
    "data": """examples:
  distribuuuu data export mnist5k digits
  distribuuuu data shard digits shards/ --shard-size 64MB
  distribuuuu data index tars/                # tars/{train,val}/*.tar made elsewhere""",
    "data export": """examples:
  distribuuuu data export mnist5k digits      # digits/{train,val}/<0-9>/*.png
  distribuuuu data export digits digits8      # scikit-learn's 8x8 digits: digits8/<0-9>/*.png
  distribuuuu data export faces faces         # faces/{face,background}/*.png, 25x25 gray""",
    "data shard": """examples:
  distribuuuu data shard digits shards/ --shard-size 64MB
  distribuuuu data shard mnist5k shards/ --shard-samples 500""",
    "data index": """examples:
  distribuuuu data index tars/                # tars/train/*.tar, tars/val/*.tar: .jpg/.png + .cls
  distribuuuu data index laion/ --label-field json:label   # the label in each sample's .json
  distribuuuu data index in1k-wds/            # timm's _info.json beside the tars: its counts""",
    "data split": """examples:
  distribuuuu data split runs/digits digits_split   # digits_split/{train,val}/<0-9>/*.png""",
}


# ---------------------------------------------------------------------------------------------
# config --explain KEY
# ---------------------------------------------------------------------------------------------
_ASSIGN = re.compile(r"^_C\.([A-Z0-9_.]+)\s*=")


def key_comments() -> dict[str, str]:
    """{KEY: its comment} from config/defaults.py, where every key has
    one above it."""
    text = resources.files("distribuuuu.config").joinpath("defaults.py").read_text(encoding="utf-8")
    comments: dict[str, str] = {}
    block: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") and not stripped.startswith("# ---"):
            block.append(stripped.lstrip("#").strip())
            continue
        match = _ASSIGN.match(stripped)
        if match and not stripped.endswith("CN()"):
            comments[match.group(1)] = " ".join(block)
        block = []
    return comments


def _type_name(key: str, default: Any) -> str:
    from distribuuuu.config.defaults import EITHER_TYPES, NULLABLE_TYPES

    if key in EITHER_TYPES:
        return " or ".join(t.__name__ for t in EITHER_TYPES[key])
    if key in NULLABLE_TYPES:
        return f"{NULLABLE_TYPES[key].__name__} or None"
    return type(default).__name__


def explain(key: str) -> str:
    """What `distribuuuu config --explain KEY` prints: the key, its type
    and default, its comment."""
    from distribuuuu.config import flatten, get_defaults, unknown_key

    defaults = flatten(get_defaults())
    if key not in defaults:
        raise UserError(unknown_key(key, defaults))
    comment = key_comments().get(key, "")
    return f"{key}  ({_type_name(key, defaults[key])}, default {defaults[key]!r})\n  {comment}\n"

"""The command line as people type it: examples at the end of each --help, options after the KEY VALUE
pairs, ``--checkpoint PATH`` (timm's spelling) for MODEL.WEIGHTS, and ``config --explain KEY``.

Kept apart from cli.py (which parses); nothing here imports torch.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from importlib import resources
from typing import Any

from distribuuuu.errors import UserError

# The end of each subcommand's --help: commands that work as printed (the data from `data export`).
EXAMPLES: dict[str, str] = {
    "train": """examples:
  distribuuuu data export mnist5k digits       # a folder of class folders to try it on
  distribuuuu train TRAIN.DATASET digits TRAIN.IM_SIZE 32 OPTIM.MAX_EPOCH 3
      (classes, val set, eval size, workers follow the data: see the setup lines, README)
  distribuuuu train --cfg mnist5k_fast --nproc-per-node 2 OUT_DIR runs/demo
  distribuuuu train --cfg my.yaml OPTIM.BASE_LR 0.05 --nproc-per-node 2   # options may follow the pairs
  distribuuuu train --import my_models.py MODEL.ARCH my_net TRAIN.DATASET digits""",
    "eval": """examples:
  distribuuuu eval --checkpoint runs/demo/checkpoints/best.pth
  distribuuuu eval --checkpoint best.pth TEST.DATASET other_images TEST.SPLIT test
  distribuuuu eval OUT_DIR runs/demo --nproc-per-node 2         # the run's best.pth""",
    "config": """examples:
  distribuuuu config --list                        # the shipped configs
  distribuuuu config --cfg mnist5k_fast            # a merged config, unset keys decided from the data
  distribuuuu config --explain MODEL.NUM_CLASSES   # a key's comment, type and default""",
    "predict": """examples:
  distribuuuu predict --checkpoint runs/demo/checkpoints/best.pth photo.png photos/ 'more/*.jpg'
  distribuuuu predict --checkpoint best.pth photos/ --topk 3 --output preds.csv""",
    "export": """examples:
  distribuuuu export --checkpoint runs/demo/checkpoints/best.pth --out exported/
      (ONNX's check needs the onnx extra: pip install 'distribuuuu[onnx]')""",
    "bench": """examples:
  distribuuuu bench --cfg mnist5k_fast
  distribuuuu bench --cfg mnist5k_fast --scaling 1,2
  distribuuuu bench --io --cfg my.yaml --workers 0,1,2""",
    "plot": """examples:
  distribuuuu plot runs/demo
  distribuuuu plot runs/a runs/b --out plots/""",
    "data": """examples:
  distribuuuu data export mnist5k digits
  distribuuuu data shard digits shards/ --shard-size 64MB""",
    "data export": """examples:
  distribuuuu data export mnist5k digits      # digits/train/<0-9>/*.png and digits/val/<0-9>/*.png""",
    "data shard": """examples:
  distribuuuu data shard digits shards/ --shard-size 64MB
  distribuuuu data shard mnist5k shards/ --shard-samples 500""",
}


def with_examples(add_parser: Callable[..., argparse.ArgumentParser],
                  prefix: str = "") -> Callable[..., argparse.ArgumentParser]:
    """sub.add_parser that ends each subcommand's --help with its examples (EXAMPLES[prefix + name])."""
    def add(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        kwargs.setdefault("epilog", EXAMPLES.get(prefix + name))
        return add_parser(name, **kwargs)

    return add


# Options that take no value; every other --option takes one (or is written --option=value).
FLAGS = frozenset({"--help", "-h", "--io", "--list"})
_CHECKPOINT_SUFFIXES = (".pth", ".pt", ".safetensors", ".ckpt")


def options_first(tokens: list[str]) -> list[str]:
    """The --options moved, each with its value, in front of the KEY VALUE pairs (and predict's image
    paths): argparse's REMAINDER would take `--nproc-per-node 2` after the pairs as two config words."""
    front: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        is_option = token.startswith("--") or token == "-h"  # not "-1": a negative value of a pair
        take = (1 if "=" in token or token in FLAGS else 2) if is_option else 0
        if take:
            front += tokens[i:i + take]
        else:
            rest.append(token)
        i += take or 1
    return front + rest


def with_checkpoint(command: str, checkpoint: str | None, opts: list[str]) -> list[str]:
    """opts with --checkpoint PATH as MODEL.WEIGHTS PATH (the same thing); a bare checkpoint file among
    eval's or export's words is a UserError pointing at --checkpoint."""
    pairs = dict(zip(opts[0::2], opts[1::2]))
    if checkpoint is not None:
        given = pairs.get("MODEL.WEIGHTS")
        if given is not None and given.strip("'\"") != checkpoint:
            raise UserError(f"--checkpoint {checkpoint} and MODEL.WEIGHTS {given} name two files; give one of them")
        return ["MODEL.WEIGHTS", checkpoint, *opts]
    if command in ("eval", "export") and len(opts) % 2:
        bare = [t for t in opts if t.endswith(_CHECKPOINT_SUFFIXES) and t not in pairs.values()]
        if bare:
            raise UserError(f"{command} takes the checkpoint as --checkpoint PATH (or MODEL.WEIGHTS PATH), not as a "
                            f"bare word: distribuuuu {command} --checkpoint {bare[0]}")
    return opts


# ---------------------------------------------------------------------------------------------
# config --explain KEY
# ---------------------------------------------------------------------------------------------
_ASSIGN = re.compile(r"^_C\.([A-Z0-9_.]+)\s*=")


def key_comments() -> dict[str, str]:
    """{KEY: its comment} from config/defaults.py, where every key has one above it."""
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
    """What `distribuuuu config --explain KEY` prints: the key, its type and default, its comment."""
    from distribuuuu.config import flatten, get_defaults, unknown_key

    defaults = flatten(get_defaults())
    if key not in defaults:
        raise UserError(unknown_key(key, defaults))
    comment = key_comments().get(key, "")
    return f"{key}  ({_type_name(key, defaults[key])}, default {defaults[key]!r})\n  {comment}\n"

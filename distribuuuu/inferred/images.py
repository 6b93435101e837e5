"""Decisions from the images: the model, its input and the data recipe
for the keys a config leaves unset, from a seeded sample of the training
images (a few hundred, the same on every rank), a fine-tune's model card
or the values a resumed run started with (docs/recipes.md).

  MODEL.ARCH        resnet_tiny for images of 64 px or less on a CPU, else resnet18
  MODEL.IN_CHANS    1 when most sampled images are gray, else 3
  TRAIN.IM_SIZE     the median shorter side, within [32, the model's default size]
  TRAIN.CROP_SCALE  0.8-1 below the model's size (a small crop would cut the
                    object), else ImageNet's 0.08-1
  TRAIN.FLIP_PROB   0 for glyphs (ink on a background: digits, letters, signs,
                    which a mirror changes), 0.5 for photos and textures
  TRAIN.MEAN/STD    the images' own below the model's size (each image weighs
                    the same), else ImageNet's
"""

from __future__ import annotations

import io
import random
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image
from torch import cuda
from yacs.config import CfgNode

from distribuuuu.data import sources, transforms
from distribuuuu.data.decoding.cpu import DECODE_ERRORS, as_mode, decode_error
from distribuuuu.data.shards.index import load_shard_set
from distribuuuu.data.shards.sample import sample_images
from distribuuuu.errors import UserError
from distribuuuu.inferred.decision import Decision
from distribuuuu.models import default_size

SAMPLE_IMAGES, SAMPLE_SEED = 256, 0  # enough for a median and a mean to 2-3 digits
STATS_SIDE = 128  # images are read at most this large: enough for a mean, a few MB in all
MIN_STD = 0.0039  # one gray level: images of (nearly) one colour would be divided by ~0
FALLBACK_ARCH, SMALL_ARCH, FALLBACK_SIZE = "resnet18", "resnet_tiny", 224
SMALL_IMAGES = 64  # images up to this side train SMALL_ARCH on a CPU
STRIDE, SMALL_STEM_STRIDE = 32, 8  # the least input side that leaves a 1x1 last map
SMALL_CROP, PHOTO_CROP = [0.8, 1.0], [0.08, 1.0]
GLYPHS = 0.5  # two-toned share (see Looks.two_tone) from which images are glyphs
GRAY_MODES = ("1", "L", "LA", "La", "I", "F", "I;16", "I;16L", "I;16B", "I;16N")
LUMA = np.array([0.299, 0.587, 0.114])  # ITU-R 601, as PIL's convert("L")

# The keys decided here, at their unset values.
UNSET = {
    "MODEL.ARCH": "auto",
    "MODEL.IN_CHANS": 0,
    "TRAIN.IM_SIZE": 0,
    "TRAIN.CROP_SCALE": [],
    "TRAIN.FLIP_PROB": -1.0,
    "TRAIN.MEAN": [],
    "TRAIN.STD": [],
}


@dataclass
class Looks:
    """What a sample of images shows."""

    seen: int  # images that decoded
    side: int  # their median shorter side
    gray: int  # how many are gray
    two_tone: float  # the median share of pixels within 8 levels of an image's darkest or
    # brightest: ink on a background is two-toned (digits 0.6, MNIST 0.9; photos 0.1,
    # textures 0.3)
    stats: dict[int, tuple[list[float], list[float]]]  # channels -> per channel mean, std of
    # pixels in [0, 1] (1: the luma PIL's convert("L") makes), each image weighing the same


def looks(files: sources.ImageFiles) -> Looks | None:
    """Looks of up to SAMPLE_IMAGES of files (drawn with SAMPLE_SEED),
    each read at most STATS_SIDE large; None when files is empty, a
    UserError naming one when none decodes."""
    if not len(files):
        return None
    drawn = random.Random(SAMPLE_SEED).sample(range(len(files)), min(len(files), SAMPLE_IMAGES))
    sides, gray, tones, means, squares, failed = [], 0, [], [], [], None
    for i in drawn:
        try:
            image = Image.open(io.BytesIO(files.read(i)))
            side, is_gray = min(image.size), image.mode in GRAY_MODES
            image.draft(image.mode, (STATS_SIDE, STATS_SIDE))  # JPEG: decoded at 1/2 to 1/8
            image.thumbnail((STATS_SIDE, STATS_SIDE))
            rgb = np.asarray(as_mode(image, "RGB"), np.float64).reshape(-1, 3) / 255
        except DECODE_ERRORS as e:
            failed = failed or f"{files.name(i)}: {decode_error(e)}"
            continue
        luma = rgb @ LUMA
        lo, hi = np.percentile(luma, (1, 99))
        tones.append(float(np.mean((luma <= lo + 8 / 255) | (luma >= hi - 8 / 255))))
        pixels = np.concatenate([luma[:, None], rgb], 1)  # gray, then R, G, B
        means.append(pixels.mean(0))
        squares.append((pixels**2).mean(0))
        sides.append(side)
        gray += is_gray
    if not sides:
        raise UserError(
            f"none of the {len(drawn)} sampled images of {files.root} decodes (first: {failed}); "
            "the recipe is decided from the images: replace them with images that open"
        )
    mean = np.mean(means, 0)
    std = np.sqrt(np.maximum(np.mean(squares, 0) - mean**2, 0))
    mean_list = [round(float(x), 4) for x in mean]
    std_list = [round(max(float(x), MIN_STD), 4) for x in std]
    stats = {1: (mean_list[:1], std_list[:1]), 3: (mean_list[1:], std_list[1:])}
    median_side, tone = int(statistics.median_low(sides)), float(np.median(tones))
    return Looks(len(sides), median_side, gray, tone, stats)


def decide(cfg: CfgNode) -> list[Decision]:
    """The unset keys of UNSET from the training images (module
    docstring); without images readable here, the fallback defaults."""
    t = cfg.TRAIN
    if all(cfg[k.split(".")[0]][k.split(".")[1]] != unset for k, unset in UNSET.items()):
        return []
    files, kind = None, sources.kind_of(cfg, "TRAIN")
    try:
        if kind in sources.IMAGE_FILES:
            files = sources.image_files(cfg, "TRAIN")
        elif kind == "shards":
            shard_set = load_shard_set(t.DATASET, t.SPLIT, "TRAIN", t.IMAGE_FIELD, t.LABEL_FIELD)
            files = sample_images(shard_set, SAMPLE_IMAGES)  # the fronts of a few shards
    except (UserError, OSError):
        files = None  # the preflight names what is wrong with the data
    seen = looks(files) if files is not None else None
    if seen is None:
        return _fallback(cfg, f"no folder of images read here ({t.DATASET})")
    return _recipe(cfg, seen)


def _set(cfg: CfgNode, key: str, value: Any, origin: str) -> list[Decision]:
    """key ("SECTION.NAME") set to value, with the reason for its setup
    line, when it is unset."""
    section, name = key.split(".")
    if cfg[section][name] != UNSET[key]:
        return []
    cfg.merge_from_list([key, value])  # yacs: the type checked
    return [Decision(key, value, origin)]


def _recipe(cfg: CfgNode, seen: Looks) -> list[Decision]:
    m, t, side = cfg.MODEL, cfg.TRAIN, seen.side
    sampled = f"from the images: {seen.seen} sampled, median shorter side {side} px"
    on_cpu = cfg.DEVICE == "cpu" or cfg.DEVICE == "auto" and not cuda.is_available()
    if side <= SMALL_IMAGES and on_cpu:
        arch, why = SMALL_ARCH, ": 64 px or less on a CPU: a ResNet sized for them"
    else:
        arch, why = FALLBACK_ARCH, ": over 64 px or a GPU: the default"
    decided = _set(cfg, "MODEL.ARCH", arch, sampled + why)
    chans = 1 if seen.gray * 2 > seen.seen else 3
    why = f"from the images: {seen.gray} of {seen.seen} sampled are gray"
    decided += _set(cfg, "MODEL.IN_CHANS", chans, why)
    ceiling = default_size(m.ARCH)
    floor = SMALL_STEM_STRIDE if m.SMALL_STEM else STRIDE
    why = ""
    if side < floor:
        why = f", raised to {floor}: the model divides its input by {floor}"
    elif side > ceiling:
        why = f", lowered to {m.ARCH}'s default size"
    decided += _set(cfg, "TRAIN.IM_SIZE", min(max(side, floor), ceiling), sampled + why)
    small = side < ceiling
    size = f"{side} px, {'below' if small else 'at least'} {m.ARCH}'s {ceiling}: "
    if small:
        crop, why = SMALL_CROP, "a small crop would cut their object"
    else:
        crop, why = PHOTO_CROP, "ImageNet's"
    decided += _set(cfg, "TRAIN.CROP_SCALE", crop, size + why)
    tones = f"from the images: {seen.two_tone:.0%} of a sampled image (the median) is "
    tones += "ink or background"
    if seen.two_tone >= GLYPHS:
        why = tones + ": glyphs (digits, letters, signs), which a mirror changes"
        decided += _set(cfg, "TRAIN.FLIP_PROB", 0.0, why)
    else:
        decided += _set(cfg, "TRAIN.FLIP_PROB", 0.5, tones + ": photos or textures, mirrored")
    if t.MEAN or m.PRETRAINED:  # pretrained weights keep their own (transforms.recipe_of)
        return decided
    if small:
        t.MEAN, t.STD = seen.stats[m.IN_CHANS]
        own = f"their own, of {seen.seen} sampled (a fixed seed)"
    else:
        imagenet = transforms.stats_for_channels(transforms.IMAGENET_STATS, m.IN_CHANS)
        t.MEAN, t.STD = list(imagenet[0]), list(imagenet[1])
        own = "ImageNet's"
    return decided + [Decision("TRAIN.MEAN/STD", f"{t.MEAN} / {t.STD}", size + own)]


def _fallback(cfg: CfgNode, why: str) -> list[Decision]:
    """No folder of images readable here: resnet18, 3 channels (or
    TRAIN.MEAN's count), 224 px."""
    origin = f"the fallback: {why}"
    chans = len(cfg.TRAIN.MEAN) or 3
    decided = _set(cfg, "MODEL.ARCH", FALLBACK_ARCH, origin)
    decided += _set(cfg, "MODEL.IN_CHANS", chans, origin)
    return decided + _set(cfg, "TRAIN.IM_SIZE", FALLBACK_SIZE, origin)


def from_card(cfg: CfgNode) -> list[Decision]:
    """A fine-tune or an eval: the unset keys the card of MODEL.WEIGHTS
    fills (none for a state dict, safetensors)."""
    from distribuuuu import weights
    from distribuuuu.model_card import from_checkpoint

    try:
        card = from_checkpoint(weights.peek_checkpoint(cfg.MODEL.WEIGHTS))
    except Exception:  # noqa: BLE001 - not a checkpoint: loading the weights says what it is
        return []
    taken = card.fill_unset(cfg) if card is not None else []
    origin = f"the model card of {cfg.MODEL.WEIGHTS}"
    return [Decision(k, cfg[k.split(".")[0]][k.split(".")[1]], origin) for k in taken]


def as_started(cfg: CfgNode, path: str) -> list[Decision]:
    """A train that resumes from path: the unset keys take the values
    its run started with (the checkpoint's config), so that a folder
    changed since cannot change the recipe mid-run (the resume's data
    check names the change)."""
    from distribuuuu import weights
    from distribuuuu.run_folder.resume_check import flatten_yaml

    try:
        then = flatten_yaml(weights.peek_checkpoint(path).get("cfg") or "")
    except Exception:  # noqa: BLE001 - the resume itself says what is wrong with the file
        return []
    kept = []
    for key, unset in UNSET.items():
        section, name = key.split(".")
        if cfg[section][name] == unset and then.get(key, unset) != unset:
            kept.append(key)
    cfg.merge_from_list([word for key in kept for word in (key, then[key])])
    return [Decision(key, then[key], f"as the run started: {path}") for key in kept]

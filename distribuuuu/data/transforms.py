"""The data recipe of a run and the per-sample transforms it makes
(torchvision transforms v2).

The recipe (Recipe, recipe_of): crop scale/ratio, flip probability,
interpolation, mean/std and the eval crop fraction, from the TRAIN.* /
TEST.* keys (docs/recipes.md, Data recipe). A key left at its 'unset'
value (CROP_SCALE [], FLIP_PROB -1, INTERPOLATION '', MEAN/STD [],
TEST.CROP_PCT 0) keeps the source's own recipe. For a timm model loaded
with MODEL.PRETRAINED, the unset mean/std, interpolation and crop
fraction come from timm's data config of that model (what its weights
were trained with); keys the user set always win.

Folders get the ImageNet recipe, or what the recipe keys make of it:
with TRAIN.IMAGE_DECODE pil, torchvision's transforms on PIL images
(folder_transform); with 'fast' (the default) the same crops drawn by
images.FastTrainDecode / FastEvalDecode. The small built-in images
(MNIST 28 px, CIFAR 32 px) are uint8 tensors and get the classic
pad-and-crop recipe: per sample here (small_image_transform), or per
batch in memory.py; TRAIN.CROP_SCALE replaces it by RandomResizedCrop.

Training augmentation beyond crops and flips (TRAIN.AUTO_AUGMENT,
TRAIN.RANDOM_ERASE) is drawn per image in every pipeline: the policy
(augment_policy) on the uint8 image after the crop and flip, random
erasing (random_erasing, or BatchRandomErasing for batches) after
normalization, as timm and torchvision's reference recipes order them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torchvision.transforms import v2
from yacs.config import CfgNode

from distribuuuu.config.validate import INTERPOLATIONS

Stats = tuple[tuple[float, ...], tuple[float, ...]]  # (mean, std) per channel, of pixels in [0, 1]

IMAGENET_STATS: Stats = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
MNIST_STATS: Stats = ((0.1307,), (0.3081,))
CIFAR10_STATS: Stats = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR100_STATS: Stats = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))

DEFAULT_INTERPOLATION = "bilinear"  # torchvision's, what every path used before the key existed

log = logging.getLogger("distribuuuu")


def stats_for_channels(stats: Stats, chans: int) -> Stats:
    """Mean/std for the channel count the model sees: 1 -> 3 channels
    repeats the gray value's, 3 -> 1 takes the plain channel average
    (for ImageNet the usual 0.449 / 0.226)."""
    mean, std = stats
    if len(mean) == chans:
        return stats
    if len(mean) == 1:
        return mean * chans, std * chans
    if chans == 1:
        return (round(sum(mean) / len(mean), 4),), (round(sum(std) / len(std), 4),)
    raise ValueError(f"cannot map {len(mean)}-channel statistics to {chans} channels")


# ---------------------------------------------------------------------------------------------
# The recipe
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Recipe:
    """The resolved recipe. None means 'the source's own' (scale, flip,
    stats, crop_pct)."""

    scale: tuple[float, float] | None = None
    ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0)
    flip: float | None = None
    interpolation: str = DEFAULT_INTERPOLATION
    stats: Stats | None = None
    crop_pct: float | None = None
    origin: str = "config"

    @property
    def mode(self) -> v2.InterpolationMode:
        return v2.InterpolationMode(self.interpolation)

    @property
    def antialias(self) -> bool:
        """Antialiasing applies to bilinear/bicubic downscaling only
        (nearest has none)."""
        return self.interpolation != "nearest"

    def folder_scale(self) -> tuple[float, float]:
        """The RandomResizedCrop area range of folders: the key, else
        torchvision's 0.08-1."""
        return self.scale or (0.08, 1.0)

    def flip_prob(self, source_flips: bool) -> float:
        """The flip probability: the key, else 0.5 for a source that
        flips (folders, CIFAR), 0 otherwise."""
        return self.flip if self.flip is not None else (0.5 if source_flips else 0.0)

    def eval_resize(self, im_size: int, test_im_size: int) -> int:
        """The shorter side before the eval center crop: IM_SIZE /
        crop_pct (floored, as timm), else TEST.IM_SIZE."""
        return test_im_size if self.crop_pct is None else int(math.floor(im_size / self.crop_pct))

    def describe(self) -> str:
        """One log line: what each part of the recipe is and where it
        came from."""
        scale = f"{self.scale[0]:g}-{self.scale[1]:g}" if self.scale else "source's"
        flip = f"{self.flip:g}" if self.flip is not None else "source's"
        stats = (
            f"mean {list(self.stats[0])} std {list(self.stats[1])}"
            if self.stats
            else "source's mean/std"
        )
        crop = f"crop_pct {self.crop_pct:g}" if self.crop_pct else "eval resize TEST.IM_SIZE"
        return (
            f"crop scale {scale}, ratio {self.ratio[0]:.3g}-{self.ratio[1]:.3g}, flip {flip}, "
            f"{self.interpolation}, {stats}, {crop} ({self.origin})"
        )


def recipe_of(cfg: CfgNode) -> Recipe:
    """The run's Recipe: the keys the user set, then (a pretrained timm
    model) timm's data config, then the source defaults."""
    t = cfg.TRAIN
    recipe = Recipe(
        scale=tuple(t.CROP_SCALE) or None,
        ratio=tuple(t.CROP_RATIO),
        flip=t.FLIP_PROB if t.FLIP_PROB >= 0 else None,
        interpolation=t.INTERPOLATION or DEFAULT_INTERPOLATION,
        stats=(tuple(t.MEAN), tuple(t.STD)) if t.MEAN else None,
        crop_pct=cfg.TEST.CROP_PCT or None,
    )
    return _with_timm_data_config(cfg, recipe) if cfg.MODEL.PRETRAINED else recipe


def _with_timm_data_config(cfg: CfgNode, recipe: Recipe) -> Recipe:
    """The unset mean/std, interpolation and crop fraction from timm's
    data config of MODEL.ARCH when it is a timm model: read from its
    pretrained cfg, nothing built or downloaded."""
    from distribuuuu.models import (
        resolve_arch,
    )  # late: models (and timm) only when a pretrained model asks

    lib, name = resolve_arch(cfg.MODEL.ARCH)
    if lib != "timm":
        return recipe
    import timm

    pretrained = timm.models.get_pretrained_cfg(name)
    if pretrained is None:
        return recipe
    timm_cfg = timm.data.resolve_data_config(pretrained_cfg=pretrained.to_dict())
    taken: dict[str, Any] = {}  # the parts timm's config decides
    if recipe.stats is None:
        taken["stats"] = (tuple(timm_cfg["mean"]), tuple(timm_cfg["std"]))
    if not cfg.TRAIN.INTERPOLATION and timm_cfg.get("interpolation") in INTERPOLATIONS:
        taken["interpolation"] = timm_cfg["interpolation"]
    if recipe.crop_pct is None and timm_cfg.get("crop_pct"):
        taken["crop_pct"] = float(timm_cfg["crop_pct"])
    parts = ", ".join({"stats": "mean/std"}.get(k, k) for k in taken)
    return (
        replace(recipe, **taken, origin=f"{parts} from timm's data config of {cfg.MODEL.ARCH}")
        if taken
        else recipe
    )


def image_stats(cfg: CfgNode) -> Stats:
    """The mean/std of image files (folders, shards) for MODEL.IN_CHANS:
    the recipe's, else ImageNet's."""
    return stats_for_channels(recipe_of(cfg).stats or IMAGENET_STATS, cfg.MODEL.IN_CHANS)


def log_recipe(cfg: CfgNode) -> None:
    """Say which recipe the run uses (rank 0 calls it once)."""
    log.info("data recipe: %s", recipe_of(cfg).describe())


# ---------------------------------------------------------------------------------------------
# Augmentation policies and random erasing (training only; off by
# default)
# ---------------------------------------------------------------------------------------------
RANDAUG_OPS = (
    2  # operations per image of RandAugment (Cubuk et al., 2020; timm's rand-m9-mstd0.5 also 2)
)

# TRAIN.AUTO_AUGMENT's policies, as torchvision transforms of ONE uint8
# image [C, H, W]: a v2 policy given a batch would apply the same
# operations to all of its images, so every pipeline calls it per image.
# Areas uncovered by geometric operations are filled with 0, as
# torchvision's reference recipe does.
POLICIES = {
    "randaugment": lambda magnitude: v2.RandAugment(num_ops=RANDAUG_OPS, magnitude=magnitude),
    "trivialaugment": lambda magnitude: v2.TrivialAugmentWide(),
    "autoaugment": lambda magnitude: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET),
}


def augment_policy(cfg: CfgNode) -> v2.Transform | None:
    """TRAIN.AUTO_AUGMENT's policy of one uint8 image (POLICIES); None
    for 'none'."""
    name = cfg.TRAIN.AUTO_AUGMENT
    return None if name == "none" else POLICIES[name](cfg.TRAIN.RANDAUG_MAGNITUDE)


# Random erasing (Zhong et al., 2020) with torchvision's (and timm's)
# rectangle distribution: area in [0.02, 1/3] of the image, aspect ratio
# log-uniform in [0.3, 3.3], up to 10 tries to fit one.
ERASE_SCALE, ERASE_RATIO, ERASE_TRIES = (0.02, 0.33), (0.3, 3.3), 10


def random_erasing(p: float) -> v2.RandomErasing | None:
    """Per-image random erasing of a normalized float image, or None for
    p = 0. The rectangle gets standard normal noise per pixel (timm's
    'pixel' mode, used by DeiT): after normalization noise has the
    data's own scale, where a constant patch would be an easy cue to
    learn."""
    return (
        v2.RandomErasing(p=p, scale=ERASE_SCALE, ratio=ERASE_RATIO, value="random")
        if p > 0
        else None
    )


class BatchRandomErasing:
    """random_erasing(p) drawn independently for every image of a float
    batch [B, C, H, W].

    Written by hand because v2.RandomErasing treats a batch as one image
    (one coin and one rectangle for all). The draws follow
    torchvision's: a coin with probability p, ERASE_TRIES candidate
    rectangles of which the first that fits is used (none fits: the
    image is kept), a uniform position, normal noise. All of it is
    tensor ops on the batch's device, without a host sync.
    """

    def __init__(self, p: float) -> None:
        self.p = p

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        b, _, height, width = images.shape
        dev = images.device
        area = height * width * torch.empty(b, ERASE_TRIES, device=dev).uniform_(*ERASE_SCALE)
        log_ratio = torch.empty(b, ERASE_TRIES, device=dev).uniform_(
            *(math.log(r) for r in ERASE_RATIO)
        )
        h, w = (area * log_ratio.exp()).sqrt().round(), (area / log_ratio.exp()).sqrt().round()
        fits = (h < height) & (w < width)
        first = fits.to(torch.uint8).argmax(1, keepdim=True)  # the first try that fits
        h, w = h.gather(1, first), w.gather(1, first)  # [B, 1]
        erase = (torch.rand(b, 1, device=dev) < self.p) & fits.any(1, keepdim=True)
        top = (torch.rand(b, 1, device=dev) * (height - h + 1)).floor()
        left = (torch.rand(b, 1, device=dev) * (width - w + 1)).floor()
        rows, cols = torch.arange(height, device=dev), torch.arange(width, device=dev)
        in_rows = (rows >= top) & (rows < top + h) & erase  # [B, H]
        in_cols = (cols >= left) & (cols < left + w)  # [B, W]
        mask = (in_rows[:, :, None] & in_cols[:, None, :])[:, None]  # [B, 1, H, W]
        return torch.where(mask, torch.randn_like(images), images)


def per_image(policy: Any, images: torch.Tensor) -> torch.Tensor:
    """policy applied to each image of a batch on its own (its own
    random operations)."""
    return torch.stack([policy(image) for image in images])


# ---------------------------------------------------------------------------------------------
# Per-sample recipes (TRAIN.IMAGE_DECODE pil, and the DataLoader path of
# small images)
# ---------------------------------------------------------------------------------------------
def folder_transform(
    train: bool,
    im_size: int,
    test_im_size: int,
    chans: int,
    policy: v2.Transform | None = None,
    erase: float = 0.0,
    recipe: Recipe = Recipe(),
) -> v2.Compose:
    """The recipe (default: ImageNet's) on PIL images: RandomResizedCrop
    + flip, or Resize + CenterCrop; when train, the policy on the uint8
    tensor (as the fast path) and erasing with probability erase at the
    end."""
    mode, flip = recipe.mode, recipe.flip_prob(True)
    if train:
        geometry = [
            v2.RandomResizedCrop(
                im_size,
                scale=recipe.folder_scale(),
                ratio=recipe.ratio,
                interpolation=mode,
                antialias=True,
            )
        ]
        geometry += [v2.RandomHorizontalFlip(flip)] if flip > 0 else []
    else:
        resize = recipe.eval_resize(im_size, test_im_size)
        geometry = [v2.Resize(resize, interpolation=mode, antialias=True), v2.CenterCrop(im_size)]
    # PILToTensor, not ToImage: batches should hold plain tensors, not
    # tv_tensors.Image.
    stats = stats_for_channels(recipe.stats or IMAGENET_STATS, chans)
    return v2.Compose(geometry + [v2.PILToTensor()] + _augmented_float(train, stats, policy, erase))


def small_image_transform(
    train: bool,
    im_size: int,
    native_size: int,
    pad: int,
    flip: bool,
    stats: Stats,
    policy: v2.Transform | None = None,
    erase: float = 0.0,
    recipe: Recipe = Recipe(),
) -> v2.Compose:
    """Pad-and-crop recipe on uint8 tensors [C, H, W] (RandomResizedCrop
    when recipe.scale is set); resizes only when IM_SIZE is not native.
    flip: the source's (True: p 0.5) unless recipe.flip. When train, the
    policy follows the crop and flip, and erasing the normalization."""
    steps: list[v2.Transform] = []
    if (
        train and recipe.scale is not None
    ):  # the user's crop replaces the resize and the pad-and-crop
        steps.append(
            v2.RandomResizedCrop(
                im_size,
                scale=recipe.scale,
                ratio=recipe.ratio,
                interpolation=recipe.mode,
                antialias=True,
            )
        )
    elif im_size != native_size:
        steps.append(v2.Resize((im_size, im_size), interpolation=recipe.mode, antialias=True))
    if train:
        if recipe.scale is None:
            steps.append(v2.RandomCrop(im_size, padding=pad, fill=0))
        p = recipe.flip_prob(flip)
        if p > 0:
            steps.append(v2.RandomHorizontalFlip(p))
    return v2.Compose(steps + _augmented_float(train, stats, policy, erase))


def _augmented_float(
    train: bool, stats: Stats, policy: v2.Transform | None, erase: float
) -> list[v2.Transform]:
    """[policy] + to normalized float + [erasing]: the steps after the
    geometry (nothing added when off)."""
    eraser = random_erasing(erase) if train else None
    mean, std = stats
    return (
        ([policy] if train and policy is not None else [])
        + [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean=list(mean), std=list(std))]
        + ([eraser] if eraser is not None else [])
    )


def match_channels(images: torch.Tensor, chans: int) -> torch.Tensor:
    """uint8 [N, C, H, W] -> [N, chans, H, W]: gray repeated to RGB, or
    RGB to luminance."""
    have = images.shape[1]
    if have == chans:
        return images
    if chans in (1, 3) and have in (1, 3):
        return v2.functional.rgb_to_grayscale(images, num_output_channels=chans).contiguous()
    raise ValueError(f"cannot convert {have}-channel images to {chans} channels")

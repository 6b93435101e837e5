"""The data recipe of a run: crop scale/ratio, flip probability, interpolation, mean/std and the
eval crop fraction, from the TRAIN.* / TEST.* keys (docs/recipes.md, Data recipe).

A key left at its 'unset' value (CROP_SCALE [], FLIP_PROB -1, INTERPOLATION '', MEAN/STD [],
TEST.CROP_PCT 0) keeps the source's own recipe, which is what every run did before these keys
existed. For a timm model loaded with MODEL.PRETRAINED, the unset mean/std, interpolation and
crop fraction come from timm's data config of that model instead (what its weights were trained
with); keys the user set always win.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from torchvision.transforms import v2
from yacs.config import CfgNode

INTERPOLATIONS = ("nearest", "bilinear", "bicubic")  # TRAIN.INTERPOLATION ('' = the default)
DEFAULT_INTERPOLATION = "bilinear"  # torchvision's, what every path used before the key existed

Stats = tuple[tuple[float, ...], tuple[float, ...]]  # (mean, std), as transforms.Stats (which imports this module)

log = logging.getLogger("distribuuuu")


@dataclass(frozen=True)
class Recipe:
    """The resolved recipe. None means 'the source's own' (scale, flip, stats, crop_pct)."""

    scale: tuple[float, float] | None = None
    ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0)
    flip: float | None = None
    interpolation: str = DEFAULT_INTERPOLATION
    stats: Stats | None = None
    crop_pct: float | None = None
    origin: str = "config"

    @property
    def mode(self) -> v2.InterpolationMode:
        """The interpolation as torchvision's enum (for v2 transforms)."""
        return v2.InterpolationMode(self.interpolation)

    @property
    def antialias(self) -> bool:
        """Antialiasing applies to bilinear/bicubic downscaling only (nearest has none)."""
        return self.interpolation != "nearest"

    def folder_scale(self) -> tuple[float, float]:
        """The RandomResizedCrop area range of folders: the key, else torchvision's 0.08-1."""
        return self.scale if self.scale is not None else (0.08, 1.0)

    def flip_prob(self, source_flips: bool) -> float:
        """The flip probability: the key, else 0.5 for a source that flips (folders, CIFAR), 0 otherwise."""
        if self.flip is not None:
            return self.flip
        return 0.5 if source_flips else 0.0

    def eval_resize(self, im_size: int, test_im_size: int) -> int:
        """The shorter side before the eval center crop: IM_SIZE / crop_pct (floored, as timm), else TEST.IM_SIZE."""
        return test_im_size if self.crop_pct is None else int(math.floor(im_size / self.crop_pct))

    def describe(self) -> str:
        """One log line: what each part of the recipe is and where it came from."""
        scale = f"{self.scale[0]:g}-{self.scale[1]:g}" if self.scale else "source's"
        flip = f"{self.flip:g}" if self.flip is not None else "source's"
        stats = (f"mean {list(self.stats[0])} std {list(self.stats[1])}" if self.stats else "source's mean/std")
        crop = f"crop_pct {self.crop_pct:g}" if self.crop_pct else "eval resize TEST.IM_SIZE"
        return (f"crop scale {scale}, ratio {self.ratio[0]:.3g}-{self.ratio[1]:.3g}, flip {flip}, "
                f"{self.interpolation}, {stats}, {crop} ({self.origin})")


def timm_data_config(cfg: CfgNode) -> dict[str, Any] | None:
    """timm's data config (mean, std, interpolation, crop_pct) of MODEL.ARCH when it is a timm model
    loaded with MODEL.PRETRAINED; None otherwise. Read from the model's pretrained cfg: nothing is
    built or downloaded."""
    if not cfg.MODEL.PRETRAINED:
        return None
    from distribuuuu.models import resolve_arch  # late: models (and timm) only when a pretrained model asks

    lib, name = resolve_arch(cfg.MODEL.ARCH)
    if lib != "timm":
        return None
    import timm

    pretrained = timm.models.get_pretrained_cfg(name)
    if pretrained is None:
        return None
    return timm.data.resolve_data_config(pretrained_cfg=pretrained.to_dict())


def recipe_of(cfg: CfgNode) -> Recipe:
    """The run's Recipe: the keys the user set, then timm's data config, then the source defaults."""
    t = cfg.TRAIN
    timm_cfg = timm_data_config(cfg) or {}
    stats = (tuple(t.MEAN), tuple(t.STD)) if t.MEAN else None
    interpolation = t.INTERPOLATION or None
    crop_pct = cfg.TEST.CROP_PCT or None
    taken = []  # the parts timm's config decided
    if timm_cfg:
        if stats is None:
            stats, taken = (tuple(timm_cfg["mean"]), tuple(timm_cfg["std"])), taken + ["mean/std"]
        if interpolation is None and timm_cfg.get("interpolation") in INTERPOLATIONS:
            interpolation, taken = timm_cfg["interpolation"], taken + ["interpolation"]
        if crop_pct is None and timm_cfg.get("crop_pct"):
            crop_pct, taken = float(timm_cfg["crop_pct"]), taken + ["crop_pct"]
    origin = f"{', '.join(taken)} from timm's data config of {cfg.MODEL.ARCH}" if taken else "config"
    return Recipe(scale=tuple(t.CROP_SCALE) if t.CROP_SCALE else None, ratio=tuple(t.CROP_RATIO),
                  flip=t.FLIP_PROB if t.FLIP_PROB >= 0 else None,
                  interpolation=interpolation or DEFAULT_INTERPOLATION, stats=stats, crop_pct=crop_pct, origin=origin)


def log_recipe(cfg: CfgNode) -> None:
    """Say which recipe the run uses (rank 0 calls it once)."""
    log.info("data recipe: %s", recipe_of(cfg).describe())


def interpolate_mode(recipe: Recipe) -> dict[str, Any]:
    """torch.nn.functional.interpolate arguments of the recipe's interpolation (the fast path)."""
    if recipe.interpolation == "nearest":
        return {"mode": "nearest"}
    return {"mode": recipe.interpolation, "antialias": True, "align_corners": False}


"""The record that makes a checkpoint describe itself: what the model
is, what its outputs mean and how an image must be prepared for it.

Every checkpoint that training writes holds it under the key ``card`` (a
plain dict: it loads with ``torch.load(weights_only=True)``), and every
file of ``export`` carries it as JSON. ``eval``, ``predict``, ``export``
and ``load_model`` read it, so a checkpoint alone is enough to use a
model.

    card = ModelCard.from_dict(torch.load("best.pth", weights_only=True)["card"])
    x = card.transform()(Image.open("cat.jpg"))       # the model's input tensor [C, H, W]
    probs = (model(x[None]) / card.temperature).softmax(1)
    card.classes[int(probs.argmax())]                  # the class name

The preprocessing is the evaluation pipeline's: the image as a uint8
tensor (``resize_on`` "tensor"; "pil": the PIL image, then to a tensor),
its shorter side resized to ``resize`` with ``interpolation``
(antialiased), a center crop of ``image_size``, pixels scaled to [0, 1],
then ``(x - mean) / std`` per channel, on a ``in_chans``-channel image
(1: gray "L", 3: "RGB"). It is computed by ``describe`` from the run's
data recipe (data/transforms.py) and its training data: folders take the
recipe's mean/std (ImageNet's unless set) and eval resize (TEST.IM_SIZE,
or TRAIN.IM_SIZE / TEST.CROP_PCT); mnist5k, CIFAR and a registered
TensorSource their own mean/std, resized to TRAIN.IM_SIZE; a registered
Dataset (items that are ready tensors) the mean/std its source states
(register_source(stats=...), or the Dataset's ``stats``), else, as
synthetic data, only the [0, 1] scaling (mean 0, std 1).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

import torch
from PIL import Image
from torchvision.transforms import v2
from yacs.config import CfgNode

from distribuuuu import models
from distribuuuu.data.decoding.cpu import as_mode
from distribuuuu.data.loading.items import ImageDataset
from distribuuuu.data.shards.reader import ShardDataset
from distribuuuu.data.sources import registry
from distribuuuu.data.transforms import image_stats, recipe_of, stats_for_channels
from distribuuuu.errors import UserError
from distribuuuu.weights import CARD_KEY  # the checkpoint entry (weights.py: the checkpoint format)

CARD_VERSION = 1  # bumped when a field changes meaning; from_dict reads this version


@dataclass(frozen=True)
class ModelCard:
    """What a checkpoint's model is and how to feed it (see the module
    docstring)."""

    arch: str  # MODEL.ARCH
    # where the architecture is defined: "timm", "torchvision", or
    # "tiny" (models.py: timm's ResNet class)
    library: str
    # its name there (timm.create_model / torchvision.models.get_model),
    # or resnet_tiny / resnet_mini
    model_name: str
    # MODEL.SMALL_STEM: conv1 a 3x3 stride-1 conv, maxpool an Identity
    # (models._use_small_stem)
    small_stem: bool
    num_classes: int  # outputs of the model
    in_chans: int  # 1: gray images ("L"), 3: RGB
    classes: list[str]  # the name of each output, in label order (num_classes of them)
    image_size: int  # the side of the square input (the center crop)
    resize: int  # the shorter side before the center crop
    mean: list[float]  # per channel, after scaling pixels to [0, 1]
    std: list[float]
    interpolation: str = "bilinear"  # of the resize: nearest, bilinear or bicubic
    crop_pct: float | None = None  # TEST.CROP_PCT (or timm's) when it set resize, for the record
    # "tensor": the uint8 tensor is resized; "pil": the PIL image
    # (TRAIN.IMAGE_DECODE pil)
    resize_on: str = "tensor"
    config: str = ""  # the full run config as YAML (what OUT_DIR/config.yaml holds)
    # Probabilities are softmax(logits / temperature): fitted on the
    # validation split at the end of training or by `distribuuuu
    # calibrate` (calibration.py); 1.0: not calibrated. The exported
    # files output the logits undivided and carry it in their card.
    temperature: float = 1.0
    # the fit's record (calibration.calibrate's: n, and the NLL, ECE
    # and top-1 before and after); None: not calibrated
    calibration: dict[str, Any] | None = None
    version: int = field(default=CARD_VERSION)

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values only (str, int, float, list, None): safe
        for weights_only loading and JSON."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelCard:
        """The card of to_dict's output; keys added by later versions
        are ignored."""
        if not isinstance(data, dict):
            raise UserError(f"a model card is a dict of its fields, not {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in data]
        if missing:
            raise UserError(
                f"the model card lacks {', '.join(missing)}: it was not written by this version of "
                "distribuuuu"
            )
        kept = {k: v for k, v in data.items() if k in names}
        return cls(
            **{
                **kept,
                "classes": [str(c) for c in kept["classes"]],
                "mean": [float(m) for m in kept["mean"]],
                "std": [float(s) for s in kept["std"]],
                "temperature": float(kept.get("temperature", 1.0)),
            }
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @property
    def image_mode(self) -> str:
        """The PIL mode images are converted to."""
        return "L" if self.in_chans == 1 else "RGB"

    def transform(self) -> v2.Compose:
        """PIL image (any mode) -> float32 tensor [in_chans, image_size,
        image_size], as evaluation prepares it."""
        mode = v2.InterpolationMode(self.interpolation)
        # Resized where evaluation resized it: the uint8 tensor (fast
        # folder decoding, mnist5k, CIFAR) or the PIL image
        # (TRAIN.IMAGE_DECODE pil); the two differ by rounding only.
        geometry = [
            v2.Resize(self.resize, interpolation=mode, antialias=self.interpolation != "nearest"),
            v2.CenterCrop(self.image_size),
        ]
        to_tensor = [v2.PILToTensor()]
        steps = to_tensor + geometry if self.resize_on == "tensor" else geometry + to_tensor
        return v2.Compose(
            [
                ToMode(self.image_mode),
                *steps,
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(mean=list(self.mean), std=list(self.std)),
            ]
        )

    def describe(self) -> str:
        """One line for logs and messages."""
        return (
            f"{self.arch}, {self.num_classes} classes, "
            f"{self.in_chans}x{self.image_size}x{self.image_size} (resize {self.resize}, "
            f"{self.interpolation}, mean {self.mean} std {self.std})"
        )

    def fill_unset(self, cfg: CfgNode) -> list[str]:
        """A fine-tune from this card's checkpoint: the keys cfg (not
        frozen) leaves unset get this card's values (MODEL.ARCH,
        IN_CHANS, TRAIN.IM_SIZE, MEAN/STD; CROP_SCALE and FLIP_PROB
        where its run set them; SMALL_STEM when the card's is True), so
        the weights fit; returns the keys taken."""
        m, t, taken = cfg.MODEL, cfg.TRAIN, []
        old = CfgNode.load_cfg(self.config).TRAIN if self.config else CfgNode()
        fills = [
            (m, "ARCH", m.ARCH == "auto", self.arch),  # "auto": MODEL.ARCH unset (inferred/)
            (m, "SMALL_STEM", self.small_stem and not m.SMALL_STEM, True),
            (m, "IN_CHANS", not m.IN_CHANS, self.in_chans),
            (t, "IM_SIZE", not t.IM_SIZE, self.image_size),
            (t, "MEAN", not t.MEAN and len(self.mean) == (m.IN_CHANS or self.in_chans), self.mean),
            (t, "STD", not t.STD and len(self.std) == (m.IN_CHANS or self.in_chans), self.std),
            (
                t,
                "CROP_SCALE",
                not t.CROP_SCALE and bool(old.get("CROP_SCALE")),
                list(old.get("CROP_SCALE", [])),
            ),
            (
                t,
                "FLIP_PROB",
                t.FLIP_PROB < 0 and old.get("FLIP_PROB", -1) >= 0,
                old.get("FLIP_PROB"),
            ),
        ]
        for node, key, unset, value in fills:
            if unset:
                node[key] = value
                taken.append(f"{'MODEL' if node is m else 'TRAIN'}.{key}")
        return taken


class ToMode:
    """PIL image -> mode 'L' or 'RGB'; 16-bit and float gray images
    scaled to 8 bits, as training reads files."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def __call__(self, image: Image.Image) -> Image.Image:
        return as_mode(image, self.mode)

    def __repr__(self) -> str:
        return f"ToMode({self.mode!r})"


def _normalize_of(dataset: Any) -> tuple[list[float], list[float]] | None:
    """The mean/std of the Normalize step in a dataset's transform (the
    tensor sources' pipelines)."""
    steps = getattr(getattr(dataset, "transform", None), "transforms", [])
    norm = next((t for t in steps if isinstance(t, v2.Normalize)), None)
    return None if norm is None else ([float(m) for m in norm.mean], [float(s) for s in norm.std])


def describe(cfg: CfgNode, dataset: Any | None, classes: list[str] | None = None) -> ModelCard:
    """The card of a model trained with cfg on dataset (a dataset the
    loaders built, train or eval; None for an image folder that is not
    here). classes: the names, when not the dataset's."""
    dataset = getattr(dataset, "dataset", dataset)  # a TRAIN.VAL_SPLIT part: the whole dataset
    recipe, chans, size = recipe_of(cfg), cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE
    names = [str(c) for c in (classes if classes is not None else getattr(dataset, "classes", []))]
    names += [str(c) for c in range(len(names), cfg.MODEL.NUM_CLASSES)]
    if dataset is None or isinstance(dataset, (ImageDataset, ShardDataset)):  # image files
        stats, resize, crop_pct = (
            image_stats(cfg),
            recipe.eval_resize(size, cfg.TEST.IM_SIZE),
            recipe.crop_pct,
        )
        resize_on = "pil" if cfg.TRAIN.IMAGE_DECODE == "pil" else "tensor"
    # the tensor sources resize to TRAIN.IM_SIZE, no crop; ready items:
    # the stats their source states
    else:
        stated = registry.stated_stats(cfg.TRAIN.DATASET, dataset)
        stats = _normalize_of(dataset) or (
            stats_for_channels(stated, chans) if stated else ([0.0] * chans, [1.0] * chans)
        )
        resize, crop_pct, resize_on = size, None, "tensor"
    library, model_name = models.resolve_arch(cfg.MODEL.ARCH)
    return ModelCard(
        arch=cfg.MODEL.ARCH,
        library=library,
        model_name=model_name,
        small_stem=bool(cfg.MODEL.SMALL_STEM),
        num_classes=cfg.MODEL.NUM_CLASSES,
        in_chans=chans,
        classes=names[: cfg.MODEL.NUM_CLASSES],
        image_size=size,
        resize=resize,
        mean=[float(m) for m in stats[0]],
        std=[float(s) for s in stats[1]],
        interpolation=recipe.interpolation,
        crop_pct=crop_pct,
        resize_on=resize_on,
        config=cfg.dump(),
    )


def from_checkpoint(ckpt: dict[str, Any]) -> ModelCard | None:
    """The card a checkpoint holds, or None (an older checkpoint, a bare
    state dict)."""
    data = ckpt.get(CARD_KEY) if isinstance(ckpt, dict) else None
    return ModelCard.from_dict(data) if isinstance(data, dict) else None

"""Per-sample transforms (torchvision transforms v2), the fast folder pipeline, and the
normalization statistics.

Folders get the ImageNet recipe, or what the data recipe keys make of it (a recipe.Recipe, which
the functions here take): with TRAIN.IMAGE_DECODE pil, torchvision's transforms on PIL images
(folder_transform); with 'fast' (the default), FastTrainDecode / FastEvalDecode, which draw the
same crops but decode and resize more cheaply and leave normalization to the batch
(BatchNormalize). The small built-in images (MNIST 28 px, CIFAR 32 px) are uint8 tensors and get
the classic pad-and-crop recipe: per sample here (small_image_transform), or per batch in
memory.py; TRAIN.CROP_SCALE replaces it by RandomResizedCrop (per sample only).

Training augmentation beyond crops and flips (TRAIN.AUTO_AUGMENT, TRAIN.RANDOM_ERASE) is drawn per
image in every pipeline: the policy (augment_policy) on the uint8 image after the crop and flip,
random erasing (random_erasing, or BatchRandomErasing for batches) after normalization, as timm
and torchvision's reference recipes order them.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Callable

import numpy as np
import torch
import torchvision.io as tio
from PIL import Image
from torchvision.transforms import RandomResizedCrop, v2

from distribuuuu.data.recipe import Recipe, interpolate_mode

Stats = tuple[tuple[float, ...], tuple[float, ...]]

IMAGENET_STATS: Stats = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
MNIST_STATS: Stats = ((0.1307,), (0.3081,))
CIFAR10_STATS: Stats = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR100_STATS: Stats = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))


def stats_for_channels(stats: Stats, chans: int) -> Stats:
    """Mean/std for the channel count the model sees.

    1 -> 3 channels repeats the gray value, so the statistics repeat too. 3 -> 1 uses the plain
    channel average, an approximation of the statistics of the gray image (for ImageNet this
    gives the usual 0.449 / 0.226).
    """
    mean, std = stats
    if len(mean) == chans:
        return stats
    if len(mean) == 1:
        return mean * chans, std * chans
    if chans == 1:
        return (round(sum(mean) / len(mean), 4),), (round(sum(std) / len(std), 4),)
    raise ValueError(f"cannot map {len(mean)}-channel statistics to {chans} channels")


def _to_normalized_float(stats: Stats) -> list[v2.Transform]:
    mean, std = stats
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean=list(mean), std=list(std))]


# ---------------------------------------------------------------------------------------------
# Augmentation policies and random erasing (training only; off by default)
# ---------------------------------------------------------------------------------------------
RANDAUG_OPS = 2  # operations per image of RandAugment (Cubuk et al., 2020; timm's rand-m9-mstd0.5 also 2)


def augment_policy(name: str, magnitude: int) -> v2.Transform | None:
    """TRAIN.AUTO_AUGMENT as a torchvision transform of ONE uint8 image [C, H, W]; None for 'none'.

    A v2 policy given a batch would apply the same operations to all of its images, so every
    pipeline calls it per image. Areas uncovered by geometric operations are filled with 0, as
    torchvision's reference recipe does (timm fills with the mean pixel instead).
    """
    if name == "none":
        return None
    if name == "randaugment":
        return v2.RandAugment(num_ops=RANDAUG_OPS, magnitude=magnitude)
    if name == "trivialaugment":
        return v2.TrivialAugmentWide()
    if name == "autoaugment":
        return v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET)
    raise ValueError(f"unknown augmentation policy {name!r}")


# Random erasing (Zhong et al., 2020) with torchvision's (and timm's) rectangle distribution: area in
# [0.02, 1/3] of the image, aspect ratio log-uniform in [0.3, 3.3], up to 10 tries to fit one.
ERASE_SCALE, ERASE_RATIO, ERASE_TRIES = (0.02, 0.33), (0.3, 3.3), 10


def random_erasing(p: float) -> v2.RandomErasing | None:
    """Per-image random erasing of a normalized float image, or None for p = 0.

    The rectangle gets standard normal noise per pixel (value 'random', timm's 'pixel' mode, used by
    DeiT), rather than 0: after normalization noise has the data's own scale, and a constant patch
    would be an easy cue the model could learn to spot.
    """
    return v2.RandomErasing(p=p, scale=ERASE_SCALE, ratio=ERASE_RATIO, value="random") if p > 0 else None


class BatchRandomErasing:
    """random_erasing(p) drawn independently for every image of a float batch [B, C, H, W].

    Written by hand because v2.RandomErasing treats a batch as one image (one coin and one rectangle
    for all). The draws follow torchvision's: a coin with probability p, ERASE_TRIES candidate
    rectangles of which the first that fits is used (none fits: the image is kept), a uniform
    position, normal noise. All of it is tensor ops on the batch's device (its default generator),
    without a host sync; the noise is drawn for the whole batch and kept inside the rectangles.
    """

    def __init__(self, p: float) -> None:
        self.p = p

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        b, _, height, width = images.shape
        dev = images.device
        area = height * width * torch.empty(b, ERASE_TRIES, device=dev).uniform_(*ERASE_SCALE)
        log_ratio = torch.empty(b, ERASE_TRIES, device=dev).uniform_(*(math.log(r) for r in ERASE_RATIO))
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


def per_image(policy: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor) -> torch.Tensor:
    """policy applied to each image of a batch on its own (its own random operations)."""
    return torch.stack([policy(image) for image in images])


# ---------------------------------------------------------------------------------------------
# Per-sample recipes (TRAIN.IMAGE_DECODE pil, and the DataLoader path of small images)
# ---------------------------------------------------------------------------------------------
def folder_transform(train: bool, im_size: int, test_im_size: int, chans: int, policy: v2.Transform | None = None,
                     erase: float = 0.0, recipe: Recipe = Recipe()) -> v2.Compose:
    """The recipe (default: ImageNet's) on PIL images: RandomResizedCrop + flip, or Resize + CenterCrop;
    when train, the policy on the uint8 tensor (as the fast path) and erasing with probability erase at the end."""
    mode, flip = recipe.mode, recipe.flip_prob(True)
    if train:
        geometry = [v2.RandomResizedCrop(im_size, scale=recipe.folder_scale(), ratio=recipe.ratio,
                                         interpolation=mode, antialias=True)]
        geometry += [v2.RandomHorizontalFlip(flip)] if flip > 0 else []
    else:
        resize = recipe.eval_resize(im_size, test_im_size)
        geometry = [v2.Resize(resize, interpolation=mode, antialias=True), v2.CenterCrop(im_size)]
    # PILToTensor, not ToImage: batches should hold plain tensors, not tv_tensors.Image.
    stats = stats_for_channels(recipe.stats or IMAGENET_STATS, chans)
    return v2.Compose(geometry + [v2.PILToTensor()] + _augmented_float(train, stats, policy, erase))


def small_image_transform(train: bool, im_size: int, native_size: int, pad: int, flip: bool,
                          stats: Stats, policy: v2.Transform | None = None, erase: float = 0.0,
                          recipe: Recipe = Recipe()) -> v2.Compose:
    """Pad-and-crop recipe on uint8 tensors [C, H, W] (RandomResizedCrop when recipe.scale is set);
    resizes only when IM_SIZE is not native. flip: the source's (True: p 0.5) unless recipe.flip.
    When train, the policy follows the crop and flip, and erasing the normalization."""
    steps: list[v2.Transform] = []
    if train and recipe.scale is not None:  # the user's crop replaces the resize and the pad-and-crop
        steps.append(v2.RandomResizedCrop(im_size, scale=recipe.scale, ratio=recipe.ratio,
                                          interpolation=recipe.mode, antialias=True))
    elif im_size != native_size:
        steps.append(v2.Resize((im_size, im_size), interpolation=recipe.mode, antialias=True))
    if train:
        if recipe.scale is None:
            steps.append(v2.RandomCrop(im_size, padding=pad, fill=0))
        p = recipe.flip_prob(flip)
        if p > 0:
            steps.append(v2.RandomHorizontalFlip(p))
    return v2.Compose(steps + _augmented_float(train, stats, policy, erase))


def _augmented_float(train: bool, stats: Stats, policy: v2.Transform | None, erase: float) -> list[v2.Transform]:
    """[policy] + to normalized float + [erasing]: the steps after the geometry (nothing added when off)."""
    eraser = random_erasing(erase) if train else None
    return (([policy] if train and policy is not None else []) + _to_normalized_float(stats)
            + ([eraser] if eraser is not None else []))


WIDE_GRAY_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")  # PIL's 16/32-bit single-channel modes


def to_8bit(image: Image.Image) -> Image.Image:
    """A 16- or 32-bit gray image (PIL modes I;16*, I, F) as 8-bit 'L', scaled; others unchanged.

    PIL's convert('L' or 'RGB') clips such values at 255, so a 16-bit PNG (0..65535) came out
    nearly all white. Integer values are read as 16-bit (what PIL makes of 16-bit PNG, TIFF and
    PGM files) and keep their high byte, v // 256, as PIL itself reduces 16-bit RGB PNGs; floats
    in [0, 1] are scaled by 255, other floats read as 16-bit values. Both decode paths use this.
    """
    if image.mode not in WIDE_GRAY_MODES:
        return image
    values = np.asarray(image)
    if image.mode == "F":
        values = np.nan_to_num(values.astype(np.float64))
        values = values * 255.0 + 0.5 if values.max(initial=0.0) <= 1.0 else values / 256.0
    else:
        values = values.astype(np.int64) >> 8
    return Image.fromarray(np.clip(values, 0, 255).astype(np.uint8))  # 2-D uint8: mode L


def match_channels(images: torch.Tensor, chans: int) -> torch.Tensor:
    """uint8 [N, C, H, W] -> [N, chans, H, W]: gray repeated to RGB, or RGB to luminance."""
    have = images.shape[1]
    if have == chans:
        return images
    if chans in (1, 3) and have in (1, 3):
        return v2.functional.rgb_to_grayscale(images, num_output_channels=chans).contiguous()
    raise ValueError(f"cannot convert {have}-channel images to {chans} channels")


# ---------------------------------------------------------------------------------------------
# The fast folder pipeline (TRAIN.IMAGE_DECODE fast): file -> uint8 [C, S, S] in the worker,
# normalized per batch on the training device (BatchNormalize). Same geometry and the same random
# crop distribution as folder_transform (RandomResizedCrop's own get_params), less work per image:
#   - JPEGs are decoded by torchvision.io.decode_jpeg (libjpeg-turbo, as PIL, bit-identical pixels)
#     straight into a tensor: no PIL image, no convert() copy;
#   - when the crop is at least twice the output size, PIL's draft() decodes the JPEG at 1/2, 1/4
#     or 1/8 scale (libjpeg's DCT scaling): detail the resize would have averaged away anyway
#     (1/2 only on large images, where it beats a full-size decode_jpeg; see decode_scale);
#   - crop + antialiased resize run on the uint8 tensor (torch's uint8 kernel), and the image
#     stays uint8 until the batch is normalized: no per-image float ToTensor/Normalize, 4x fewer
#     bytes from the workers (and to the GPU).
# ---------------------------------------------------------------------------------------------
_JPEG_MAGIC = b"\xff\xd8\xff"


# Decoding at 1/2 goes through PIL, whose decoder is slower than decode_jpeg's: on ~500x375 JPEGs
# a half-size PIL decode took as long as a full-size decode_jpeg (benchmarks/overhead.py, jpeg),
# on 1000x750 ones it was 8% faster end to end. So 1/2 is used from this many pixels on; 1/4 and
# 1/8 always pay.
HALF_SCALE_MIN_PIXELS = 500_000


def draft_factor(crop_w: int, crop_h: int, out_w: int, out_h: int) -> int:
    """The largest k of 1, 2, 4, 8 that keeps the crop, decoded at 1/k scale, >= the output size."""
    k = 1
    while k < 8 and crop_w >= 2 * k * out_w and crop_h >= 2 * k * out_h:
        k *= 2
    return k


def decode_scale(data: bytes, width: int, height: int, crop_w: int, crop_h: int, out: int) -> int:
    """1/k, the scale to decode this file at so that the crop still covers out x out pixels:
    draft_factor for JPEGs (1/2 only for large images, see HALF_SCALE_MIN_PIXELS), else 1."""
    if data[:3] != _JPEG_MAGIC:
        return 1
    k = draft_factor(crop_w, crop_h, out, out)
    return 1 if k == 2 and width * height < HALF_SCALE_MIN_PIXELS else k


def decode(data: bytes, mode: str, reduce: int = 1) -> torch.Tensor:
    """uint8 [C, H, W] (C = 1 for mode 'L', 3 for 'RGB') of an encoded image file.

    reduce > 1 decodes a JPEG at 1/reduce scale (PIL draft). Other JPEGs go to decode_jpeg; what it
    cannot read (CMYK oddities, truncated files) and every other format goes to PIL, whose errors
    (OSError, ValueError) are the ones the dataset's bad-image handling catches.
    """
    is_jpeg = data[:3] == _JPEG_MAGIC
    if is_jpeg and reduce == 1:
        tio_mode = tio.ImageReadMode.GRAY if mode == "L" else tio.ImageReadMode.RGB
        try:
            # torchvision 0.29 deprecates its codecs in favour of TorchCodec (a DeprecationWarning per
            # call) but keeps them; the pinned version is used: decode_jpeg skips PIL's image object.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                return tio.decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=tio_mode)
        except RuntimeError:
            pass  # PIL decides: it reads a few files libjpeg's strict path refuses, or raises OSError
    image = Image.open(io.BytesIO(data))
    if is_jpeg and reduce > 1:
        w, h = image.size
        image.draft(mode, (w // reduce, h // reduce))  # scale 1/reduce (draft picks >= this size)
    image = to_8bit(image)  # 16-bit and float gray images: scaled, not clipped
    if image.mode != mode:  # (convert() to the same mode would copy the image)
        image = image.convert(mode)
    array = np.array(image)  # decodes; a writable copy (asarray's view of PIL memory is read-only)
    return torch.from_numpy(array[:, :, None] if array.ndim == 2 else array).permute(2, 0, 1)


def resized_crop(image: torch.Tensor, top: int, left: int, height: int, width: int, size: int,
                 flip: bool = False, recipe: Recipe = Recipe()) -> torch.Tensor:
    """Crop a uint8 [C, H, W] image, resize it to size x size (the recipe's interpolation, antialiased
    as PIL's; bilinear by default) and maybe mirror it. The result is uint8 [C, size, size] in
    channels-last strides: collate and BatchNormalize copy it anyway, into the usual layout."""
    crop = image[None, :, top:top + height, left:left + width]
    # torch's uint8 antialiased kernel is fastest on channels_last; the crop is copied once here.
    crop = crop.contiguous(memory_format=torch.channels_last)
    out = torch.nn.functional.interpolate(crop, size=(size, size), **interpolate_mode(recipe))[0]
    return out.flip(-1) if flip else out


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # frame headers (DHT, JPG, DAC are not)


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a JPEG's frame header, or None: a few bytes read, nothing decoded
    (about 10x cheaper than opening the file with PIL just for its size)."""
    pos, end = 2, len(data) - 9
    while pos < end:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _SOF_MARKERS:
            return int.from_bytes(data[pos + 7:pos + 9], "big"), int.from_bytes(data[pos + 5:pos + 7], "big")
        if marker == 0xDA:  # start of scan: no frame header before the image data
            return None
        pos += 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
    return None


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) of an encoded image, from its header (PIL's for other formats)."""
    size = jpeg_size(data) if data[:3] == _JPEG_MAGIC else None
    return size if size is not None else Image.open(io.BytesIO(data)).size


class FastTrainDecode:
    """path -> uint8 [C, size, size]: RandomResizedCrop(size) + horizontal flip, as folder_transform.

    A picklable callable, used as the dataset's loader (so decode errors reach its bad-image
    handling). The crop is drawn first by torchvision's own RandomResizedCrop.get_params from the
    size in the header; then the JPEG is decoded at a smaller scale when the crop still holds the
    full output resolution there (decode_scale).
    """

    def __init__(self, size: int, mode: str, recipe: Recipe = Recipe()) -> None:
        self.size, self.mode, self.recipe = size, mode, recipe
        self.scale, self.flip = list(recipe.folder_scale()), recipe.flip_prob(True)

    def __call__(self, path: str) -> torch.Tensor:
        return self.from_bytes(_read(path))

    def from_bytes(self, data: bytes) -> torch.Tensor:
        """The same for an encoded file already in memory (a shard's record)."""
        width, height = image_size(data)
        # get_params only reads the size: a stride-0 view of one element stands for the image.
        shape_only = torch.empty(1, dtype=torch.uint8).expand(1, height, width)
        top, left, h, w = RandomResizedCrop.get_params(shape_only, self.scale, list(self.recipe.ratio))
        image = decode(data, self.mode, decode_scale(data, width, height, w, h, self.size))
        if image.shape[1:] != (height, width):  # decoded at reduced scale: scale the crop box too
            sy, sx = image.shape[1] / height, image.shape[2] / width
            top, left = round(top * sy), round(left * sx)
            h, w = min(max(1, round(h * sy)), image.shape[1] - top), min(max(1, round(w * sx)), image.shape[2] - left)
        return resized_crop(image, top, left, h, w, self.size, bool(torch.rand(1) < self.flip), self.recipe)


class FastEvalDecode:
    """path -> uint8 [C, crop, crop]: shorter side resized to resize_to, then a center crop, as
    folder_transform(train=False); JPEGs at least twice resize_to on the shorter side may be decoded
    at reduced scale (decode_scale)."""

    def __init__(self, resize_to: int, crop: int, mode: str, recipe: Recipe = Recipe()) -> None:
        self.resize_to, self.crop, self.mode, self.recipe = resize_to, crop, mode, recipe

    def __call__(self, path: str) -> torch.Tensor:
        return self.from_bytes(_read(path))

    def from_bytes(self, data: bytes) -> torch.Tensor:
        width, height = image_size(data)
        short = min(width, height)
        image = decode(data, self.mode, decode_scale(data, width, height, short, short, self.resize_to))
        image = v2.functional.resize(image, self.resize_to, interpolation=self.recipe.mode,
                                     antialias=self.recipe.antialias)
        return v2.functional.center_crop(image, [self.crop, self.crop]).contiguous()


class BatchNormalize:
    """uint8 [B, C, H, W] -> float32 (x / 255 - mean) / std, for a whole batch on its device."""

    def __init__(self, stats: Stats, device: torch.device | str = "cpu") -> None:
        mean, std = (torch.tensor(s, dtype=torch.float32, device=device).view(1, -1, 1, 1) for s in stats)
        self.scale, self.shift = 1.0 / (255.0 * std), mean / std

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        # One pass converts the dtype and the layout (workers' crops come in channels-last strides).
        images = images.to(dtype=torch.float32, memory_format=torch.contiguous_format)
        return images.mul_(self.scale).sub_(self.shift)

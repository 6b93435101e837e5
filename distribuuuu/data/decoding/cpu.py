"""Image decoding on the CPU: encoded bytes to uint8 pixels [C, H, W],
1 (gray) or 3 (RGB) channels, whatever the file's mode.

The fast path (TRAIN.IMAGE_DECODE fast, the default) turns a file into
a uint8 crop in the loader worker (FastTrainDecode / FastEvalDecode: the
crop drawn by torchvision's own RandomResizedCrop.get_params from the
image size, then resized on the uint8 tensor); batches are normalized on
the training device (loading/batches.py). JPEGs take a faster road: the
size from the header, decoded by torchvision.io.decode_jpeg
(libjpeg-turbo, as PIL: the same pixels) or, when the crop is at least
twice the output size, at 1/2, 1/4 or 1/8 scale by PIL's draft (libjpeg's
DCT scaling: detail the resize would have averaged away anyway).
"""

from __future__ import annotations

import io
import re
import warnings

import numpy as np
import torch
import torchvision.io as tio
from PIL import Image
from torchvision.transforms import RandomResizedCrop, v2

from distribuuuu.data.transforms import Recipe

# What the datasets treat as an unreadable file.
DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)
# PIL names the file it could not identify, here the bytes in memory.
IN_MEMORY_FILE = re.compile(r" <_io\.BytesIO object at 0x[0-9a-f]+>")


def decode_error(error: Exception) -> str:
    """'Type: message' of a decode error, for a line that names the file
    itself (PIL's message would name '<_io.BytesIO object at 0x...>')."""
    return IN_MEMORY_FILE.sub("", f"{type(error).__name__}: {error}")


WIDE_GRAY_MODES = (
    "I;16",
    "I;16L",
    "I;16B",
    "I;16N",
    "I",
    "F",
)  # PIL's 16/32-bit single-channel modes


JPEG_MAGIC = b"\xff\xd8\xff"


def to_8bit(image: Image.Image) -> Image.Image:
    """A 16- or 32-bit gray image (PIL modes I;16*, I, F) as 8-bit 'L',
    scaled; others unchanged.

    PIL's convert('L' or 'RGB') clips such values at 255, so a 16-bit
    PNG (0..65535) came out nearly all white. Integer values are read as
    16-bit (what PIL makes of 16-bit PNG, TIFF and PGM files) and keep
    their high byte, v // 256, as PIL itself reduces 16-bit RGB PNGs;
    floats in [0, 1] are scaled by 255, other floats read as 16-bit
    values.
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


def as_mode(image: Image.Image, mode: str) -> Image.Image:
    """image in mode 'L' or 'RGB' (any file: L, P, RGBA, CMYK, 16-bit
    ... gets IN_CHANS channels)."""
    image = to_8bit(image) if image.mode in WIDE_GRAY_MODES else image
    if image.mode == mode:
        return image  # (convert() to its own mode would copy)
    return image.convert(mode)


def open_image(data: bytes, mode: str) -> Image.Image:
    """An encoded image, decoded by PIL, in mode 'L' or 'RGB'."""
    image = Image.open(io.BytesIO(data))
    image.load()
    return as_mode(image, mode)


def pil_tensor(image: Image.Image, mode: str) -> torch.Tensor:
    """uint8 [C, H, W] of an opened image in mode (C = 1 for 'L', 3 for
    'RGB'); decodes it."""
    array = np.array(
        as_mode(image, mode)
    )  # a writable copy (asarray's view of PIL memory is read-only)
    return torch.from_numpy(array[:, :, None] if array.ndim == 2 else array).permute(2, 0, 1)


def decode(data: bytes, mode: str, reduce: int = 1) -> torch.Tensor:
    """uint8 [C, H, W] of an encoded image file. reduce > 1 decodes a
    JPEG at 1/reduce scale (PIL draft); other JPEGs go to decode_jpeg.
    What it cannot read (CMYK oddities, truncated files) and every other
    format goes to PIL, whose errors (OSError, ValueError) the bad-image
    handling catches."""
    is_jpeg = data[:3] == JPEG_MAGIC
    if is_jpeg and reduce == 1:
        tio_mode = tio.ImageReadMode.GRAY if mode == "L" else tio.ImageReadMode.RGB
        try:
            # torchvision 0.29 deprecates its codecs in favour of
            # TorchCodec (a DeprecationWarning per call) but keeps them;
            # the pinned version is used: decode_jpeg skips PIL's image
            # object.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                return tio.decode_jpeg(
                    torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=tio_mode
                )
        except RuntimeError:
            # PIL decides: it reads a few files libjpeg's strict path
            # refuses, or raises OSError
            pass
    image = Image.open(io.BytesIO(data))
    if is_jpeg and reduce > 1:
        image.draft(
            mode, (image.size[0] // reduce, image.size[1] // reduce)
        )  # draft picks >= this size
    return pil_tensor(image, mode)


_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {
    0xC4,
    0xC8,
    0xCC,
}  # frame headers (DHT, JPG, DAC are not)


def jpeg_frame(data: bytes) -> tuple[int, int, int, int, int] | None:
    """(frame marker, bits per sample, width, height, components) from a
    JPEG's frame header, or None: a few bytes read, nothing decoded
    (about 10x cheaper than opening the file with PIL just for its
    size)."""
    pos, end = 2, len(data) - 10
    while pos < end:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _SOF_MARKERS:
            return (
                marker,
                data[pos + 4],
                int.from_bytes(data[pos + 7 : pos + 9], "big"),
                int.from_bytes(data[pos + 5 : pos + 7], "big"),
                data[pos + 9],
            )
        if marker == 0xDA:  # start of scan: no frame header before the image data
            return None
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
    return None


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a JPEG's frame header (jpeg_frame), or None."""
    frame = jpeg_frame(data)
    return None if frame is None else frame[2:4]


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) of an encoded image, from its header (PIL's for
    other formats)."""
    size = jpeg_size(data) if data[:3] == JPEG_MAGIC else None
    return size if size is not None else Image.open(io.BytesIO(data)).size


# Decoding at 1/2 goes through PIL, whose decoder is slower than
# decode_jpeg's: on ~500x375 JPEGs a half-size PIL decode took as long
# as a full-size decode_jpeg (benchmarks/overhead.py, jpeg), on 1000x750
# ones it was 8% faster end to end. So 1/2 is used from this many pixels
# on; 1/4 and 1/8 always pay.
HALF_SCALE_MIN_PIXELS = 500_000


def draft_factor(crop_w: int, crop_h: int, out_w: int, out_h: int) -> int:
    """The largest k of 1, 2, 4, 8 that keeps the crop, decoded at 1/k
    scale, >= the output size."""
    k = 1
    while k < 8 and crop_w >= 2 * k * out_w and crop_h >= 2 * k * out_h:
        k *= 2
    return k


def decode_scale(data: bytes, width: int, height: int, crop_w: int, crop_h: int, out: int) -> int:
    """1/k, the scale to decode this file at so that the crop still
    covers out x out pixels: draft_factor for JPEGs (1/2 only for large
    images, see HALF_SCALE_MIN_PIXELS), else 1."""
    if data[:3] != JPEG_MAGIC:
        return 1
    k = draft_factor(crop_w, crop_h, out, out)
    return 1 if k == 2 and width * height < HALF_SCALE_MIN_PIXELS else k


class FastTrainDecode:
    """An encoded image -> uint8 [C, size, size]: RandomResizedCrop(size)
    and a horizontal flip, as transforms.folder_transform draws them. A
    picklable callable, the dataset's decoder (so that decode errors meet
    its handling of unreadable images). The result has channels-last
    strides: collate and NormalizedBatches copy it anyway."""

    def __init__(self, size: int, mode: str, recipe: Recipe = Recipe()) -> None:
        self.size, self.mode, self.recipe = size, mode, recipe
        self.scale, self.ratio, self.flip = (
            list(recipe.folder_scale()),
            list(recipe.ratio),
            recipe.flip_prob(True),
        )
        # torch.nn.functional.interpolate's arguments of the recipe's
        # interpolation (antialiased as PIL's)
        self.interpolate = (
            {"mode": "nearest"}
            if recipe.interpolation == "nearest"
            else {"mode": recipe.interpolation, "antialias": True, "align_corners": False}
        )

    def __call__(self, data: bytes) -> torch.Tensor:
        if data[:3] == JPEG_MAGIC:
            return self._jpeg_crop(data)
        image = Image.open(io.BytesIO(data))
        box = RandomResizedCrop.get_params(image, self.scale, self.ratio)  # reads the size only
        return self.resized_crop(pil_tensor(image, self.mode), *box)

    def _jpeg_crop(self, data: bytes) -> torch.Tensor:
        """The crop drawn from the size in the header; then the JPEG
        decoded at a smaller scale when the crop still holds the full
        output resolution there (decode_scale), the crop box scaled with
        it."""
        width, height = image_size(data)
        # stands for the image: get_params reads its size only
        shape_only = torch.empty(1, dtype=torch.uint8).expand(1, height, width)
        top, left, h, w = RandomResizedCrop.get_params(shape_only, self.scale, self.ratio)
        image = decode(data, self.mode, decode_scale(data, width, height, w, h, self.size))
        if image.shape[1:] != (height, width):  # decoded at reduced scale
            sy, sx = image.shape[1] / height, image.shape[2] / width
            top, left = round(top * sy), round(left * sx)
            h, w = (
                min(max(1, round(h * sy)), image.shape[1] - top),
                min(max(1, round(w * sx)), image.shape[2] - left),
            )
        return self.resized_crop(image, top, left, h, w)

    def resized_crop(
        self, image: torch.Tensor, top: int, left: int, height: int, width: int
    ) -> torch.Tensor:
        """The crop of a uint8 [C, H, W] image resized to size x size
        (torch's uint8 antialiased kernel, fastest on channels_last: the
        crop is copied once), mirrored with probability flip."""
        crop = image[None, :, top : top + height, left : left + width].contiguous(
            memory_format=torch.channels_last
        )
        out = torch.nn.functional.interpolate(
            crop, size=(self.size, self.size), **self.interpolate
        )[0]
        return out.flip(-1) if torch.rand(1) < self.flip else out


class FastEvalDecode:
    """An encoded image -> uint8 [C, crop, crop]: shorter side resized
    to resize_to, then a center crop, as folder_transform(train=False)."""

    def __init__(self, resize_to: int, crop: int, mode: str, recipe: Recipe = Recipe()) -> None:
        self.resize_to, self.crop, self.mode, self.recipe = resize_to, crop, mode, recipe

    def __call__(self, data: bytes) -> torch.Tensor:
        image = (
            self._jpeg(data)
            if data[:3] == JPEG_MAGIC
            else pil_tensor(Image.open(io.BytesIO(data)), self.mode)
        )
        image = v2.functional.resize(
            image, self.resize_to, interpolation=self.recipe.mode, antialias=self.recipe.antialias
        )
        return v2.functional.center_crop(image, [self.crop, self.crop]).contiguous()

    def _jpeg(self, data: bytes) -> torch.Tensor:
        """A JPEG whose shorter side is at least twice resize_to may be
        decoded at reduced scale (decode_scale)."""
        width, height = image_size(data)
        short = min(width, height)
        return decode(
            data, self.mode, decode_scale(data, width, height, short, short, self.resize_to)
        )


def can_decode(data: bytes) -> str | None:
    """None when data decodes as an image, else why not. JPEGs are
    decoded at 1/8 scale (PIL draft): the whole file is still read, at a
    fraction of the cost."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.draft(image.mode, (1, 1))  # JPEG only; a no-op for other formats
            image.load()
        return None
    except DECODE_ERRORS as e:
        return decode_error(e)

"""Image files: an image folder's listing, decoding, and the folder
dataset.

``list_split`` lists a split of an image folder (sources.LAYOUT) as
torchvision's ImageFolder does (symlinks followed, the same files in the
same order), in one walk that never enters a symlink to a folder
containing it (``ln -s .. train/2/loop`` would list 300 images as tens
of thousands): such loops are recorded and refused (require_no_loop).
Each file keeps readdir's inode number, free, with which checks.py finds
the same file listed twice.

The fast path (TRAIN.IMAGE_DECODE fast, the default): the worker turns a
file into a uint8 crop (FastTrainDecode / FastEvalDecode: the crop is
drawn by torchvision's own RandomResizedCrop.get_params from the image
size, so the crops are torchvision's, then resized on the uint8 tensor),
and batches.NormalizedBatches normalizes whole batches on the training
device: no per-image float conversion, 4x fewer bytes from the workers.
JPEGs take a faster road (_jpeg_crop): the size from the header, decoded
by torchvision.io.decode_jpeg (libjpeg-turbo, as PIL, the same pixels)
or, when the crop is at least twice the output size, at 1/2, 1/4 or 1/8
scale by PIL's draft (libjpeg's DCT scaling: detail the resize would
have averaged away anyway).
"""

from __future__ import annotations

import io
import logging
import multiprocessing
import os
import pathlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torchvision.io as tio
from PIL import Image
from torch.utils.data import Dataset, get_worker_info
from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension
from torchvision.transforms import RandomResizedCrop, v2

from distribuuuu.data.transforms import Recipe
from distribuuuu.errors import UserError

NAMED = 5  # how many offenders a message names

# What the datasets treat as an unreadable file.
DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)

log = logging.getLogger("distribuuuu")


# ---------------------------------------------------------------------------------------------
# The listing
# ---------------------------------------------------------------------------------------------
@dataclass
class SplitListing:
    """The image files of a split, per class in ImageFolder's order, and
    the symlink loops met. entries: class -> [(path, readdir's inode
    number, None for a symlink)]."""

    split_dir: str
    classes: list[str]
    entries: dict[str, list[tuple[str, int | None]]]
    loops: list[tuple[str, str]]  # (symlink, the real folder it points to)

    def files(self, cls: str) -> list[str]:
        return [path for path, _ in self.entries.get(cls, [])]

    def count(self, cls: str) -> int:
        return len(self.entries.get(cls, []))

    def samples(self) -> list[tuple[str, int]]:
        """(path, class index) of every listed file, as
        DatasetFolder.make_dataset returns them."""
        index = {c: i for i, c in enumerate(self.classes)}
        return [(path, index[c]) for c in sorted(self.classes) for path in self.files(c)]


def list_split(split_dir: str, classes: list[str]) -> SplitListing:
    """The image files of split_dir/<class> for each class (folders that
    do not exist: none)."""
    listing = SplitListing(split_dir, list(classes), {}, [])
    for c in classes:
        if os.path.isdir(os.path.join(split_dir, c)):
            listing.entries[c] = _walk_class(os.path.join(split_dir, c), listing.loops)
    return listing


def _walk_class(class_dir: str, loops: list[tuple[str, str]]) -> list[tuple[str, int | None]]:
    """The image files below class_dir, os.walk(followlinks=True)'s,
    sorted as ImageFolder sorts them, except that a symlinked folder
    pointing to a folder that contains it (real paths compared down the
    way) is recorded in loops and not entered. Unreadable folders are
    skipped, as os.walk skips them."""
    found: list[tuple[str, list[tuple[str, int | None]]]] = []
    stack = [
        (class_dir, (os.path.realpath(class_dir),))
    ]  # (listed path, real paths from the class down)
    while stack:
        root, chain = stack.pop()
        try:
            with os.scandir(root) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            continue
        files = []
        for e in entries:
            try:
                is_dir = e.is_dir()  # follows symlinks, as os.walk(followlinks=True)
            except OSError:
                is_dir = False
            if is_dir:
                real = (
                    os.path.realpath(e.path) if e.is_symlink() else os.path.join(chain[-1], e.name)
                )
                if any(r == real or r.startswith(real.rstrip(os.sep) + os.sep) for r in chain):
                    loops.append((e.path, real))
                else:
                    stack.append((e.path, (*chain, real)))
            elif has_file_allowed_extension(e.name, IMG_EXTENSIONS):
                files.append((e.path, None if e.is_symlink() else e.inode()))
        found.append((root, files))
    return [file for _, files in sorted(found, key=lambda f: f[0]) for file in files]


def require_no_loop(listing: SplitListing, key: str) -> SplitListing:
    """The listing, or a UserError naming the symlinks that point to a
    folder containing them."""
    if listing.loops:
        shown = "; ".join(f"{link} -> {target}" for link, target in listing.loops[:NAMED])
        more = f" (and {len(listing.loops) - NAMED} more)" if len(listing.loops) > NAMED else ""
        raise UserError(
            f"{key}.DATASET: {len(listing.loops)} symlink(s) in {listing.split_dir} point to a "
            "folder "
            "that contains them, a loop that would list the same images over and over: "
            f"{shown}{more}. "
            f"Remove them (rm {listing.loops[0][0]}) or point them outside the class folders"
        )
    return listing


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------
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
    return (
        image if image.mode == mode else image.convert(mode)
    )  # (convert() to its own mode would copy)


def open_image(file: str | bytes, mode: str) -> Image.Image:
    """A file (or an encoded file's bytes: a shard's record), decoded,
    in mode 'L' or 'RGB'."""
    with io.BytesIO(file) if isinstance(file, bytes) else open(file, "rb") as f:
        image = Image.open(f)
        image.load()  # decoded while the file is open
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
    """A file (path, or its bytes: a shard's record) -> uint8 [C, size,
    size]: RandomResizedCrop(size) and a horizontal flip, as
    transforms.folder_transform draws them. A picklable callable, used
    as the dataset's loader (so decode errors reach its bad-image
    handling). The result has channels-last strides: collate and
    NormalizedBatches copy it anyway, into the usual layout."""

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

    def __call__(self, file: str | bytes) -> torch.Tensor:
        data = file if isinstance(file, bytes) else pathlib.Path(file).read_bytes()
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
        shape_only = torch.empty(1, dtype=torch.uint8).expand(
            1, height, width
        )  # stands for the image
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
    """A file (path or bytes) -> uint8 [C, crop, crop]: shorter side
    resized to resize_to, then a center crop, as
    folder_transform(train=False)."""

    def __init__(self, resize_to: int, crop: int, mode: str, recipe: Recipe = Recipe()) -> None:
        self.resize_to, self.crop, self.mode, self.recipe = resize_to, crop, mode, recipe

    def __call__(self, file: str | bytes) -> torch.Tensor:
        data = file if isinstance(file, bytes) else pathlib.Path(file).read_bytes()
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


# ---------------------------------------------------------------------------------------------
# The folder dataset
# ---------------------------------------------------------------------------------------------
class BadImageError(RuntimeError):
    """An image that cannot be decoded, with TRAIN.BAD_IMAGES fail."""


class FolderDataset(Dataset):
    """The (image, label) items of a listed split: loader(path), then
    transform. A class folder without images is allowed here
    (check_datasets refuses it).

    A file that cannot be decoded (truncated, empty, not an image) stops
    the run naming it with bad_images 'fail'; with 'skip' it is logged
    by name and flagged (counted once however often it is drawn or
    tried), and in training (replace_bad) the next readable item stands
    in, so that every rank keeps its batch size and DDP its step count;
    in evaluation the item is None, left out of its batch
    (pipeline.collate_readable), so that n counts distinct readable
    images.
    """

    MAX_BAD_IN_A_ROW = 32

    def __init__(
        self,
        listing: SplitListing,
        loader: Callable[[str], Any],
        transform: Callable | None = None,
        bad_images: str = "skip",
        replace_bad: bool = True,
    ) -> None:
        self.root, self.classes, self.samples = (
            listing.split_dir,
            listing.classes,
            listing.samples(),
        )
        self.targets = [label for _, label in self.samples]
        self.loader, self.transform, self.bad_images, self.replace_bad = (
            loader,
            transform,
            bad_images,
            replace_bad,
        )
        # Shared with the DataLoader's worker processes, which inherit
        # them when they start.
        self.unreadable = multiprocessing.Array(
            "b", len(self.samples), lock=False
        )  # a flag per sample
        self._positions: dict[
            str, int
        ] = {}  # path -> index, made at this process's first unreadable file
        self.item_seeds = multiprocessing.Array(
            "q", [0, 0, 0], lock=False
        )  # (on, seed, epoch): seed_items

    def __len__(self) -> int:
        return len(self.samples)

    def seed_items(self, seed: int, epoch: int) -> None:
        """From now on a loader worker seeds torch's RNG by (seed,
        epoch, index) before it loads an item, so an item's crops and
        flips do not depend on which worker made it or what that worker
        made before: a resumed epoch augments as the straight run did.
        (Without workers the main process draws them, and a checkpoint
        restores its RNG.)"""
        self.item_seeds[:] = [1, seed, epoch]

    def __getitem__(self, index: int) -> tuple[Any, int] | None:
        on, seed, epoch = self.item_seeds
        if on and get_worker_info() is not None:
            # The CPU generator only: torch.manual_seed also seeds every
            # other device (~130 us a call here, ~1 us this).
            torch.default_generator.manual_seed(
                ((seed * 1_000_003 + epoch) * 1_000_000_007 + index) % 2**63
            )
        path, label = self.samples[index]
        try:
            image = self.loader(path)
        except DECODE_ERRORS as e:
            self.note_unreadable(path, e)
            return self.next_readable(index) if self.replace_bad else None
        return (image if self.transform is None else self.transform(image)), label

    def note_unreadable(self, path: str, error: Exception) -> None:
        """BadImageError with TRAIN.BAD_IMAGES fail; else the file is
        flagged, with a warning naming it the first time since the last
        take_unreadable."""
        if self.bad_images == "fail":
            raise BadImageError(
                f"cannot decode image {path} ({type(error).__name__}: {error}); remove it, "
                "or set TRAIN.BAD_IMAGES skip to skip unreadable files"
            ) from None
        self._positions = self._positions or {p: i for i, (p, _) in enumerate(self.samples)}
        index = self._positions[path]
        if not self.unreadable[index]:
            self.unreadable[index] = 1
            log.warning("skipping unreadable image %s (%s: %s)", path, type(error).__name__, error)

    def next_readable(self, index: int) -> tuple[Any, int]:
        """The first readable item after the unreadable item index
        (training)."""
        for attempt in range(1, min(len(self), self.MAX_BAD_IN_A_ROW)):
            path, label = self.samples[(index + attempt) % len(self)]
            try:
                image = self.loader(path)
            except DECODE_ERRORS as e:
                self.note_unreadable(path, e)
                continue
            return (image if self.transform is None else self.transform(image)), label
        raise BadImageError(
            f"{self.MAX_BAD_IN_A_ROW} unreadable images in a row in {self.root}; "
            "is this an image folder?"
        )

    def take_unreadable(self) -> list[int]:
        """The samples found unreadable since the last call (by any
        worker of this process), each once."""
        flags = np.frombuffer(self.unreadable, dtype=np.int8)
        found = np.flatnonzero(flags)
        flags[found] = 0  # only these: a worker may flag another meanwhile
        return found.tolist()

    def take_bad_count(self) -> int:
        return len(self.take_unreadable())

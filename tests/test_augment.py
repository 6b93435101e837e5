"""TRAIN.AUTO_AUGMENT, TRAIN.RANDOM_ERASE and TRAIN.REPEATED_AUG in every input pipeline."""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import pytest
import torch
import torch.nn.functional as F
from torchvision.transforms import v2

from distribuuuu import data
from distribuuuu.data import transforms
from distribuuuu.data.loading import batches
from distribuuuu.data.loading.memory import MemoryLoader, pad_crop_flip
from distribuuuu.data.loading.samplers import ResumableDistributedSampler
from distribuuuu.data.sources import builtin
from tests.conftest import (
    TINY,
    check,
    distribuuuu,
    make_cfg,
    read_metrics,
    write_constant_image_tree,
)

torch.set_num_threads(1)
CPU = torch.device("cpu")
POLICIES = {"randaugment": v2.RandAugment, "trivialaugment": v2.TrivialAugmentWide, "autoaugment": v2.AutoAugment}
MNIST = {"TRAIN.DATASET": "mnist5k", "TEST.DATASET": "mnist5k", "MODEL.NUM_CLASSES": 10,
         "MODEL.IN_CHANS": 1, "TRAIN.IM_SIZE": 28, "TRAIN.WORKERS": 0, "TRAIN.BATCH_SIZE": 16, "RNG_SEED": 0}
MNIST_NORM = batches.BatchNormalize(transforms.MNIST_STATS)


def _digit_copies(n: int) -> torch.Tensor:
    """n copies of one mnist5k digit, uint8 [n, 1, 28, 28]."""
    images, _ = builtin.load_mnist5k("train", "TRAIN")
    return images[:1].expand(n, -1, -1, -1).contiguous()


def _flat_memory_loader(images: torch.Tensor, batch: int, policy=None, erase=None) -> MemoryLoader:
    """A MemoryLoader without crops or flips: only the policy and erasing can change an image."""
    n = len(images)
    sampler = ResumableDistributedSampler(range(n), 1, 0)
    return MemoryLoader(range(n), images, torch.zeros(n, dtype=torch.long), sampler, batch, drop_last=False,
                        normalize=MNIST_NORM, policy=policy, erase=erase)


def _distinct(images: torch.Tensor) -> int:
    return len({im.numpy().tobytes() for im in images})


# ---------------------------------------------------------------------------------------------
# Policies: per image, in every pipeline
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(POLICIES))
def test_memory_path_draws_the_policy_per_image(name):
    loader = data.build_train_loader(make_cfg({**MNIST, "TRAIN.AUTO_AUGMENT": name}), 0, 1, CPU)
    assert isinstance(loader, MemoryLoader) and isinstance(loader.policy, POLICIES[name])
    if name == "randaugment":
        assert loader.policy.num_ops == 2 and loader.policy.magnitude == 9
    if name == "autoaugment":
        assert loader.policy.policy == v2.AutoAugmentPolicy.IMAGENET
    copies = _digit_copies(16)
    torch.manual_seed(0)
    plain = next(iter(_flat_memory_loader(copies, 16)))[0]
    assert _distinct(plain) == 1  # the control: without a policy the copies stay equal
    out = next(iter(_flat_memory_loader(copies, 16, policy=loader.policy)))[0]
    assert out.shape == plain.shape and out.dtype == torch.float32
    assert _distinct(out) > 1, "one policy draw for the whole batch"


@pytest.mark.parametrize("name", list(POLICIES))
def test_per_sample_small_image_path_applies_the_policy_after_the_crop(name):
    cfg = make_cfg({**MNIST, "TRAIN.AUTO_AUGMENT": name, "TRAIN.DATA_PIPELINE": "loader"})
    steps = data.build_train_loader(cfg, 0, 1, CPU).dataset.transform.transforms
    assert [type(s) for s in steps] == [v2.RandomCrop, POLICIES[name], v2.ToDtype, v2.Normalize]
    tf = transforms.small_image_transform(True, 28, 28, pad=0, flip=False, stats=transforms.MNIST_STATS,
                                          policy=steps[1])
    torch.manual_seed(1)
    out = torch.stack([tf(image) for image in _digit_copies(16)])
    assert out.shape == (16, 1, 28, 28) and out.dtype == torch.float32
    assert _distinct(out) > 1


@pytest.mark.parametrize("decode", ["fast", "pil"])
def test_folder_paths_apply_the_policy_and_erasing_per_image(tmp_path, decode):
    # Flat images: every crop and flip of one is the same flat image, so only the policy or the
    # erasing can make two of them differ.
    write_constant_image_tree(str(tmp_path), "train", {"a": 8, "b": 8})
    base = {"TRAIN.DATASET": str(tmp_path), "TEST.DATASET": str(tmp_path), "TRAIN.SPLIT": "train",
            "TEST.SPLIT": "train", "MODEL.NUM_CLASSES": 2, "TRAIN.TOPK": 1, "TRAIN.IM_SIZE": 12,
            "TEST.IM_SIZE": 12, "TRAIN.WORKERS": 0, "TRAIN.BATCH_SIZE": 16, "RNG_SEED": 0,
            "TRAIN.IMAGE_DECODE": decode}

    def batch(**keys) -> torch.Tensor:
        torch.manual_seed(0)
        loader = data.build_train_loader(make_cfg({**base, **keys}), 0, 1, CPU)
        return next(iter(loader))[0]

    plain = batch()
    assert plain.shape == (16, 3, 12, 12) and plain.dtype == torch.float32 and _distinct(plain) == 1
    flat = plain[0]
    augmented = batch(**{"TRAIN.AUTO_AUGMENT": "randaugment"})
    assert augmented.shape == plain.shape and augmented.dtype == torch.float32
    assert _distinct(augmented) > 1
    erased = batch(**{"TRAIN.RANDOM_ERASE": 1.0})
    changed = (erased != flat).flatten(1).any(1)
    assert changed.all(), "p = 1: every image gets its own rectangle"
    assert _distinct(erased) == 16


# ---------------------------------------------------------------------------------------------
# Random erasing
# ---------------------------------------------------------------------------------------------
def _erased_masks(out: torch.Tensor, flat: torch.Tensor, atol: float = 0.0) -> torch.Tensor:
    """[B, H, W]: the pixels that erasing replaced by noise (which hits the flat value exactly with
    probability ~0, and within atol = 1e-4 with probability ~1e-4 per pixel)."""
    return (~torch.isclose(out, flat, rtol=0, atol=atol)).any(1)


def test_batch_erasing_rate_is_p_per_image_in_the_memory_path():
    # 4,096 flat images, p = 0.25: the erased count is Binomial(4096, 0.25), sd 0.0068 in rate;
    # a 5-sd bound (0.034) fails by chance with probability < 1e-6.
    n, p = 4096, 0.25
    cfg = make_cfg({**MNIST, "TRAIN.RANDOM_ERASE": p})
    loader = data.build_train_loader(cfg, 0, 1, CPU)
    assert isinstance(loader.erase, transforms.BatchRandomErasing) and loader.erase.p == p
    images = torch.full((n, 1, 28, 28), 90, dtype=torch.uint8)
    torch.manual_seed(0)
    out = torch.cat([x for x, _ in _flat_memory_loader(images, 256, erase=loader.erase)])
    flat = MNIST_NORM(images[:1])[0]
    masks = _erased_masks(out, flat)
    rate = masks.flatten(1).any(1).float().mean().item()
    assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / n)
    for m in masks[masks.flatten(1).any(1)][:200]:  # each erased region is one full rectangle
        rows, cols = m.any(1).nonzero(), m.any(0).nonzero()
        box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
        assert m.sum() == box


def test_per_sample_erasing_rate_and_the_batched_rectangles_match_torchvision():
    # Per-sample path: 2,000 flat images at p = 0.25 (sd 0.0097; 5-sd bound).
    n, p = 2000, 0.25
    cfg = make_cfg({**MNIST, "TRAIN.RANDOM_ERASE": p, "TRAIN.DATA_PIPELINE": "loader"})
    steps = data.build_train_loader(cfg, 0, 1, CPU).dataset.transform.transforms
    assert isinstance(steps[-1], v2.RandomErasing) and steps[-1].p == p and steps[-1].value is None  # 'random'
    image = torch.full((1, 28, 28), 90, dtype=torch.uint8)
    tf = v2.Compose(steps[1:])  # the crop of a flat image is the flat image (padding aside): skip it
    torch.manual_seed(0)
    out = torch.stack([tf(image) for _ in range(n)])
    flat = MNIST_NORM(image[None])[0]
    # (v2.Normalize and BatchNormalize differ in the last bits: compare within 1e-4)
    rate = _erased_masks(out, flat, atol=1e-4).flatten(1).any(1).float().mean().item()
    assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / n)
    # p = 1: the erased area of BatchRandomErasing and of torchvision's RandomErasing have the same
    # mean (area uniform in [0.02, 0.33] of the image: sd ~0.09 per image, 0.003 for the difference
    # of two means of 2,000; bound 0.02) and the noise is standard normal.
    x = torch.zeros(n, 1, 32, 32)
    ours = transforms.BatchRandomErasing(1.0)(x)
    theirs = torch.stack([transforms.random_erasing(1.0)(im) for im in x])
    area_ours, area_theirs = (ours != 0).float().mean().item(), (theirs != 0).float().mean().item()
    assert abs(area_ours - area_theirs) < 0.02 and 0.12 < area_ours < 0.22
    noise = ours[ours != 0]
    assert abs(noise.mean().item()) < 0.02 and abs(noise.std().item() - 1) < 0.02


# ---------------------------------------------------------------------------------------------
# Off by default: the same batches as the pipelines without these keys
# ---------------------------------------------------------------------------------------------
def test_off_by_default_memory_batches_equal_crop_flip_normalize():
    cfg = make_cfg({**MNIST, "TRAIN.RANDAUG_MAGNITUDE": 20})  # a magnitude alone changes nothing
    loader = data.build_train_loader(cfg, 0, 1, CPU)
    assert loader.policy is None and loader.erase is None and loader.sampler.repeats == 1
    loader.sampler.set_epoch(1)
    torch.manual_seed(0)
    got = [x for _, (x, _) in zip(range(3), loader)]
    after = torch.rand(4)
    images, _ = builtin.load_mnist5k("train", "TRAIN")
    padded, order = F.pad(images, (2,) * 4), torch.tensor(list(loader.sampler))
    torch.manual_seed(0)
    want = [MNIST_NORM(pad_crop_flip(padded, order[b * 16:(b + 1) * 16], 28, 2, False)) for b in range(3)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(after, torch.rand(4))  # no extra random numbers drawn


def test_off_by_default_per_sample_and_fast_paths_add_nothing(tmp_path):
    cfg = make_cfg({**MNIST, "TRAIN.DATA_PIPELINE": "loader"})
    loader = data.build_train_loader(cfg, 0, 1, CPU)
    steps = loader.dataset.transform.transforms
    assert [type(s) for s in steps] == [v2.RandomCrop, v2.ToDtype, v2.Normalize]
    ref = v2.Compose([v2.RandomCrop(28, padding=2, fill=0), v2.ToDtype(torch.float32, scale=True),
                      v2.Normalize(mean=[0.1307], std=[0.3081])])
    images, _ = builtin.load_mnist5k("train", "TRAIN")
    torch.manual_seed(0)
    x, _ = next(iter(loader))
    after = torch.rand(4)
    torch.manual_seed(0)
    want = torch.stack([ref(images[i]) for i in list(loader.sampler)[:16]])
    assert torch.equal(x, want) and torch.equal(after, torch.rand(4))
    write_constant_image_tree(str(tmp_path), "train", {"a": 2})
    fast = data.build_train_loader(make_cfg({"TRAIN.DATASET": str(tmp_path), "MODEL.NUM_CLASSES": 1,
                                             "TRAIN.TOPK": 1, "TRAIN.WORKERS": 0, "TRAIN.IM_SIZE": 8}), 0, 1, CPU)
    assert fast.dataset.transform is None and fast.erase is None


# ---------------------------------------------------------------------------------------------
# Repeated augmentation sampler
# ---------------------------------------------------------------------------------------------
def _shards(size: int, world: int, k: int, epoch: int = 0, start: int = 0, seed: int = 3) -> list[list[int]]:
    """Every rank's indices, each from its own sampler (as on separate processes)."""
    out = []
    for rank in range(world):
        s = ResumableDistributedSampler(range(size), world, rank, seed=seed, repeats=k)
        s.set_epoch(epoch, start)
        out.append(list(s))
        assert len(out[-1]) == len(s) == (size - start) // world
    return out


def _global_order(shards: list[list[int]]) -> list[int]:
    """Position p of the sharded order is shards[p % W][p // W]."""
    return [shards[p % len(shards)][p // len(shards)] for p in range(len(shards[0]) * len(shards))]


@pytest.mark.parametrize("size, world, k", [(30, 3, 3), (31, 3, 3), (40, 4, 2), (17, 2, 2), (12, 4, 3), (25, 2, 3)])
def test_repeat_sampler_copies_land_on_different_ranks_and_epoch_keeps_its_length(size, world, k):
    shards = _shards(size, world, k, epoch=2)
    order = _global_order(shards)  # consistent only if every rank drew the same permutation
    assert len(order) == size // world * world  # an epoch is still len(dataset) samples (tail < W dropped)
    groups = [order[j:j + k] for j in range(0, len(order), k)]
    assert all(len(set(g)) == 1 for g in groups), "the k copies of an index are adjacent"
    heads = [g[0] for g in groups]
    assert len(set(heads)) == len(heads) == math.ceil(len(order) / k), "one shuffled index per group"
    ranks_of = defaultdict(list)
    for rank, shard in enumerate(shards):
        for i in shard:
            ranks_of[i].append(rank)
    if k <= world:
        assert all(len(set(r)) == len(r) for r in ranks_of.values()), "two copies on one rank"
    else:  # more copies than ranks: spread as evenly as possible
        assert all(max(Counter(r).values()) <= math.ceil(k / world) for r in ranks_of.values())
    assert _shards(size, world, k, epoch=3) != shards  # a new shuffle per epoch


def test_repeat_sampler_resumes_mid_epoch_with_exactly_the_rest():
    size, k, epoch = 60, 3, 5
    full = _shards(size, 2, k, epoch)
    (order,) = _shards(size, 1, k, epoch)  # the whole repeated order of the epoch
    assert _global_order(full) == order
    for consumed in (24, 25, 31):  # at, inside and across groups of copies
        if consumed % 2 == 0:  # same world size: each rank continues its own shard
            assert _shards(size, 2, k, epoch, start=consumed) == [s[consumed // 2:] for s in full]
        rest = _shards(size, 3, k, epoch, start=consumed)  # another world size
        usable = (size - consumed) // 3 * 3
        assert _global_order(rest) == order[consumed:consumed + usable]
        ranks_of = defaultdict(set)
        for rank, shard in enumerate(rest):
            for i in shard:
                assert rank not in ranks_of[i]
                ranks_of[i].add(rank)


def test_repeat_sampler_with_one_process_repeats_indices_in_place():
    (order,) = _shards(10, 1, 2)
    assert len(order) == 10 and order[0::2] == order[1::2] and len(set(order)) == 5
    with pytest.raises(ValueError):
        ResumableDistributedSampler(range(4), 1, 0, repeats=0)


def test_both_train_pipelines_use_it_and_copies_get_their_own_augmentation():
    mem = data.build_train_loader(make_cfg({**MNIST, "TRAIN.REPEATED_AUG": 2}), 0, 1, CPU)
    dl = data.build_train_loader(make_cfg({**MNIST, "TRAIN.REPEATED_AUG": 3, "TRAIN.DATA_PIPELINE": "loader"}),
                                 0, 2, CPU)
    assert isinstance(mem, MemoryLoader) and mem.sampler.repeats == 2 and dl.sampler.repeats == 3
    assert len(mem.sampler) == 4000 and len(dl.sampler) == 2000
    torch.manual_seed(0)
    x, _ = next(iter(mem))  # one process: the two copies of an index are neighbours in the batch
    order = list(mem.sampler)[:16]
    assert order[0::2] == order[1::2]
    differ = [not torch.equal(x[j], x[j + 1]) for j in range(0, 16, 2)]
    assert sum(differ) >= 5  # own crop per copy (the same one of 25 offsets by chance only)


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_training_with_randaugment_erasing_and_repeats_on_two_processes(tmp_path):
    out = str(tmp_path / "run")
    check(distribuuuu("train", "--nproc-per-node", "2", "--cfg", TINY, "OUT_DIR", out,
                      "TRAIN.DATASET", "mnist5k", "TEST.DATASET", "mnist5k", "MODEL.NUM_CLASSES", "10",
                      "MODEL.IN_CHANS", "1", "TRAIN.IM_SIZE", "14", "TEST.IM_SIZE", "14",
                      "TRAIN.BATCH_SIZE", "64", "TEST.BATCH_SIZE", "250", "OPTIM.MAX_EPOCH", "1",
                      "TRAIN.PRINT_FREQ", "100", "TRAIN.AUTO_AUGMENT", "randaugment", "TRAIN.RANDOM_ERASE", "0.25",
                      "TRAIN.REPEATED_AUG", "2"))
    lines = read_metrics(out)
    train = [m for m in lines if m["split"] == "train"]
    evals = [m for m in lines if m["split"] == "val"]
    assert train[-1]["n"] == 4000 // 128 * 128  # an epoch is still the whole training set
    assert evals[-1]["n"] == 1000 and math.isfinite(train[-1]["loss"])

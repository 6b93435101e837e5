"""distribuuuu.data: sources, transforms, samplers, loaders, the preflight check and the export."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from distribuuuu import data
from distribuuuu.data.loading import samplers
from distribuuuu.data.loading.samplers import ResumableDistributedSampler
from distribuuuu.data.sources import builtin
from distribuuuu.errors import UserError
from tests.conftest import (
    make_cfg,
    write_fake_cifar10,
    write_fake_cifar100,
    write_image,
    write_image_tree,
)

torch.set_num_threads(1)
CPU = torch.device("cpu")

MNIST = {"TRAIN.DATASET": "mnist5k", "TEST.DATASET": "mnist5k", "MODEL.NUM_CLASSES": 10,
         "MODEL.IN_CHANS": 1, "TRAIN.IM_SIZE": 28, "TRAIN.WORKERS": 0, "TRAIN.BATCH_SIZE": 64}
SYN = {"TRAIN.DATASET": "synthetic", "TEST.DATASET": "synthetic", "MODEL.NUM_CLASSES": 4,
       "TRAIN.TOPK": 2, "TRAIN.IM_SIZE": 16, "TRAIN.SYNTHETIC_SAMPLES": 64,
       "TEST.SYNTHETIC_SAMPLES": 32, "TRAIN.WORKERS": 0, "TRAIN.BATCH_SIZE": 8}


def unnormalize(x: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    return (x * std + mean) * 255


# ---------------------------------------------------------------------------------------------
# mnist5k
# ---------------------------------------------------------------------------------------------
def test_mnist5k_split_sizes_stratified_disjoint_and_fixed():
    _, labels = builtin.mnist5k_arrays()
    split = builtin.mnist5k_split_indices()
    train, val = split["train"], split["val"]
    assert (len(train), len(val)) == (4000, 1000)
    assert not set(train.tolist()) & set(val.tolist())
    for c in range(10):
        n_c = int((labels == c).sum())
        assert abs(int((labels[val] == c).sum()) - 0.2 * n_c) <= 1
    builtin.mnist5k_split_indices.cache_clear()  # recompute from scratch: the same split
    again = builtin.mnist5k_split_indices()
    assert np.array_equal(again["train"], train) and np.array_equal(again["val"], val)


def test_mnist5k_split_ignores_rng_seed():
    a = data.build_dataset(make_cfg(MNIST, "RNG_SEED", 1), train=False)
    b = data.build_dataset(make_cfg(MNIST, "RNG_SEED", 2), train=False)
    assert torch.equal(a.targets, b.targets) and torch.equal(a.images, b.images)


def test_mnist5k_items_shapes_values_and_labels():
    cfg = make_cfg(MNIST)
    train, val = data.build_dataset(cfg, train=True), data.build_dataset(cfg, train=False)
    assert (len(train), len(val)) == (4000, 1000)
    assert train.classes == [str(d) for d in range(10)]
    x, y = val[7]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and isinstance(y, int)
    # val has no augmentation: undoing the MNIST normalization gives the stored digit back
    assert torch.allclose(unnormalize(x, 0.1307, 0.3081), val.images[7].float(), atol=1e-3)
    assert set(val.targets.tolist()) == set(range(10))
    xt, yt = train[0]
    assert xt.shape == (1, 28, 28) and 0 <= yt < 10


def test_mnist5k_three_channels_and_resize():
    cfg = make_cfg(MNIST, "MODEL.IN_CHANS", 3, "TRAIN.IM_SIZE", 32)
    x, _ = data.build_dataset(cfg, train=False)[0]
    assert x.shape == (3, 32, 32)
    assert torch.equal(x[0], x[1]) and torch.equal(x[1], x[2])  # gray repeated


def test_mnist5k_unknown_split_lists_valid_ones():
    with pytest.raises(UserError, match=r"TEST\.SPLIT.*'test'.*train, val"):
        data.build_dataset(make_cfg(MNIST, "TEST.SPLIT", "test"), train=False)


# ---------------------------------------------------------------------------------------------
# samplers and loaders
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 5, 7, 10])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_eval_sampler_covers_every_index_once(n, world):
    shards = [list(samplers.ShardedEvalSampler(range(n), world, r)) for r in range(world)]
    assert sorted(i for s in shards for i in s) == list(range(n))
    assert [len(samplers.ShardedEvalSampler(range(n), world, r)) for r in range(world)] == [len(s) for s in shards]


def test_sharded_eval_sampler_rejects_bad_rank():
    with pytest.raises(ValueError):
        samplers.ShardedEvalSampler(range(3), 2, 2)


def test_val_loader_is_exact_over_ranks():
    cfg = make_cfg(SYN, "TEST.SYNTHETIC_SAMPLES", 7, "TEST.BATCH_SIZE", 2)
    seen = []
    for rank in range(3):
        loader = data.build_val_loader(cfg, rank, 3, CPU)
        seen += [x for x, _ in loader]
    full = torch.stack([data.build_dataset(cfg, train=False)[i][0] for i in range(7)])
    got = torch.cat(seen)
    assert got.shape[0] == 7
    # each sample exactly once: every dataset item matches exactly one item that came out
    matches = (got[:, None] == full[None]).flatten(2).all(-1)
    assert torch.equal(matches.sum(0), torch.ones(7, dtype=torch.long))


@pytest.mark.parametrize("size, world", [(64, 1), (64, 3), (10, 4), (7, 2)])
def test_resumable_sampler_shards_disjointly_and_drops_only_the_tail(size, world):
    shards = []
    for rank in range(world):
        s = ResumableDistributedSampler(range(size), world, rank, seed=3)
        s.set_epoch(2)
        shards.append(list(s))
        assert len(shards[-1]) == len(s) == size // world
    flat = [i for shard in shards for i in shard]
    assert len(set(flat)) == len(flat) == size // world * world  # no sample twice


def test_resumable_sampler_continues_with_the_next_samples_for_any_world_size():
    size, seed, epoch = 60, 1, 4
    full = ResumableDistributedSampler(range(size), 1, 0, seed)
    full.set_epoch(epoch)
    order = list(full)
    # 2 ranks consumed 3 batches of 4 each: 24 samples. Resume with 3 ranks.
    consumed = 24
    rest = []
    for rank in range(3):
        s = ResumableDistributedSampler(range(size), 3, rank, seed)
        s.set_epoch(epoch, start=consumed)
        rest.append(list(s))
    assert sorted(i for shard in rest for i in shard) == sorted(order[consumed:])
    # and with the same world size the shards are exactly the unseen part of each rank's shard
    for rank in range(2):
        a = ResumableDistributedSampler(range(size), 2, rank, seed)
        a.set_epoch(epoch)
        b = ResumableDistributedSampler(range(size), 2, rank, seed)
        b.set_epoch(epoch, start=consumed)
        assert list(b) == list(a)[consumed // 2:]


def test_train_loader_order_follows_epoch_and_seed():
    cfg = make_cfg(SYN, "RNG_SEED", 5)
    a, b = data.build_train_loader(cfg, 0, 1, CPU), data.build_train_loader(cfg, 0, 1, CPU)
    assert isinstance(a.sampler, ResumableDistributedSampler)
    a.sampler.set_epoch(0)
    b.sampler.set_epoch(0)
    order0 = list(a.sampler)
    assert order0 == list(b.sampler)  # same seed, same epoch: same order
    assert sorted(order0) == list(range(64))
    a.sampler.set_epoch(1)
    assert list(a.sampler) != order0
    # the loader's batches follow the sampler
    x, y = next(iter(a))
    ds = a.dataset
    assert torch.equal(x, torch.stack([ds[i][0] for i in list(a.sampler)[:8]]))
    assert y.tolist() == [ds[i][1] for i in list(a.sampler)[:8]]
    other_seed = data.build_train_loader(make_cfg(SYN, "RNG_SEED", 6), 0, 1, CPU)
    other_seed.sampler.set_epoch(0)
    assert list(other_seed.sampler) != order0


def test_train_loader_ranks_are_disjoint_and_drop_last_rule():
    cfg = make_cfg(SYN, "RNG_SEED", 0)  # 64 samples, batch 8
    shards = [list(data.build_train_loader(cfg, r, 2, CPU).sampler) for r in range(2)]
    assert sorted(shards[0] + shards[1]) == list(range(64))
    assert data.build_train_loader(cfg, 0, 2, CPU).drop_last is True
    small = make_cfg(SYN, "TRAIN.BATCH_SIZE", 40)  # 32 per rank < 40: keep the partial batch
    loader = data.build_train_loader(small, 0, 2, CPU)
    assert loader.drop_last is False and len(loader) == 1


def test_train_loader_with_workers_is_reproducible():
    cfg = make_cfg(MNIST, "RNG_SEED", 3, "TRAIN.WORKERS", 1, "TRAIN.DATA_PIPELINE", "loader")
    first = []
    for _ in range(2):
        loader = data.build_train_loader(cfg, 0, 1, CPU)
        loader.sampler.set_epoch(0)
        assert loader.persistent_workers
        first.append(next(iter(loader))[0])
    assert torch.equal(first[0], first[1])  # same seed: same random crops in the worker


# ---------------------------------------------------------------------------------------------
# synthetic and dummy input
# ---------------------------------------------------------------------------------------------
def test_synthetic_deterministic_balanced_and_shaped():
    cfg = make_cfg(SYN, "MODEL.IN_CHANS", 2, "TRAIN.IM_SIZE", 12, "TRAIN.SYNTHETIC_SAMPLES", 40)
    ds = data.build_dataset(cfg, train=True)
    assert len(ds) == 40 and ds.classes == ["0", "1", "2", "3"]
    x, y = ds[13]
    assert x.shape == (2, 12, 12) and x.dtype == torch.float32
    assert torch.equal(x, ds[13][0]) and torch.equal(x, data.build_dataset(cfg, train=True)[13][0])
    assert not torch.equal(x, ds[17][0])  # same class, different noise
    assert np.bincount([ds[i][1] for i in range(40)]).tolist() == [10, 10, 10, 10]
    assert not torch.equal(x, data.build_dataset(cfg, train=False)[13][0])  # val noise differs


def test_synthetic_train_and_val_share_prototypes():
    cfg = make_cfg(SYN, "MODEL.NUM_CLASSES", 10, "TRAIN.TOPK", 5, "TRAIN.SYNTHETIC_SAMPLES", 200,
                   "TEST.SYNTHETIC_SAMPLES", 100)
    train, val = data.build_dataset(cfg, train=True), data.build_dataset(cfg, train=False)
    xs, ys = map(torch.stack, zip(*[(x, torch.tensor(y)) for x, y in train]))
    centroids = torch.stack([xs[ys == c].mean(0) for c in range(10)]).flatten(1)
    xv, yv = map(torch.stack, zip(*[(x, torch.tensor(y)) for x, y in val]))
    pred = torch.cdist(xv.flatten(1), centroids).argmin(1)
    assert (pred == yv).float().mean() > 0.9


def test_synthetic_is_learnable_by_a_tiny_cnn():
    torch.manual_seed(0)
    cfg = make_cfg(SYN, "TRAIN.SYNTHETIC_SAMPLES", 128, "TEST.SYNTHETIC_SAMPLES", 64, "TRAIN.BATCH_SIZE", 16,
                   "RNG_SEED", 0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = data.build_train_loader(cfg, 0, 1, CPU)
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    x, y = next(iter(data.build_val_loader(cfg, 0, 1, CPU)))
    assert (model(x).argmax(1) == y).float().mean() > 0.6  # chance is 0.25


def test_dummy_input_needs_no_data_on_disk(tmp_path):
    cfg = make_cfg({"MODEL.DUMMY_INPUT": True, "TRAIN.DATASET": str(tmp_path / "nothing"),
                    "TEST.DATASET": str(tmp_path / "nothing"), "MODEL.NUM_CLASSES": 7, "TRAIN.TOPK": 1,
                    "TRAIN.IM_SIZE": 20, "TRAIN.SYNTHETIC_SAMPLES": 10, "TEST.SYNTHETIC_SAMPLES": 6,
                    "TRAIN.BATCH_SIZE": 4, "TEST.BATCH_SIZE": 4, "TRAIN.WORKERS": 0})
    data.check_datasets(cfg, world_size=2)
    train, val = data.build_train_loader(cfg, 0, 2, CPU), data.build_val_loader(cfg, 1, 2, CPU)
    assert (len(train.dataset), len(val.dataset)) == (10, 6)
    x, y = next(iter(train))
    assert x.shape == (4, 3, 20, 20) and y.dtype == torch.long and 0 <= y.min() and y.max() < 7
    assert sum(len(b[1]) for b in val) == 3


# ---------------------------------------------------------------------------------------------
# ImageFolder trees
# ---------------------------------------------------------------------------------------------
def folder_cfg(root, *opts):
    """The image folder root at 8 px, batches of 2 (train) and 4: this section's own defaults."""
    return make_cfg({"TRAIN.DATASET": root, "TEST.DATASET": root, "MODEL.NUM_CLASSES": 0, "TRAIN.TOPK": 1,
                     "TRAIN.IM_SIZE": 8, "TEST.IM_SIZE": 10, "TRAIN.WORKERS": 0, "TRAIN.BATCH_SIZE": 2,
                     "TEST.BATCH_SIZE": 4}, *opts)


def test_image_folder_loaders_give_train_im_size(tmp_path):
    write_image_tree(tmp_path, "train", {"cat": 3, "dog": 2, "eel": 2}, ext="png")
    write_image_tree(tmp_path, "val", {"cat": 1, "dog": 1, "eel": 2}, ext="jpg", size=(16, 12))
    cfg = folder_cfg(tmp_path)
    data.check_datasets(cfg, world_size=2)
    train = data.build_train_loader(cfg, 0, 1, CPU)
    assert train.dataset.classes == ["cat", "dog", "eel"]
    x, y = next(iter(train))
    assert x.shape == (2, 3, 8, 8) and x.dtype == torch.float32 and y.max() < 3
    xv, yv = next(iter(data.build_val_loader(cfg, 0, 1, CPU)))
    assert xv.shape == (4, 3, 8, 8) and yv.tolist() == [0, 1, 2, 2]


@pytest.mark.parametrize("chans", [1, 3])
def test_image_folder_converts_gray_and_rgba_to_in_chans(tmp_path, chans):
    write_image(tmp_path / "train" / "a" / "gray.png", (9, 9), "L", seed=1)
    write_image(tmp_path / "train" / "b" / "rgba.png", (9, 9), "RGBA", seed=2)
    write_image(tmp_path / "train" / "b" / "rgb.jpg", (9, 9), "RGB", seed=3)
    ds = data.build_dataset(folder_cfg(tmp_path, "MODEL.IN_CHANS", chans), train=True)
    assert [ds[i][0].shape for i in range(3)] == [(chans, 8, 8)] * 3


def test_val_folder_missing_a_class_keeps_train_labels(tmp_path):
    write_image_tree(tmp_path, "train", {"a": 1, "b": 1, "c": 1})
    write_image_tree(tmp_path, "val", {"a": 1, "c": 1})
    os.makedirs(tmp_path / "val" / ".ipynb_checkpoints")  # hidden: never a class
    ds = data.build_dataset(folder_cfg(tmp_path), train=False)
    assert ds.classes == ["a", "b", "c"] and list(ds.targets) == [0, 2]


def test_val_folder_with_unknown_class_is_a_user_error(tmp_path):
    write_image_tree(tmp_path, "train", {"a": 1, "b": 1})
    write_image_tree(tmp_path, "val", {"a": 1, "z": 1})
    with pytest.raises(UserError, match="z"):
        data.check_datasets(folder_cfg(tmp_path), world_size=1)


# ---------------------------------------------------------------------------------------------
# CIFAR pickles
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nested", [True, False])
def test_fake_cifar10_loads(tmp_path, nested):
    folder = tmp_path / "cifar-10-batches-py" if nested else tmp_path
    test_images = write_fake_cifar10(folder)
    cfg = folder_cfg(tmp_path, "MODEL.NUM_CLASSES", 10, "TRAIN.IM_SIZE", 32)
    data.check_datasets(cfg, world_size=2)
    train, val = data.build_dataset(cfg, train=True), data.build_dataset(cfg, train=False)
    assert (len(train), len(val)) == (10, 3)
    assert train.classes[0] == "airplane" and len(train.classes) == 10
    assert train.targets.tolist()[:2] == [1, 2] and val.targets.tolist() == [0, 1, 2]
    x, y = val[2]
    assert x.shape == (3, 32, 32) and y == 2
    mean, std = torch.tensor([0.4914, 0.4822, 0.4465]), torch.tensor([0.2470, 0.2435, 0.2616])
    back = (x * std[:, None, None] + mean[:, None, None]) * 255
    assert torch.allclose(back, torch.from_numpy(test_images[2]).float(), atol=1e-3)  # R, G, B planes
    assert train[0][0].shape == (3, 32, 32)
    gray = data.build_dataset(folder_cfg(tmp_path, "MODEL.NUM_CLASSES", 10, "MODEL.IN_CHANS", 1, "TRAIN.IM_SIZE", 16),
                              train=False)
    assert gray[0][0].shape == (1, 16, 16)


def test_fake_cifar100_loads_and_needs_100_classes(tmp_path):
    write_fake_cifar100(tmp_path / "cifar-100-python")
    cfg = folder_cfg(tmp_path, "MODEL.NUM_CLASSES", 100, "TRAIN.IM_SIZE", 32, "TEST.SPLIT", "test")
    ds = data.build_dataset(cfg, train=True)
    assert len(ds) == 4 and ds.targets.tolist() == [99, 98, 97, 96] and ds.classes[99] == "c99"
    assert len(data.build_dataset(cfg, train=False)) == 2
    with pytest.raises(UserError, match="set MODEL.NUM_CLASSES 100"):
        data.check_datasets(folder_cfg(tmp_path, "MODEL.NUM_CLASSES", 10, "TRAIN.IM_SIZE", 32), 1)


def test_cifar_missing_batch_and_bad_split(tmp_path):
    write_fake_cifar10(tmp_path)
    with pytest.raises(UserError, match="train, val, test"):
        data.check_datasets(folder_cfg(tmp_path, "MODEL.NUM_CLASSES", 10, "TEST.SPLIT", "dev"), 1)
    os.remove(tmp_path / "data_batch_3")
    with pytest.raises(UserError, match="data_batch_3"):
        data.check_datasets(folder_cfg(tmp_path, "MODEL.NUM_CLASSES", 10), 1)


# ---------------------------------------------------------------------------------------------
# check_datasets
# ---------------------------------------------------------------------------------------------
def test_check_missing_folder_names_key_path_layout_and_builtins(tmp_path):
    cfg = folder_cfg(tmp_path / "nope")
    with pytest.raises(UserError) as err:
        data.check_datasets(cfg, 1)
    msg = str(err.value)
    for part in ("TRAIN.DATASET", str(tmp_path / "nope"), "<DATASET>/<SPLIT>/<class>/<image>",
                 "mnist5k", "synthetic"):
        assert part in msg
    write_image_tree(tmp_path, "train", {"a": 1})
    with pytest.raises(UserError, match=r"TEST\.DATASET.*" + str(tmp_path / "val")):
        data.check_datasets(folder_cfg(tmp_path), 1)


def test_check_empty_class_folders_are_named(tmp_path):
    write_image_tree(tmp_path, "train", {"a": 1})
    write_image_tree(tmp_path, "val", {"a": 1})
    os.makedirs(tmp_path / "train" / "empty_one")
    (tmp_path / "train" / "empty_one" / "notes.txt").write_text("not an image")
    with pytest.raises(UserError, match="empty_one"):
        data.check_datasets(folder_cfg(tmp_path), 1)


def test_check_split_without_class_folders(tmp_path):
    os.makedirs(tmp_path / "train")
    Image.new("RGB", (8, 8)).save(tmp_path / "train" / "loose.png")  # images must be in class folders
    with pytest.raises(UserError, match="no class folders"):
        data.check_datasets(folder_cfg(tmp_path), 1)


def test_check_too_many_classes(tmp_path):
    write_image_tree(tmp_path, "train", {"a": 1, "b": 1, "c": 1})
    write_image_tree(tmp_path, "val", {"a": 1})
    with pytest.raises(UserError, match="set MODEL.NUM_CLASSES 3"):
        data.check_datasets(folder_cfg(tmp_path, "MODEL.NUM_CLASSES", 2), 1)


def test_check_world_size_larger_than_train_set(tmp_path):
    write_image_tree(tmp_path, "train", {"a": 2, "b": 2})
    write_image_tree(tmp_path, "val", {"a": 1})
    cfg = folder_cfg(tmp_path, "TRAIN.BATCH_SIZE", 1)  # (batch 2 x 4 ranks would make no step: refused)
    data.check_datasets(cfg, 4)  # 4 samples for 4 ranks: fine (counted beyond 1 per class)
    with pytest.raises(UserError, match="world size 5 is larger than the 4 training samples"):
        data.check_datasets(cfg, 5)
    with pytest.raises(UserError, match="world size 65 is larger than the 64 training samples"):
        data.check_datasets(make_cfg(SYN), 65)


def test_check_valid_builtins_pass_and_bad_channels_fail():
    data.check_datasets(make_cfg(MNIST), 8)
    data.check_datasets(make_cfg(SYN), 8)
    data.check_datasets(make_cfg(SYN, "MODEL.IN_CHANS", 5), 1)  # synthetic makes any channel count
    with pytest.raises(UserError, match="MODEL.IN_CHANS 1 or 3"):
        data.check_datasets(make_cfg(MNIST, "MODEL.IN_CHANS", 2), 1)
    with pytest.raises(UserError, match="set MODEL.NUM_CLASSES 10"):
        data.check_datasets(make_cfg(MNIST, "MODEL.NUM_CLASSES", 5, "TRAIN.TOPK", 5), 1)


def test_check_val_crop_larger_than_resize(tmp_path):
    write_image_tree(tmp_path, "train", {"a": 1})
    write_image_tree(tmp_path, "val", {"a": 1})
    with pytest.raises(UserError, match=r"TEST.IM_SIZE \(6\) must be >= TRAIN.IM_SIZE \(8\)"):
        data.check_datasets(folder_cfg(tmp_path, "TEST.IM_SIZE", 6), 1)


def test_check_test_only_for_eval(tmp_path):
    write_image_tree(tmp_path, "val", {"a": 1})
    cfg = folder_cfg(tmp_path)
    with pytest.raises(UserError, match="TRAIN.DATASET"):
        data.check_datasets(cfg, 1)
    data.check_datasets(cfg, 1, train=False)


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------
def test_export_mnist5k_round_trips_through_image_folder(tmp_path):
    counts = data.export("mnist5k", str(tmp_path))
    assert counts == {"train": 4000, "val": 1000}
    for split, n in counts.items():
        classes = sorted(os.listdir(tmp_path / split))
        assert classes == [str(d) for d in range(10)]
        assert sum(len(os.listdir(tmp_path / split / c)) for c in classes) == n
    memory = data.build_dataset(make_cfg(MNIST), train=False)
    cfg = make_cfg(MNIST, "TEST.DATASET", str(tmp_path), "TEST.IM_SIZE", 28)
    data.check_datasets(cfg, 2)
    folder = data.build_dataset(cfg, train=False)
    assert len(folder) == 1000 and folder.classes == memory.classes
    # Within a class, files are named by position, so the k-th file of class c is the k-th digit c.
    for c in (0, 3, 9):
        mem_idx = torch.nonzero(memory.targets == c).flatten()[[0, 5]]
        fold_idx = [i for i, (_, y) in enumerate(zip(folder.files.paths, folder.targets)) if y == c][:6:5]
        for m, f in zip(mem_idx.tolist(), fold_idx):
            x, y = folder[f]
            assert y == c and x.shape == (1, 28, 28)
            back = unnormalize(x, 0.449, 0.226)  # folders use the ImageNet gray statistics
            assert torch.allclose(back, memory.images[m].float(), atol=1e-3)
    with pytest.raises(UserError, match="not empty"):
        data.export("mnist5k", str(tmp_path))


@pytest.mark.parametrize("decode", ["fast", "pil"])
def test_a_resumed_folder_epoch_with_loader_workers_augments_as_the_straight_one(tmp_path, decode):
    """Loader workers seed each item by (seed, epoch, index): the batches after a mid-epoch restart
    (a new loader, as a resumed run builds) are the straight run's, bit for bit."""
    write_image_tree(str(tmp_path), "train", {"a": 20, "b": 20}, ext="jpg", size=(24, 24))
    opts = {"TRAIN.DATASET": str(tmp_path), "TEST.DATASET": str(tmp_path), "TEST.SPLIT": "train",
            "MODEL.NUM_CLASSES": 2, "TRAIN.TOPK": 1, "TRAIN.IM_SIZE": 16, "TRAIN.BATCH_SIZE": 4,
            "TRAIN.WORKERS": 2, "RNG_SEED": 1, "TRAIN.IMAGE_DECODE": decode}
    straight = data.build_train_loader(make_cfg(opts), 0, 1, CPU)
    straight.sampler.set_epoch(1)
    whole = [x for x, _ in straight]
    resumed = data.build_train_loader(make_cfg(opts), 0, 1, CPU)
    resumed.sampler.set_epoch(1, start=3 * 4)
    rest = [x for x, _ in resumed]
    assert len(rest) == len(whole) - 3 and all(torch.equal(a, b) for a, b in zip(rest, whole[3:]))
    # Repeated augmentation needs the copies of an index to differ: no per-item seeds there.
    repeated = data.build_train_loader(make_cfg({**opts, "TRAIN.REPEATED_AUG": 2}), 0, 1, CPU)
    assert repeated.sampler.on_epoch is None

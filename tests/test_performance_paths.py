"""The fast input paths are correct (their speed is measured by benchmarks/overhead.py; docs/performance.md).

- the in-memory loader gives each rank exactly the samples of the resumable sampler's semantics
  (one permutation of seed + epoch, `start` skipped, rank::world, the tail dropped);
- its batched augmentation keeps shapes, dtypes and normalization, and every crop is a real
  pad-and-crop window (mirrored or not) of its image;
- the fast JPEG path gives the reference pipeline's crops and pixels, decodes at reduced size
  only when the crop allows it, and still reports broken files to the bad-image handling;
- config/mnist5k_fast.yaml validates and selects the in-memory path.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms as T
from PIL import Image

from distribuuuu import data
from distribuuuu.data import transforms
from distribuuuu.data.decoding import cpu
from distribuuuu.data.loading import batches
from distribuuuu.data.loading.memory import MemoryLoader, pad_crop_flip
from distribuuuu.data.loading.samplers import ResumableDistributedSampler, ShardedEvalSampler
from distribuuuu.errors import UserError
from tests.conftest import make_cfg, pipeline_name, write_fake_cifar10

torch.set_num_threads(1)
CPU = torch.device("cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MNIST = {"TRAIN.DATASET": "mnist5k", "TEST.DATASET": "mnist5k", "MODEL.NUM_CLASSES": 10,
         "MODEL.IN_CHANS": 1, "TRAIN.IM_SIZE": 28, "TEST.IM_SIZE": 28, "TRAIN.WORKERS": 0,
         "TRAIN.BATCH_SIZE": 64, "RNG_SEED": 4}


# ---------------------------------------------------------------------------------------------
# the in-memory loader follows the sampler's semantics
# ---------------------------------------------------------------------------------------------
def _index_loader(n: int, world: int, rank: int, batch: int, seed: int = 7) -> MemoryLoader:
    """A MemoryLoader whose targets are the sample indices, so its batches show what it took."""
    images = torch.zeros(n, 1, 4, 4, dtype=torch.uint8)
    sampler = ResumableDistributedSampler(range(n), world, rank, seed=seed)
    return MemoryLoader(range(n), images, torch.arange(n), sampler, batch, drop_last=len(sampler) >= batch)


def _taken(loader: MemoryLoader) -> list[int]:
    return [i for _, y in loader for i in y.tolist()]


@pytest.mark.parametrize("n, world, batch", [(100, 1, 10), (100, 3, 8), (37, 4, 3), (64, 2, 32)])
def test_memory_loader_takes_the_permutation_rank_by_rank(n, world, batch):
    epoch, seed = 3, 7
    expected = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    usable = n // world * world
    shards = []
    for rank in range(world):
        loader = _index_loader(n, world, rank, batch, seed)
        loader.sampler.set_epoch(epoch)
        got = _taken(loader)
        assert len(loader) == len(got) // batch == (n // world) // batch  # whole batches only
        assert got == expected[rank:usable:world][:len(got)]  # rank::world of one seeded permutation
        shards.append(got)
    flat = [i for s in shards for i in s]
    assert len(set(flat)) == len(flat)  # no sample twice in an epoch
    if (n // world) % batch == 0:  # nothing lost to partial batches: the union is the permutation minus the tail
        assert sorted(flat) == sorted(expected[:usable])
    other = _index_loader(n, world, 0, batch, seed)
    other.sampler.set_epoch(epoch + 1)
    assert _taken(other) != shards[0]  # a new epoch, a new order


@pytest.mark.parametrize("world", [1, 2, 3])
def test_memory_loader_resumes_mid_epoch_with_the_next_samples(world):
    n, batch, epoch = 120, 5, 2
    for rank in range(world):
        full = _index_loader(n, world, rank, batch)
        full.sampler.set_epoch(epoch)
        straight = _taken(full)
        consumed = 4 * batch * world  # 4 steps done by all ranks together
        resumed = _index_loader(n, world, rank, batch)
        resumed.sampler.set_epoch(epoch, start=consumed)
        assert _taken(resumed) == straight[4 * batch:]


def test_mnist5k_train_loader_is_in_memory_and_matches_its_sampler():
    for rank in range(2):
        loader = data.build_train_loader(make_cfg(MNIST), rank, 2, CPU)
        assert isinstance(loader, MemoryLoader) and len(loader.dataset) == 4000
        assert isinstance(loader.sampler, ResumableDistributedSampler)
        loader.sampler.set_epoch(1, start=128)
        order = list(loader.sampler)
        targets = torch.cat([y for _, y in loader])
        assert len(loader) == (4000 - 128) // 2 // 64 == len(targets) // 64
        assert torch.equal(targets, loader.dataset.targets[order[:len(targets)]])


def test_memory_val_loader_is_exact_and_equals_the_per_sample_items():
    cfg = make_cfg({**MNIST, "MODEL.IN_CHANS": 3, "TRAIN.IM_SIZE": 32, "TEST.IM_SIZE": 32, "TEST.BATCH_SIZE": 96})
    per_sample = data.build_dataset(cfg, train=False)  # the DataLoader path's items: resize, gray->RGB, normalize
    seen = 0
    for rank in range(3):
        loader = data.build_val_loader(cfg, rank, 3, CPU)
        assert isinstance(loader, MemoryLoader) and isinstance(loader.sampler, ShardedEvalSampler)
        xs, ys = zip(*loader)
        x, y = torch.cat(xs), torch.cat(ys)
        idx = list(range(rank, 1000, 3))
        assert x.shape == (len(idx), 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
        expected = torch.stack([per_sample[i][0] for i in idx])
        torch.testing.assert_close(x, expected, rtol=0, atol=1e-5)
        assert y.tolist() == [per_sample[i][1] for i in idx]
        seen += len(idx)
    assert seen == 1000


def test_synthetic_in_memory_equals_the_dataloader_path():
    cfg = {"TRAIN.DATASET": "synthetic", "TEST.DATASET": "synthetic", "MODEL.NUM_CLASSES": 4, "TRAIN.TOPK": 2,
           "TRAIN.IM_SIZE": 12, "TRAIN.SYNTHETIC_SAMPLES": 40, "TRAIN.BATCH_SIZE": 8, "TRAIN.WORKERS": 0}
    mem = data.build_train_loader(make_cfg({**cfg, "TRAIN.DATA_PIPELINE": "memory"}), 1, 2, CPU)
    dl = data.build_train_loader(make_cfg({**cfg, "TRAIN.DATA_PIPELINE": "loader"}), 1, 2, CPU)
    assert isinstance(mem, MemoryLoader) and not isinstance(dl, MemoryLoader)
    for loader in (mem, dl):
        loader.sampler.set_epoch(5, start=6)
    for (a, ya), (b, yb) in zip(mem, dl, strict=True):
        assert torch.equal(a, b) and torch.equal(ya, yb)


# ---------------------------------------------------------------------------------------------
# batched augmentation
# ---------------------------------------------------------------------------------------------
def test_pad_crop_flip_gives_real_crops_of_every_offset_and_both_orientations():
    torch.manual_seed(0)
    n, size, pad = 6, 8, 2
    images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8)
    padded = F.pad(images, (pad,) * 4)
    index = torch.arange(n).repeat(40)
    out = pad_crop_flip(padded, index, size, pad, flip=True)
    assert out.shape == (len(index), 3, size, size) and out.dtype == torch.uint8
    offsets, flips = set(), set()
    for k, i in enumerate(index.tolist()):
        matches = [(oy, ox, m) for oy in range(2 * pad + 1) for ox in range(2 * pad + 1) for m in (False, True)
                   if torch.equal(out[k], (lambda c: c.flip(-1) if m else c)(padded[i, :, oy:oy + size, ox:ox + size]))]
        assert matches, f"output {k} is not a crop of image {i}"
        offsets.add(matches[0][:2])
        flips.add(matches[0][2])
    assert len(offsets) >= 20 and flips == {False, True}  # 25 offsets, uniform: nearly all seen in 240 draws
    assert torch.equal(pad_crop_flip(F.pad(images, (0,) * 4), torch.arange(n), size, 0, flip=False), images)


def test_cifar_memory_batches_are_normalized_augmented_images(tmp_path):
    write_fake_cifar10(tmp_path, per_batch=40, test_size=10)
    cfg = make_cfg({"TRAIN.DATASET": str(tmp_path), "TEST.DATASET": str(tmp_path), "MODEL.NUM_CLASSES": 10,
                    "TRAIN.IM_SIZE": 32, "TEST.IM_SIZE": 32, "TRAIN.BATCH_SIZE": 50, "TRAIN.WORKERS": 0})
    loader = data.build_train_loader(cfg, 0, 1, CPU)
    assert isinstance(loader, MemoryLoader) and loader.flip and loader.pad == 4  # auto: CIFAR in memory
    loader.sampler.set_epoch(0)
    x, y = next(iter(loader))
    assert x.shape == (50, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    mean = torch.tensor(transforms.CIFAR10_STATS[0]).view(1, 3, 1, 1)
    std = torch.tensor(transforms.CIFAR10_STATS[1]).view(1, 3, 1, 1)
    pixels = (x * std + mean) * 255
    assert torch.allclose(pixels, pixels.round(), atol=1e-3)  # uint8 values, normalized once
    assert pixels.min() >= -1e-3 and pixels.max() <= 255 + 1e-3
    # each output is a pad-crop (maybe mirrored) of the image the sampler named: compare the
    # sums over the 24x24 centre, which any shift of at most 4 px keeps inside the original
    order = list(loader.sampler)[:50]
    originals = loader.dataset.images[order].float()
    assert torch.equal(y, loader.dataset.targets[order])
    diff = (pixels.sum((1, 2, 3)) - originals.sum((1, 2, 3))).abs() / originals.sum((1, 2, 3))
    assert (diff < 0.5).all()


def test_batch_normalize_matches_to_dtype_and_normalize():
    x = torch.randint(0, 256, (4, 3, 5, 5), dtype=torch.uint8)
    stats = transforms.IMAGENET_STATS
    expected = T.Normalize(*stats)(x.float() / 255)
    torch.testing.assert_close(batches.BatchNormalize(stats)(x), expected, rtol=0, atol=1e-5)
    cl = x.contiguous(memory_format=torch.channels_last)
    assert batches.BatchNormalize(stats)(cl).is_contiguous()


# ---------------------------------------------------------------------------------------------
# the JPEG path
# ---------------------------------------------------------------------------------------------
def _photo(path, size=(500, 375), seed=0, quality=90, mode="RGB"):
    rng = np.random.default_rng(seed)
    w, h = size
    low = Image.fromarray((rng.random((h // 25 + 1, w // 25 + 1, 3)) * 255).astype(np.uint8)).resize((w, h), Image.BICUBIC)
    a = np.asarray(low).astype(np.float32) + rng.normal(0, 10, (h, w, 3))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).convert(mode).save(path, quality=quality)
    return path


def test_fast_train_decode_draws_the_reference_crops_and_pixels(tmp_path):
    size = 64
    reference = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.PILToTensor()])
    fast = cpu.FastTrainDecode(size, "RGB")
    for seed in range(6):
        path = _photo(str(tmp_path / f"{seed}.jpg"), size=(150, 110), seed=seed)  # crops < 2x64: no draft
        torch.manual_seed(seed)
        ref = reference(Image.open(path).convert("RGB"))
        torch.manual_seed(seed)
        out = fast(open(path, "rb").read())
        assert out.shape == (3, size, size) and out.dtype == torch.uint8
        # same RNG calls in the same order: the same crop and flip; pixels within rounding
        assert (out.float() - ref.float()).abs().mean() < 0.5
        assert (out.int() - ref.int()).abs().max() <= 3


def test_draft_factor_and_reduced_decoding(tmp_path):
    assert cpu.draft_factor(447, 500, 224, 224) == 1  # needs >= 448 both ways for 1/2
    assert cpu.draft_factor(448, 448, 224, 224) == 2
    assert cpu.draft_factor(1000, 890, 224, 224) == 2  # 890 / 4 < 224
    assert cpu.draft_factor(1000, 900, 224, 224) == 4
    assert cpu.draft_factor(2000, 2000, 100, 100) == 8  # at most 1/8 (libjpeg's DCT scales)
    jpeg, png = b"\xff\xd8\xff\xe0", b"\x89PNG"
    assert cpu.decode_scale(jpeg, 500, 375, 300, 300, 128) == 1  # 1/2 of a small image: not worth it
    assert cpu.decode_scale(jpeg, 1000, 750, 300, 300, 128) == 2
    assert cpu.decode_scale(jpeg, 500, 375, 300, 300, 64) == 4  # 1/4 always pays
    assert cpu.decode_scale(png, 1000, 750, 300, 300, 64) == 1  # only JPEGs have DCT scaling
    path = _photo(str(tmp_path / "big.jpg"), size=(801, 603))
    blob = open(path, "rb").read()
    assert cpu.decode(blob, "RGB").shape == (3, 603, 801)
    assert cpu.decode(blob, "RGB", reduce=2).shape == (3, 302, 401)  # ceil(603/2) x ceil(801/2)
    assert cpu.decode(blob, "RGB", reduce=4).shape == (3, 151, 201)
    assert cpu.decode(blob, "L", reduce=8).shape == (1, 76, 101)
    full = cpu.decode(blob, "RGB").float()
    quarter = cpu.decode(blob, "RGB", reduce=4).float()
    assert abs(full.mean() - quarter.mean()) < 1.0  # the same picture, smaller


def test_fast_decode_uses_the_reduced_size_only_when_the_crop_allows_it(tmp_path, monkeypatch):
    path = _photo(str(tmp_path / "big.jpg"), size=(900, 700))
    calls = []
    real = cpu.decode

    def spy(data, mode, reduce=1):
        image = real(data, mode, reduce)
        calls.append((reduce, tuple(image.shape)))
        return image

    monkeypatch.setattr(cpu, "decode", spy)
    small, large = cpu.FastTrainDecode(64, "RGB"), cpu.FastTrainDecode(400, "RGB")
    for seed in range(20):
        torch.manual_seed(seed)
        assert small(open(path, "rb").read()).shape == (3, 64, 64)
        torch.manual_seed(seed)
        assert large(open(path, "rb").read()).shape == (3, 400, 400)
    small_calls, large_calls = calls[0::2], calls[1::2]
    assert all(r == 1 and s == (3, 700, 900) for r, s in large_calls)  # a 400 px crop never allows it
    reduced = [(r, s) for r, s in small_calls if r > 1]
    assert len(reduced) >= 10  # most 64 px crops of a 900x700 image are >= 128 px
    for r, s in reduced:
        assert s == (3, -(-700 // r), -(-900 // r))  # decoded at 1/r scale
    # val: a shorter side >= 2x TEST.IM_SIZE is decoded reduced, and the output keeps its size
    calls.clear()
    assert cpu.FastEvalDecode(256, 224, "RGB")(open(path, "rb").read()).shape == (3, 224, 224)
    assert calls == [(2, (3, 350, 450))]  # 700 / 2 >= 256 > 700 / 4


def test_jpeg_size_reads_the_header_of_every_kind(tmp_path):
    for kw in ({}, {"progressive": True}, {"exif": Image.Exif()}):
        for mode in ("RGB", "L", "CMYK"):
            buf = io.BytesIO()
            Image.new(mode, (37, 23)).save(buf, "JPEG", **kw)
            assert cpu.jpeg_size(buf.getvalue()) == (37, 23)
            assert cpu.image_size(buf.getvalue()) == (37, 23)
    buf = io.BytesIO()
    Image.new("RGB", (9, 7)).save(buf, "PNG")
    assert cpu.jpeg_size(buf.getvalue()) is None and cpu.image_size(buf.getvalue()) == (9, 7)


def test_broken_and_unusual_files_in_the_fast_path(tmp_path):
    good = _photo(str(tmp_path / "good.jpg"), size=(64, 48))
    blob = open(good, "rb").read()
    (tmp_path / "truncated.jpg").write_bytes(blob[: len(blob) // 2])
    decode = cpu.FastTrainDecode(32, "RGB")
    with pytest.raises(OSError):  # the error the dataset's TRAIN.BAD_IMAGES handling catches
        decode((tmp_path / "truncated.jpg").read_bytes())
    _photo(str(tmp_path / "cmyk.jpg"), size=(64, 48), mode="CMYK")
    _photo(str(tmp_path / "gray.jpg"), size=(64, 48), mode="L")
    Image.open(good).save(tmp_path / "png_named.jpg", "PNG")
    for name in ("cmyk.jpg", "gray.jpg", "png_named.jpg"):
        assert decode((tmp_path / name).read_bytes()).shape == (3, 32, 32)
        assert cpu.FastTrainDecode(32, "L")((tmp_path / name).read_bytes()).shape == (1, 32, 32)


def test_fast_folder_loader_matches_the_pil_loader_statistics(tmp_path):
    for i in range(8):
        _photo(str(tmp_path / "train" / f"c{i % 2}" / f"{i}.jpg"), size=(120, 90), seed=i)
        _photo(str(tmp_path / "val" / f"c{i % 2}" / f"{i}.jpg"), size=(120, 90), seed=10 + i)
    base = {"TRAIN.DATASET": str(tmp_path), "TEST.DATASET": str(tmp_path), "MODEL.NUM_CLASSES": 2,
            "TRAIN.TOPK": 1, "TRAIN.IM_SIZE": 48, "TEST.IM_SIZE": 56, "TRAIN.BATCH_SIZE": 8, "TEST.BATCH_SIZE": 8,
            "TRAIN.WORKERS": 0, "RNG_SEED": 0}
    fast_cfg, pil_cfg = make_cfg({**base, "TRAIN.IMAGE_DECODE": "fast"}), make_cfg({**base, "TRAIN.IMAGE_DECODE": "pil"})
    fast = data.build_train_loader(fast_cfg, 0, 1, CPU)
    assert fast.dataset.classes == ["c0", "c1"] and fast.drop_last and len(fast) == 1
    fast.sampler.set_epoch(0)
    torch.manual_seed(0)
    x, y = next(iter(fast))
    assert x.shape == (8, 3, 48, 48) and x.dtype == torch.float32 and y.dtype == torch.int64
    # val has no randomness: fast and pil give the same pictures, up to resampling rounding
    xf = next(iter(data.build_val_loader(fast_cfg, 0, 1, CPU)))[0]
    xp = next(iter(data.build_val_loader(pil_cfg, 0, 1, CPU)))[0]
    assert xf.shape == xp.shape == (8, 3, 48, 48)
    assert (xf - xp).abs().mean() < 0.02  # normalized units: about 1 gray level
    pil = data.build_train_loader(pil_cfg, 0, 1, CPU)
    pil.sampler.set_epoch(0)
    torch.manual_seed(0)
    xt = next(iter(pil))[0]
    assert torch.allclose(x.mean((0, 2, 3)), xt.mean((0, 2, 3)), atol=0.15)
    assert torch.allclose(x.std((0, 2, 3)), xt.std((0, 2, 3)), rtol=0.15)


# ---------------------------------------------------------------------------------------------
# choosing the path, and the speedrun config
# ---------------------------------------------------------------------------------------------
def test_pipeline_choice_and_its_errors(tmp_path):
    assert pipeline_name(make_cfg(MNIST), "TRAIN") == "memory"
    assert pipeline_name(make_cfg({**MNIST, "TRAIN.DATA_PIPELINE": "loader"}), "TRAIN") == "loader"
    assert not isinstance(data.build_train_loader(make_cfg({**MNIST, "TRAIN.DATA_PIPELINE": "loader"}), 0, 1, CPU),
                          MemoryLoader)
    syn = {"TRAIN.DATASET": "synthetic", "TEST.DATASET": "synthetic", "MODEL.NUM_CLASSES": 4, "TRAIN.TOPK": 2}
    assert pipeline_name(make_cfg(syn), "TRAIN") == "loader"  # auto: synthetic stays on the DataLoader
    folder = make_cfg({**syn, "TRAIN.DATASET": str(tmp_path), "TRAIN.DATA_PIPELINE": "memory"})
    with pytest.raises(UserError, match="TRAIN.DATA_PIPELINE memory.*image folder"):
        pipeline_name(folder, "TRAIN")
    with pytest.raises(UserError, match="TRAIN.DATA_PIPELINE must be one of auto, memory, loader"):
        make_cfg({**MNIST, "TRAIN.DATA_PIPELINE": "gpu"})  # the config's choices (load_config)
    with pytest.raises(UserError, match="TRAIN.IMAGE_DECODE must be one of fast, pil"):
        make_cfg({**MNIST, "TRAIN.IMAGE_DECODE": "nvjpeg"})


def test_speedrun_config_validates_and_runs_in_memory():
    cfg = make_cfg(base=os.path.join(ROOT, "config", "mnist5k_fast.yaml"))
    assert cfg.TRAIN.DATASET == cfg.TEST.DATASET == "mnist5k" and cfg.MODEL.NUM_CLASSES == 10
    data.check_datasets(cfg, world_size=2)
    train, val = data.build_train_loader(cfg, 0, 2, CPU), data.build_val_loader(cfg, 1, 2, CPU)
    assert isinstance(train, MemoryLoader) and isinstance(val, MemoryLoader)
    train.sampler.set_epoch(0)
    x, y = next(iter(train))
    size = cfg.TRAIN.IM_SIZE
    assert x.shape == (cfg.TRAIN.BATCH_SIZE, 1, size, size) and len(train) == 4000 // 2 // cfg.TRAIN.BATCH_SIZE
    assert sum(len(b) for _, b in val) == 500

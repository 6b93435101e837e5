"""The input pipelines' seam: one Pipeline class per pipeline, chosen in one place
(loading.pipeline_class) once per split key, every loader keeping the contract of loading.pipeline.Pipeline;
a new pipeline is one module and one branch of the chooser."""

from __future__ import annotations

import logging

import pytest
import torch

from distribuuuu import data
from distribuuuu.data import loading, shards
from distribuuuu.data.holdout import part_of
from distribuuuu.data.loading import memory
from distribuuuu.data.loading.batches import NormalizedBatches
from distribuuuu.data.loading.items import split_dataset
from distribuuuu.data.loading.memory import MemoryLoader, MemoryPipeline
from distribuuuu.data.loading.pipeline import LoaderPipeline, Pipeline
from distribuuuu.data.shards.loader import ShardLoader, ShardPipeline
from distribuuuu.errors import UserError
from tests.conftest import make_cfg, write_fake_cifar10, write_image_tree

CPU = torch.device("cpu")
MNIST = {"TRAIN.DATASET": "mnist5k", "TEST.DATASET": "mnist5k", "TEST.SPLIT": "val", "MODEL.NUM_CLASSES": 10,
         "MODEL.IN_CHANS": 1, "TRAIN.IM_SIZE": 28, "TEST.IM_SIZE": 28, "TRAIN.WORKERS": 0, "TRAIN.BATCH_SIZE": 64}
SYN = {"TRAIN.DATASET": "synthetic", "TEST.DATASET": "synthetic", "MODEL.NUM_CLASSES": 4, "TRAIN.TOPK": 2,
       "TRAIN.IM_SIZE": 8, "TRAIN.SYNTHETIC_SAMPLES": 40, "TEST.SYNTHETIC_SAMPLES": 13, "TRAIN.WORKERS": 0,
       "TRAIN.BATCH_SIZE": 4, "TEST.BATCH_SIZE": 4}


@pytest.fixture(scope="module")
def sources_on_disk(tmp_path_factory):
    """{'folder': an image folder (train + val, 3 classes), 'shards': its shard set, 'cifar': fake CIFAR-10}."""
    root = tmp_path_factory.mktemp("pipelines")
    folder = str(root / "folder")
    write_image_tree(folder, "train", {"a": 6, "b": 6, "c": 6}, size=(10, 10))
    write_image_tree(folder, "val", {"a": 3, "b": 2, "c": 2}, size=(10, 10))
    shards.write_shards(folder, str(root / "shards"), shard_samples=5, progress=False)
    write_fake_cifar10(str(root / "cifar" / "cifar-10-batches-py"), per_batch=4, test_size=7)
    return {"folder": folder, "shards": str(root / "shards"), "cifar": str(root / "cifar")}


def _images(path: str) -> dict:
    return {"TRAIN.DATASET": path, "TEST.DATASET": path, "TEST.SPLIT": "val", "MODEL.NUM_CLASSES": 3,
            "TRAIN.IM_SIZE": 8, "TEST.IM_SIZE": 8, "TRAIN.WORKERS": 0, "TRAIN.BATCH_SIZE": 4, "TEST.BATCH_SIZE": 4}


def _cifar(path: str) -> dict:
    return {"TRAIN.DATASET": path, "TEST.DATASET": path, "MODEL.NUM_CLASSES": 10, "TRAIN.IM_SIZE": 32,
            "TRAIN.WORKERS": 0, "TRAIN.BATCH_SIZE": 4, "TEST.BATCH_SIZE": 4}


# (case, source, overrides, {split key: the class the chooser must give})
CHOICES = [
    ("mnist5k auto", "mnist", {}, {"TRAIN": MemoryPipeline, "TEST": MemoryPipeline}),
    ("mnist5k loader", "mnist", {"TRAIN.DATA_PIPELINE": "loader"}, {"TRAIN": LoaderPipeline, "TEST": LoaderPipeline}),
    ("mnist5k auto, resized crops", "mnist", {"TRAIN.CROP_SCALE": [0.8, 1.0]},
     {"TRAIN": LoaderPipeline, "TEST": MemoryPipeline}),
    ("synthetic auto", "syn", {}, {"TRAIN": LoaderPipeline, "TEST": LoaderPipeline}),
    ("synthetic memory", "syn", {"TRAIN.DATA_PIPELINE": "memory"}, {"TRAIN": MemoryPipeline, "TEST": MemoryPipeline}),
    ("dummy input, memory asked", "syn", {"MODEL.DUMMY_INPUT": True, "TRAIN.DATA_PIPELINE": "memory"},
     {"TRAIN": LoaderPipeline, "TEST": LoaderPipeline}),
    ("cifar auto", "cifar", {}, {"TRAIN": MemoryPipeline, "TEST": MemoryPipeline}),
    ("folder auto", "folder", {}, {"TRAIN": LoaderPipeline, "TEST": LoaderPipeline}),
    ("folder pil", "folder", {"TRAIN.IMAGE_DECODE": "pil"}, {"TRAIN": LoaderPipeline, "TEST": LoaderPipeline}),
    ("shards auto", "shards", {}, {"TRAIN": ShardPipeline, "TEST": ShardPipeline}),
    ("shards loader", "shards", {"TRAIN.DATA_PIPELINE": "loader"}, {"TRAIN": ShardPipeline, "TEST": ShardPipeline}),
]


def _source_cfg(sources_on_disk: dict, source: str, overrides: dict):
    """The config of one of this module's sources (a CHOICES name), with overrides."""
    base = {"mnist": MNIST, "syn": SYN}.get(source)
    if base is None:
        base = _cifar(sources_on_disk["cifar"]) if source == "cifar" else _images(sources_on_disk[source])
    return make_cfg(base, overrides)


@pytest.mark.parametrize("case,source,overrides,expected", CHOICES, ids=[c[0] for c in CHOICES])
def test_the_chooser_gives_each_config_its_pipeline(sources_on_disk, case, source, overrides, expected):
    cfg = _source_cfg(sources_on_disk, source, overrides)
    for key, cls in expected.items():
        assert loading.pipeline_class(cfg, key) is cls, f"{case}, {key}"


@pytest.mark.parametrize("source,overrides,message", [
    ("folder", {"TRAIN.DATA_PIPELINE": "memory"}, "TRAIN.DATA_PIPELINE memory .* is an image folder"),
    ("shards", {"TRAIN.DATA_PIPELINE": "memory"}, "TRAIN.DATA_PIPELINE memory .* is a shard set"),
    ("mnist", {"TRAIN.DATA_PIPELINE": "memory", "TRAIN.CROP_SCALE": [0.8, 1.0]}, "TRAIN.CROP_SCALE needs"),
])
def test_the_chooser_refuses_what_the_forced_pipeline_cannot_read(sources_on_disk, source, overrides, message):
    with pytest.raises(UserError, match=message):
        loading.pipeline_class(_source_cfg(sources_on_disk, source, overrides), "TRAIN")


def test_auto_falls_back_to_the_dataloader_above_the_memory_budget(sources_on_disk, monkeypatch, caplog):
    cfg = _source_cfg(sources_on_disk, "cifar", {})
    monkeypatch.setattr(memory, "MEMORY_PIPELINE_BUDGET_BYTES", memory.memory_pipeline_bytes(cfg, "TRAIN") - 1)
    with caplog.at_level(logging.WARNING, logger="distribuuuu"):
        assert loading.pipeline_class(cfg, "TRAIN") is LoaderPipeline
    assert "using the DataLoader instead" in caplog.text
    assert loading.pipeline_class(cfg, "TEST") is MemoryPipeline  # 7 test images fit


@pytest.mark.parametrize("source,overrides,loader_type", [
    ("mnist", {}, MemoryLoader), ("syn", {}, torch.utils.data.DataLoader),
    ("folder", {}, NormalizedBatches), ("folder", {"TRAIN.IMAGE_DECODE": "pil"}, torch.utils.data.DataLoader),
    ("shards", {}, NormalizedBatches), ("shards", {"TRAIN.IMAGE_DECODE": "pil"}, ShardLoader),
])
def test_every_pipeline_keeps_the_train_loader_contract(sources_on_disk, source, overrides, loader_type):
    """len(), .dataset, .sampler.set_epoch(epoch, start), (images, target) batches: the Pipeline docstring."""
    cfg = _source_cfg(sources_on_disk, source, overrides)
    loader = data.build_train_loader(cfg, 1, 2, CPU)
    assert isinstance(loader, loader_type)
    assert len(loader.dataset) > 0 and len(loader.dataset.classes) == cfg.MODEL.NUM_CLASSES
    loader.sampler.set_epoch(1, 0)
    whole = len(loader)
    images, target = next(iter(loader))
    assert images.dtype == torch.float32 and images.shape[1:] == (cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE, cfg.TRAIN.IM_SIZE)
    assert target.dtype == torch.int64 and 0 < len(target) == len(images) <= cfg.TRAIN.BATCH_SIZE
    loader.sampler.set_epoch(1, 2 * cfg.TRAIN.BATCH_SIZE)  # resumed after one global step of 2 ranks
    assert len(loader) == whole - 1


# -- a new pipeline: a Pipeline subclass (and one branch of loading.pipeline_class) ------------------
class _Batches:
    """The loader of the pipeline below: batches cut from a plain list of items (no DataLoader)."""

    def __init__(self, dataset, sampler, batch_size: int, drop_last: bool) -> None:
        self.dataset, self.sampler, self.batch_size, self.drop_last = dataset, sampler, batch_size, drop_last

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):
        order = list(self.sampler)
        for b in range(len(self)):
            items = [self.dataset[i] for i in order[b * self.batch_size:(b + 1) * self.batch_size]]
            yield torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


class ListPipeline(Pipeline):
    """A pipeline a user could add: the interface's helpers (items, samplers) and nothing else."""

    def train_loader(self, part, place):
        dataset = part_of(self.cfg, split_dataset(self.cfg, self.key, True, batched=False), part)
        return _Batches(dataset, self.sampler(dataset, True, place), self.cfg.TRAIN.BATCH_SIZE, True)

    def eval_loader(self, part, place):
        dataset = part_of(self.cfg, split_dataset(self.cfg, self.key, False, batched=False), part)
        return _Batches(dataset, self.sampler(dataset, False, place), self.cfg.TEST.BATCH_SIZE, False)


def test_a_new_pipeline_is_one_class_behind_the_chooser(monkeypatch):
    monkeypatch.setattr(loading, "pipeline_class", lambda cfg, key: ListPipeline)  # its one branch
    cfg = make_cfg({**SYN, "TRAIN.VAL_SPLIT": 0.2})
    train = data.build_train_loader(cfg, 0, 2, CPU)
    assert isinstance(train, _Batches) and len(train.dataset) == 32  # TRAIN.VAL_SPLIT's kept part (2 of 10 per class held out)
    train.sampler.set_epoch(3, 8)
    assert len(train) == (32 - 8) // 2 // 4
    images, target = next(iter(train))
    assert images.shape == (4, 3, 8, 8) and target.shape == (4,)
    held = [len(data.build_val_loader(cfg, r, 2, CPU).sampler) for r in range(2)]
    assert sum(held) == 8  # the held-out part, each image on one rank
    assert len(data.build_test_loader(cfg, 0, 1, CPU).dataset) == 13


def test_the_chooser_refuses_a_name_it_does_not_have():
    cfg = make_cfg(SYN)
    cfg.defrost()
    cfg.TRAIN.DATA_PIPELINE = "nope"
    with pytest.raises(UserError, match="must be one of auto, memory, loader, got 'nope'"):
        loading.pipeline_class(cfg, "TRAIN")

"""From a split to one rank's batches: the choice of a split's pipeline
(the one chooser, ``pipeline_class``), and the train / val / test
loaders.

  build_train_loader  the TRAIN data (its kept part under TRAIN.VAL_SPLIT),
                      augmented, in a resumable shuffle
  build_val_loader    what picks the best checkpoint: the part TRAIN.VAL_SPLIT
                      holds out (eval transforms), else the TEST data
  build_test_loader   always the TEST data

The pipelines (pipeline.Pipeline): the DataLoader (pipeline.py), the
split held in device memory (memory.py), JPEGs decoded on the device
(decoding/device.py), a shard set's stream (shards/loader.py).
"""

from __future__ import annotations

from typing import Any

import torch
from yacs.config import CfgNode

from distribuuuu.config.validate import DATA_PIPELINES
from distribuuuu.data import sources, transforms
from distribuuuu.data.loading.pipeline import LoaderPipeline, Pipeline, Place
from distribuuuu.data.sources import registry
from distribuuuu.errors import UserError


def pipeline_class(cfg: CfgNode, key: str) -> type[Pipeline]:
    """The pipeline that reads cfg[key]: a shard set's stream, whatever
    TRAIN.DATA_PIPELINE says; the split in memory or the DataLoader when
    it says so (memory refuses what it cannot hold); JPEGs decoded on the
    device under TRAIN.IMAGE_DECODE gpu (auto: where CUDA is); under
    auto, small tensor sources in memory while they fit, the rest
    through the DataLoader."""
    choice, kind, decode = (
        cfg.TRAIN.DATA_PIPELINE,
        sources.kind_of(cfg, key),
        cfg.TRAIN.IMAGE_DECODE,
    )
    if choice not in DATA_PIPELINES:
        raise UserError(
            f"TRAIN.DATA_PIPELINE must be one of {', '.join(DATA_PIPELINES)}, got {choice!r}"
        )
    if kind == "dummy":
        return LoaderPipeline
    if choice == "memory":
        from distribuuuu.data.loading.memory import MemoryPipeline

        refusal = MemoryPipeline.refusal(cfg, key)
        if refusal:
            raise UserError(refusal)
        return MemoryPipeline
    if kind == "shards":
        from distribuuuu.data.shards.loader import ShardPipeline

        return ShardPipeline
    files = kind in sources.IMAGE_FILES
    if files and (decode == "gpu" or decode == "auto" and torch.cuda.is_available()):
        from distribuuuu.data.decoding.device import DeviceDecodePipeline

        return DeviceDecodePipeline
    if choice == "loader" or files:
        return LoaderPipeline
    from distribuuuu.data.loading.memory import MemoryPipeline

    return MemoryPipeline if MemoryPipeline.auto_takes(cfg, key) else LoaderPipeline


def build_train_loader(cfg: CfgNode, rank: int, world_size: int, device: torch.device) -> Any:
    """The TRAIN data (with TRAIN.VAL_SPLIT, the kept part only),
    augmented, in a resumable shuffle. Rank 0 says what the recipe is,
    and what ready-made items (dummy input, a registered Dataset) lack."""
    if rank == 0:
        if sources.kind_of(cfg, "TRAIN") in ("dummy", "registered"):
            registry.note_ready_items(cfg)
        transforms.log_recipe(cfg)
    part = "train" if cfg.TRAIN.VAL_SPLIT else None
    place = Place(rank, world_size, device)
    return pipeline_class(cfg, "TRAIN")(cfg, "TRAIN").train_loader(part, place)


def build_val_loader(cfg: CfgNode, rank: int, world_size: int, device: torch.device) -> Any:
    """The validation data: with TRAIN.VAL_SPLIT the part of the TRAIN
    data held out from training, with the eval transforms; else the
    TEST data. Sharded exactly."""
    if not cfg.TRAIN.VAL_SPLIT:
        return build_test_loader(cfg, rank, world_size, device)
    place = Place(rank, world_size, device)
    return pipeline_class(cfg, "TRAIN")(cfg, "TRAIN").eval_loader("val", place)


def build_test_loader(cfg: CfgNode, rank: int, world_size: int, device: torch.device) -> Any:
    """The TEST data, whatever TRAIN.VAL_SPLIT is. Sharded exactly."""
    place = Place(rank, world_size, device)
    return pipeline_class(cfg, "TEST")(cfg, "TEST").eval_loader(None, place)

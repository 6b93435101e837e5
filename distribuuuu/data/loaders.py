"""The train / val / test loaders of one rank, and the one place that chooses their pipeline.

pipeline_class picks, once per split key, the Pipeline subclass (data/pipeline.py, which states the
contract every loader keeps) that reads cfg[key]:
  a shard set                  shards.loader.ShardPipeline (whatever TRAIN.DATA_PIPELINE says)
  TRAIN.DATA_PIPELINE memory   memory.MemoryPipeline (UserError for folders, shards, TRAIN.CROP_SCALE)
  TRAIN.DATA_PIPELINE loader   dataloader.LoaderPipeline; MODEL.DUMMY_INPUT always
  TRAIN.DATA_PIPELINE auto     the first class of PIPELINES whose auto_takes(cfg, key) holds: the memory
                               pipeline for mnist5k, CIFAR and TensorSources that fit its budget, else
                               the DataLoader
build_train_loader / build_val_loader / build_test_loader are thin calls to the chosen pipeline.
Adding a pipeline is one Pipeline subclass and one line in PIPELINES (its name also among the
config's TRAIN.DATA_PIPELINE choices, config/validate.py DATA_PIPELINES, which load_config checks).

TRAIN.VAL_SPLIT > 0 cuts the TRAIN data in two (datasets.part_of): the train loader reads the kept
part, the val loader the held-out part with the eval transforms; the test loader always reads TEST.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.data import DataLoader
from yacs.config import CfgNode

from distribuuuu.data import registry, sources
from distribuuuu.data.dataloader import LoaderPipeline
from distribuuuu.data.datasets import registered_data
from distribuuuu.data.memory import MemoryPipeline
from distribuuuu.data.pipeline import Pipeline
from distribuuuu.data.recipe import log_recipe
from distribuuuu.data.registry import TensorSource
from distribuuuu.data.shards.loader import ShardPipeline
from distribuuuu.errors import UserError

# TRAIN.DATA_PIPELINE's names besides 'auto', each with its class; 'auto' asks them in this order.
PIPELINES: dict[str, type[Pipeline]] = {
    "memory": MemoryPipeline,
    "loader": LoaderPipeline,
}

log = logging.getLogger("distribuuuu")
__all__ = ["PIPELINES", "pipeline_class", "data_pipeline", "build_train_loader", "build_val_loader",
           "build_test_loader", "take_bad_image_count"]


def pipeline_class(cfg: CfgNode, key: str) -> type[Pipeline]:
    """The pipeline that reads cfg[key] (UserError when the one TRAIN.DATA_PIPELINE names cannot)."""
    choice, names = cfg.TRAIN.DATA_PIPELINE, ("auto", *PIPELINES)
    if choice not in names:
        raise UserError(f"TRAIN.DATA_PIPELINE must be one of {', '.join(names)}, got {choice!r}")
    if cfg.MODEL.DUMMY_INPUT:
        return LoaderPipeline  # random tensors, whatever the choice
    forced = PIPELINES.get(choice)
    refusal = forced.refusal(cfg, key) if forced is not None else None
    if refusal is not None:
        raise UserError(refusal)
    if sources.source_kind(cfg[key].DATASET) == "shards":
        return ShardPipeline  # read as a stream, whatever the choice
    if forced is not None:
        return forced
    return next(cls for cls in PIPELINES.values() if cls.auto_takes(cfg, key))


def data_pipeline(cfg: CfgNode, key: str) -> str:
    """The name of pipeline_class(cfg, key): 'memory', 'loader' or 'shards'."""
    return pipeline_class(cfg, key).name


def build_train_loader(cfg: CfgNode, rank: int, world_size: int, device: torch.device) -> Any:
    """The TRAIN data (with TRAIN.VAL_SPLIT, the kept part only), augmented, shuffled by a resumable
    sampler: a DataLoader, a MemoryLoader or a shard loader with the interface of pipeline.Pipeline."""
    _note_unaugmented(cfg, rank)
    if rank == 0:
        registry.warn_unstated_stats(cfg)
        log_recipe(cfg)
    pipeline = pipeline_class(cfg, "TRAIN")(cfg, "TRAIN")
    return pipeline.train_loader("train" if cfg.TRAIN.VAL_SPLIT else None, rank, world_size, device)


def build_val_loader(cfg: CfgNode, rank: int, world_size: int, device: torch.device) -> Any:
    """The validation data: with TRAIN.VAL_SPLIT > 0 the part of the TRAIN data held out from
    training, with the eval transforms; else the TEST data (as build_test_loader). Sharded exactly."""
    if not cfg.TRAIN.VAL_SPLIT:
        return build_test_loader(cfg, rank, world_size, device)
    return pipeline_class(cfg, "TRAIN")(cfg, "TRAIN").eval_loader("val", rank, world_size, device)


def build_test_loader(cfg: CfgNode, rank: int, world_size: int, device: torch.device) -> Any:
    """The TEST data, whatever TRAIN.VAL_SPLIT is. Sharded exactly."""
    return pipeline_class(cfg, "TEST")(cfg, "TEST").eval_loader(None, rank, world_size, device)


def _note_unaugmented(cfg: CfgNode, rank: int) -> None:
    """Synthetic data, a registered Dataset and dummy input are never augmented (no crops either): say so once."""
    asked = cfg.TRAIN.AUTO_AUGMENT != "none" or cfg.TRAIN.RANDOM_ERASE > 0
    if not asked or rank != 0:
        return
    if cfg.MODEL.DUMMY_INPUT:
        what = "MODEL.DUMMY_INPUT"
    else:
        data, name = registered_data(cfg, "TRAIN"), cfg.TRAIN.DATASET
        if data is None or isinstance(data, TensorSource):
            return
        what = "synthetic data" if name == "synthetic" else f"the {name} source's items"
    log.warning("TRAIN.AUTO_AUGMENT and TRAIN.RANDOM_ERASE have no effect on %s: those images are "
                "not augmented", what)


def take_bad_image_count(loader: DataLoader) -> int:
    """Unreadable images this process's loader skipped since the last call (0 for tensor sources)."""
    take = getattr(loader.dataset, "take_bad_count", None)
    return take() if take else 0

"""The DataLoader pipeline: a torch DataLoader with worker processes over per-sample items.

It reads image folders, synthetic data, a registered Dataset and MODEL.DUMMY_INPUT, and the tensor
sources (mnist5k, CIFAR) when the in-memory pipeline does not take them (TRAIN.DATA_PIPELINE loader,
TRAIN.CROP_SCALE, or above the memory budget). TRAIN.IMAGE_DECODE fast is an option of this class, not
a class of its own: it changes only what a folder item is (a uint8 crop decoded in the worker) and adds
one wrapper that normalizes each batch on the device (batches.NormalizedBatches); the datasets, samplers
and workers are the same, and the shard pipeline takes the same option for its records.
An unreadable folder image (TRAIN.BAD_IMAGES skip) is replaced by the next readable one in training
(every rank keeps its batch size); in evaluation it is left out of its batch (collate_readable), so
evaluation counts distinct readable images.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from distribuuuu.data import sources, transforms
from distribuuuu.data.batches import NormalizedBatches, ReadableBatches, collate_readable, seed_worker, track_workers
from distribuuuu.data.datasets import build_split_dataset, part_of
from distribuuuu.data.pipeline import Pipeline
from distribuuuu.data.recipe import recipe_of


class LoaderPipeline(Pipeline):
    """A DataLoader over the split's dataset (TRAIN.DATA_PIPELINE loader; what auto falls back to)."""

    name = "loader"

    @classmethod
    def auto_takes(cls, cfg: Any, key: str) -> bool:
        return True  # reads every source: the last resort of 'auto'

    def train_loader(self, part: str | None, rank: int, world_size: int, device: torch.device) -> Any:
        cfg, fast = self.cfg, self.fast_decode()
        dataset = part_of(cfg, build_split_dataset(cfg, self.key, True, batched=fast), part)
        sampler = self.sampler(dataset, True, rank, world_size)
        folder = getattr(dataset, "dataset", dataset)  # (a VAL_SPLIT part's whole folder)
        if cfg.TRAIN.REPEATED_AUG == 1 and isinstance(folder, sources.ImageFolderWithClasses):  # copies need their own draws
            sampler.on_epoch = folder.seed_items
        # Drop the last partial batch (a BatchNorm batch of 1 fails) unless that would leave nothing.
        drop_last, batch = len(sampler) >= cfg.TRAIN.BATCH_SIZE, cfg.TRAIN.BATCH_SIZE
        loader = self.data_loader(dataset, sampler, batch, drop_last, rank, device, stream=0)
        return self.normalized(loader, device, erase=cfg.TRAIN.RANDOM_ERASE) if fast else loader

    def eval_loader(self, part: str | None, rank: int, world_size: int, device: torch.device) -> Any:
        fast = self.fast_decode()
        dataset = part_of(self.cfg, build_split_dataset(self.cfg, self.key, False, batched=fast), part)
        sampler = self.sampler(dataset, False, rank, world_size)
        loader = ReadableBatches(self.data_loader(dataset, sampler, self.cfg.TEST.BATCH_SIZE, False, rank, device,
                                                  stream=1, collate_fn=collate_readable))
        return self.normalized(loader, device) if fast else loader

    def fast_decode(self) -> bool:
        """Whether the split is an image folder read by the fast path (uint8 items, batch normalization)."""
        cfg = self.cfg
        return (cfg.TRAIN.IMAGE_DECODE == "fast" and not cfg.MODEL.DUMMY_INPUT
                and sources.source_kind(cfg[self.key].DATASET) == "folder")

    def normalized(self, loader: Any, device: torch.device, erase: float = 0.0) -> NormalizedBatches:
        stats = recipe_of(self.cfg).stats or transforms.IMAGENET_STATS
        return NormalizedBatches(loader, transforms.stats_for_channels(stats, self.cfg.MODEL.IN_CHANS), device, erase)

    def data_loader(self, dataset: Dataset, sampler: Sampler, batch_size: int, drop_last: bool, rank: int,
                    device: torch.device, stream: int, collate_fn: Callable | None = None) -> DataLoader:
        """TRAIN.WORKERS processes per training process (Distribuuuu's 4 by default; see
        docs/performance.md for sizing them from the cores), kept alive between epochs; pinned
        batches only when they go to a GPU; torch's prefetch_factor (2 batches per worker)."""
        cfg, workers = self.cfg, self.cfg.TRAIN.WORKERS
        # The generator draws the workers' base seed: fixed by RNG_SEED (or the seed torch was given
        # when RNG_SEED is None), different per rank and per loader so augmentations differ.
        base = cfg.RNG_SEED if cfg.RNG_SEED is not None else torch.initial_seed()
        generator = torch.Generator()
        generator.manual_seed(int(np.random.SeedSequence([base % 2**64, rank, stream]).generate_state(1)[0]))
        return track_workers(DataLoader(
            dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
            num_workers=workers, persistent_workers=workers > 0,
            pin_memory=cfg.TRAIN.PIN_MEMORY and device.type == "cuda",
            worker_init_fn=seed_worker, generator=generator, collate_fn=collate_fn,
        ))

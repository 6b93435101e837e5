"""The pipeline interface, and the default pipeline: a torch DataLoader
with worker processes over a split's per-sample items."""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from yacs.config import CfgNode

from distribuuuu.data import holdout, sources, transforms
from distribuuuu.data.loading import balance, items
from distribuuuu.data.loading.batches import (
    NormalizedBatches,
    ReadableBatches,
    collate_readable,
    seed_worker,
    track_workers,
)
from distribuuuu.data.loading.samplers import ResumableDistributedSampler, ShardedEvalSampler


class Place(NamedTuple):
    """Where a loader runs: rank of world_size, feeding device."""

    rank: int
    world_size: int
    device: torch.device


class Pipeline:
    """How cfg[key]'s data becomes batches on one rank. What the engine
    relies on, from every pipeline: train_loader's loader has

      len(loader)                     the batches left in this epoch
      loader.dataset                  the per-sample data: len(), .classes
      loader.sampler.set_epoch(e, s)  reshuffle for epoch e, skipping the s
                                      samples all ranks already consumed
      iteration                       (images, target): float images,
                                      normalized; int64 labels

    eval_loader's keeps len(), .dataset and the iteration, and is exact:
    each sample on one rank only. part: None (the whole split), or
    TRAIN.VAL_SPLIT's 'train' (kept) or 'val' (held-out) part.
    """

    def __init__(self, cfg: CfgNode, key: str) -> None:
        self.cfg, self.key = cfg, key

    def train_loader(self, part: str | None, place: Place) -> Any:
        raise NotImplementedError

    def eval_loader(self, part: str | None, place: Place) -> Any:
        raise NotImplementedError

    def sampler(self, dataset: Sized, train: bool, place: Place) -> Sampler:
        """Training: resumable even for one process, seeded by the
        engine's seed (RNG_SEED, or the one it drew), in the order
        TRAIN.CLASS_BALANCE asks for. Evaluation: exact."""
        if not train:
            return ShardedEvalSampler(dataset, place.world_size, place.rank)
        balance.note_spread(self.cfg, dataset)
        draw = torch.randperm
        if self.cfg.TRAIN.CLASS_BALANCE == "sampler":
            draw = balance.BalancedDraw(dataset)
        return ResumableDistributedSampler(
            dataset,
            place.world_size,
            place.rank,
            seed=self.cfg.RNG_SEED or 0,
            repeats=self.cfg.TRAIN.REPEATED_AUG,
            draw=draw,
        )


class LoaderPipeline(Pipeline):
    """A DataLoader with TRAIN.WORKERS worker processes over the split's
    items: image files, synthetic data, a registered Dataset, dummy
    input, and the tensor sources that the in-memory pipeline does not
    take. Image files (TRAIN.IMAGE_DECODE fast) come as uint8 crops from
    the workers and are normalized per batch on the device."""

    def train_loader(self, part: str | None, place: Place) -> Any:
        cfg = self.cfg
        dataset, sampler, fast = self.items(True, part, place)
        # Image files are seeded per item, so that a resumed epoch redraws
        # the same augmentations; not with TRAIN.REPEATED_AUG > 1, whose
        # copies of an index need their own draws.
        whole = getattr(dataset, "dataset", dataset)  # (a VAL_SPLIT part: the whole split)
        if cfg.TRAIN.REPEATED_AUG == 1 and isinstance(whole, items.ImageDataset):
            sampler.on_epoch = whole.seed_items
        # Drop the last partial batch (a BatchNorm batch of 1 fails),
        # unless that would leave nothing.
        drop_last = len(sampler) >= cfg.TRAIN.BATCH_SIZE
        loader = self.data_loader(dataset, sampler, cfg.TRAIN.BATCH_SIZE, drop_last, place, 0)
        if not fast:
            return loader
        stats = transforms.image_stats(cfg)
        return NormalizedBatches(loader, stats, place.device, cfg.TRAIN.RANDOM_ERASE)

    def eval_loader(self, part: str | None, place: Place) -> Any:
        dataset, sampler, fast = self.items(False, part, place)
        batch = self.cfg.TEST.BATCH_SIZE
        loader = self.data_loader(
            dataset, sampler, batch, False, place, 1, collate_fn=collate_readable
        )
        loader = ReadableBatches(loader)
        if not fast:
            return loader
        return NormalizedBatches(loader, transforms.image_stats(self.cfg), place.device)

    def items(self, train: bool, part: str | None, place: Place) -> tuple[Dataset, Sampler, bool]:
        """(the split's items, or its part's; their sampler; whether they
        are image files' uint8 crops, normalized per batch)."""
        cfg = self.cfg
        kind = sources.kind_of(cfg, self.key)
        fast = kind in sources.IMAGE_FILES and cfg.TRAIN.IMAGE_DECODE != "pil"
        dataset = items.split_dataset(cfg, self.key, train, batched=fast)
        if part is not None:
            dataset = holdout.part_of(cfg, dataset, part)
        return dataset, self.sampler(dataset, train, place), fast

    def data_loader(
        self,
        dataset: Dataset,
        sampler: Sampler,
        batch_size: int,
        drop_last: bool,
        place: Place,
        stream: int,
        collate_fn: Callable | None = None,
    ) -> DataLoader:
        """Workers kept alive between epochs; pinned batches only for a
        GPU. The workers' base seed follows RNG_SEED (or torch's seed)
        and differs per rank and per loader (stream), so that their
        augmentations differ."""
        cfg, workers = self.cfg, self.cfg.TRAIN.WORKERS
        base = cfg.RNG_SEED if cfg.RNG_SEED is not None else torch.initial_seed()
        seeds = np.random.SeedSequence([base % 2**64, place.rank, stream])
        generator = torch.Generator().manual_seed(int(seeds.generate_state(1)[0]))
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=drop_last,
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=cfg.TRAIN.PIN_MEMORY and place.device.type == "cuda",
            worker_init_fn=seed_worker,
            generator=generator,
            collate_fn=collate_fn,
        )
        return track_workers(loader)

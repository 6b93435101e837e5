"""The input pipelines' seam: from the config to one rank's train / val / test loader.

This module holds, in reading order:
  Pipeline                     the interface every input pipeline keeps (one subclass per way of reading a split)
  the samplers                 the pipelines' shared part: a resumable shuffle for training (it restarts
                               mid-epoch at the next unseen sample), an exact one for evaluation (every
                               sample once over all ranks)
  LoaderPipeline               the default pipeline: a torch DataLoader over per-sample items
  PIPELINES, pipeline_class    the one place that chooses a split's pipeline
  build_train_loader / build_val_loader / build_test_loader   thin calls to the chosen pipeline

pipeline_class picks, once per split key, the Pipeline subclass that reads cfg[key]:
  a shard set                  shards.loader.ShardPipeline (whatever TRAIN.DATA_PIPELINE says)
  TRAIN.DATA_PIPELINE memory   memory.MemoryPipeline (UserError for folders, shards, TRAIN.CROP_SCALE)
  TRAIN.DATA_PIPELINE loader   LoaderPipeline (here); MODEL.DUMMY_INPUT always
  TRAIN.DATA_PIPELINE auto     the first class of PIPELINES whose auto_takes(cfg, key) holds: the memory
                               pipeline for mnist5k, CIFAR and TensorSources that fit its budget, else
                               the DataLoader
The side modules (memory.py, shards/loader.py) import this one, so PIPELINES names each class's module,
imported on first use (each ends in ``PIPELINE = TheClass``). Adding a pipeline: such a module, one line
in PIPELINES, and its name among the config's TRAIN.DATA_PIPELINE choices (config/validate.py
DATA_PIPELINES, which load_config checks).

TRAIN.VAL_SPLIT > 0 cuts the TRAIN data in two (datasets.part_of): the train loader reads the kept
part, the val loader the held-out part with the eval transforms; the test loader always reads TEST.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterator, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from yacs.config import CfgNode

from distribuuuu.data import registry, sources, transforms
from distribuuuu.data.batches import NormalizedBatches, ReadableBatches, collate_readable, seed_worker, track_workers
from distribuuuu.data.datasets import build_split_dataset, part_of, registered_data
from distribuuuu.data.recipe import log_recipe, recipe_of
from distribuuuu.data.registry import TensorSource
from distribuuuu.errors import UserError

log = logging.getLogger("distribuuuu")
__all__ = ["Pipeline", "ResumableDistributedSampler", "ShardedEvalSampler", "LoaderPipeline", "PIPELINES",
           "registered", "pipeline_class", "data_pipeline", "build_train_loader", "build_val_loader",
           "build_test_loader", "take_bad_image_count"]


# ---------------------------------------------------------------------------------------------
# The pipeline interface
# ---------------------------------------------------------------------------------------------
class Pipeline:
    """How cfg[key]'s data becomes batches on one rank. The contract every pipeline keeps (the engine
    relies on it): train_loader's loader has
      len(loader)                     the batches left in this epoch
      loader.dataset                  the per-sample data: len(), .classes (take_bad_count() where an
                                      image can be unreadable: take_bad_image_count)
      loader.sampler.set_epoch(e, s)  reshuffle for epoch e, skipping the s samples all ranks already
                                      consumed (a resume mid-epoch); the same order on every rank
      iteration                       (images, target): float images, normalized; int64 labels
    eval_loader's keeps len(), .dataset and the iteration, and is exact: each sample on one rank only.
    part: None (the whole split), or TRAIN.VAL_SPLIT's 'train' (kept) or 'val' (held-out) part.
    """

    name = ""  # the TRAIN.DATA_PIPELINE value that forces it (its key in PIPELINES)

    def __init__(self, cfg: CfgNode, key: str) -> None:
        self.cfg, self.key = cfg, key

    @classmethod
    def refusal(cls, cfg: CfgNode, key: str) -> str | None:
        """Why it cannot read cfg[key] when TRAIN.DATA_PIPELINE forces it (None: it can)."""
        return None

    @classmethod
    def auto_takes(cls, cfg: CfgNode, key: str) -> bool:
        """Whether TRAIN.DATA_PIPELINE auto reads cfg[key] this way (asked in PIPELINES' order)."""
        return False

    def train_loader(self, part: str | None, rank: int, world_size: int, device: torch.device) -> Any:
        raise NotImplementedError

    def eval_loader(self, part: str | None, rank: int, world_size: int, device: torch.device) -> Any:
        raise NotImplementedError

    def seed(self) -> int:
        """The shuffle's seed: the engine's cfg holds the run's (engine.trainer.seeded_cfg draws one for
        RNG_SEED None), so the logged seed repeats the shuffle; a tool without one gets 0."""
        return self.cfg.RNG_SEED if self.cfg.RNG_SEED is not None else 0

    def sampler(self, dataset: Sized, train: bool, rank: int, world_size: int) -> Sampler:
        """Training: resumable even for one process, so set_epoch(epoch, start) always works. Evaluation: exact."""
        if not train:
            return ShardedEvalSampler(dataset, num_replicas=world_size, rank=rank)
        return ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=self.seed(),
                                           repeats=self.cfg.TRAIN.REPEATED_AUG)


# ---------------------------------------------------------------------------------------------
# The samplers every pipeline shares: which samples each rank reads, in which order
# ---------------------------------------------------------------------------------------------
class ShardedEvalSampler(Sampler[int]):
    """Rank r of W gets the indices r, r+W, r+2W, ...: every sample exactly once over all ranks.

    Written by hand because DistributedSampler pads every rank to the same length by repeating
    samples (or drops them with drop_last), so metrics summed over ranks would count some images
    twice (or not at all). Here ranks may differ in length by one, and a rank may get nothing.
    """

    def __init__(self, dataset: Sized, num_replicas: int, rank: int) -> None:
        _check_shard(num_replicas, rank)
        self.num_samples_total = len(dataset)
        self.num_replicas = num_replicas
        self.rank = rank

    def _indices(self) -> range:
        return range(self.rank, self.num_samples_total, self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices())

    def __len__(self) -> int:
        return len(self._indices())


class ResumableDistributedSampler(Sampler[int]):
    """One seeded permutation per epoch, the same on every rank, sharded over ranks, able to start part-way.

    The position is counted in samples (all ranks together), so a resume, even with another world size,
    goes on with the next unseen sample; the fewer than W left-over samples are dropped, never repeated.
    ``repeats`` k > 1 is repeated augmentation: the k copies of an index land on different ranks.
    Why not torch's DistributedSampler: docs/reliability.md; repeated augmentation: docs/recipes.md.
    """

    def __init__(self, dataset: Sized, num_replicas: int, rank: int, seed: int = 0, repeats: int = 1) -> None:
        _check_shard(num_replicas, rank, repeats)
        self.size, self.num_replicas, self.rank, self.seed = len(dataset), num_replicas, rank, seed
        self.repeats = repeats
        self.epoch, self.start = 0, 0
        self.on_epoch: Callable[[int, int], None] | None = None  # called with (seed, epoch) by set_epoch

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Shuffle for ``epoch``, skipping the first ``start`` samples of its permutation."""
        if not 0 <= start <= self.size:
            raise ValueError(f"start {start} is not in [0, {self.size}]")
        self.epoch, self.start = epoch, start
        if self.on_epoch is not None:
            self.on_epoch(self.seed, epoch)

    def __iter__(self) -> Iterator[int]:
        rest = _epoch_order(self.size, self.seed + self.epoch, self.repeats)[self.start:]
        usable = len(rest) // self.num_replicas * self.num_replicas
        return iter(rest[self.rank:usable:self.num_replicas].tolist())

    def __len__(self) -> int:
        return (self.size - self.start) // self.num_replicas


def _check_shard(num_replicas: int, rank: int, repeats: int = 1) -> None:
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")


def _epoch_order(size: int, seed: int, repeats: int) -> torch.Tensor:
    """A seeded permutation of range(size), each index written ``repeats`` times in a row, cut to size."""
    g = torch.Generator()
    g.manual_seed(seed)
    order = torch.randperm(size, generator=g)
    if repeats > 1:  # the copies of an index stay adjacent, hence on different ranks
        order = order.repeat_interleave(repeats)[:size]
    return order


# ---------------------------------------------------------------------------------------------
# The default pipeline: a torch DataLoader
# ---------------------------------------------------------------------------------------------
class LoaderPipeline(Pipeline):
    """A DataLoader with worker processes over the split's per-sample items (TRAIN.DATA_PIPELINE loader;
    what auto falls back to).

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

    name = "loader"

    @classmethod
    def auto_takes(cls, cfg: Any, key: str) -> bool:
        return True  # reads every source: the last resort of 'auto'

    def train_loader(self, part: str | None, rank: int, world_size: int, device: torch.device) -> Any:
        cfg, fast = self.cfg, self.fast_decode()
        dataset = part_of(cfg, build_split_dataset(cfg, self.key, True, batched=fast), part)
        sampler = self.sampler(dataset, True, rank, world_size)
        self.seed_items_per_epoch(dataset, sampler)
        # Drop the last partial batch (a BatchNorm batch of 1 fails) unless that would leave nothing.
        drop_last = len(sampler) >= cfg.TRAIN.BATCH_SIZE
        loader = self.data_loader(dataset, sampler, cfg.TRAIN.BATCH_SIZE, drop_last, rank, device, stream=0)
        return self.normalized(loader, device, erase=cfg.TRAIN.RANDOM_ERASE) if fast else loader

    def eval_loader(self, part: str | None, rank: int, world_size: int, device: torch.device) -> Any:
        fast = self.fast_decode()
        dataset = part_of(self.cfg, build_split_dataset(self.cfg, self.key, False, batched=fast), part)
        sampler = self.sampler(dataset, False, rank, world_size)
        loader = ReadableBatches(self.data_loader(dataset, sampler, self.cfg.TEST.BATCH_SIZE, False, rank, device,
                                                  stream=1, collate_fn=collate_readable))
        return self.normalized(loader, device) if fast else loader

    def data_loader(self, dataset: Dataset, sampler: Sampler, batch_size: int, drop_last: bool, rank: int,
                    device: torch.device, stream: int, collate_fn: Callable | None = None) -> DataLoader:
        """TRAIN.WORKERS processes kept alive between epochs; pinned batches only for a GPU (docs/performance.md)."""
        cfg, workers = self.cfg, self.cfg.TRAIN.WORKERS
        return track_workers(DataLoader(
            dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
            num_workers=workers, persistent_workers=workers > 0,
            pin_memory=cfg.TRAIN.PIN_MEMORY and device.type == "cuda",
            worker_init_fn=seed_worker, generator=self.worker_generator(rank, stream), collate_fn=collate_fn,
        ))

    def seed_items_per_epoch(self, dataset: Dataset, sampler: ResumableDistributedSampler) -> None:
        """An image folder's items are seeded by (seed, epoch, index), so a resumed epoch redraws the same
        augmentations; not with TRAIN.REPEATED_AUG > 1, whose copies of an index need their own draws."""
        folder = getattr(dataset, "dataset", dataset)  # (a VAL_SPLIT part's whole folder)
        if self.cfg.TRAIN.REPEATED_AUG == 1 and isinstance(folder, sources.ImageFolderWithClasses):
            sampler.on_epoch = folder.seed_items

    def worker_generator(self, rank: int, stream: int) -> torch.Generator:
        """The generator that draws the workers' base seed: fixed by RNG_SEED (or the seed torch was given
        when RNG_SEED is None), different per rank and per loader (stream) so augmentations differ."""
        base = self.cfg.RNG_SEED if self.cfg.RNG_SEED is not None else torch.initial_seed()
        generator = torch.Generator()
        generator.manual_seed(int(np.random.SeedSequence([base % 2**64, rank, stream]).generate_state(1)[0]))
        return generator

    def fast_decode(self) -> bool:
        """Whether the split is an image folder read by the fast path (uint8 items, batch normalization)."""
        cfg = self.cfg
        return (cfg.TRAIN.IMAGE_DECODE == "fast" and not cfg.MODEL.DUMMY_INPUT
                and sources.source_kind(cfg[self.key].DATASET) == "folder")

    def normalized(self, loader: Any, device: torch.device, erase: float = 0.0) -> NormalizedBatches:
        stats = recipe_of(self.cfg).stats or transforms.IMAGENET_STATS
        return NormalizedBatches(loader, transforms.stats_for_channels(stats, self.cfg.MODEL.IN_CHANS), device, erase)


PIPELINE = LoaderPipeline  # the class of PIPELINES' 'loader' entry, as each side module names its own


# ---------------------------------------------------------------------------------------------
# Choosing the pipeline of a split
# ---------------------------------------------------------------------------------------------
# TRAIN.DATA_PIPELINE's names besides 'auto', each with the module whose PIPELINE is its class; 'auto'
# asks them in this order. A shard set's pipeline is chosen by the source's kind, not by a name.
PIPELINES: dict[str, str] = {
    "memory": "distribuuuu.data.memory",
    "loader": "distribuuuu.data.pipeline",
}
SHARD_PIPELINE = "distribuuuu.data.shards.loader"


def registered(name: str) -> type[Pipeline]:
    """The class of TRAIN.DATA_PIPELINE ``name``: the PIPELINE of its module, imported on first use."""
    return _pipeline_in(PIPELINES[name])


def _pipeline_in(module: str) -> type[Pipeline]:
    return importlib.import_module(module).PIPELINE


def pipeline_class(cfg: CfgNode, key: str) -> type[Pipeline]:
    """The pipeline that reads cfg[key]: the one TRAIN.DATA_PIPELINE forces, or the first that auto takes."""
    overriding = _overriding_pipeline(cfg, key)
    if overriding is not None:
        return overriding
    if cfg.TRAIN.DATA_PIPELINE != "auto":
        return registered(cfg.TRAIN.DATA_PIPELINE)
    return next(cls for cls in map(registered, PIPELINES) if cls.auto_takes(cfg, key))


def _overriding_pipeline(cfg: CfgNode, key: str) -> type[Pipeline] | None:
    """Checks TRAIN.DATA_PIPELINE (UserError when its pipeline cannot read cfg[key]); the pipeline that
    reads cfg[key] whatever it says (dummy input, a shard set), else None."""
    choice, names = cfg.TRAIN.DATA_PIPELINE, ("auto", *PIPELINES)
    if choice not in names:
        raise UserError(f"TRAIN.DATA_PIPELINE must be one of {', '.join(names)}, got {choice!r}")
    if cfg.MODEL.DUMMY_INPUT:
        return LoaderPipeline  # random tensors, whatever the choice
    refusal = registered(choice).refusal(cfg, key) if choice != "auto" else None
    if refusal is not None:
        raise UserError(refusal)
    if sources.source_kind(cfg[key].DATASET) == "shards":
        return _pipeline_in(SHARD_PIPELINE)  # read as a stream, whatever the choice
    return None


def data_pipeline(cfg: CfgNode, key: str) -> str:
    """The name of pipeline_class(cfg, key): 'memory', 'loader' or 'shards'."""
    return pipeline_class(cfg, key).name


# ---------------------------------------------------------------------------------------------
# One rank's loaders
# ---------------------------------------------------------------------------------------------
def build_train_loader(cfg: CfgNode, rank: int, world_size: int, device: torch.device) -> Any:
    """The TRAIN data (with TRAIN.VAL_SPLIT, the kept part only), augmented, in a resumable shuffle."""
    _log_train_data(cfg, rank)
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


def take_bad_image_count(loader: DataLoader) -> int:
    """Unreadable images this process's loader skipped since the last call (0 for tensor sources)."""
    take = getattr(loader.dataset, "take_bad_count", None)
    return take() if take else 0


def _log_train_data(cfg: CfgNode, rank: int) -> None:
    """What rank 0 says about the training data: unaugmented sources, unstated mean/std, the recipe."""
    _note_unaugmented(cfg, rank)
    if rank == 0:
        registry.warn_unstated_stats(cfg)
        log_recipe(cfg)


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

"""The input pipelines' seam: from the config to one rank's train / val
/ test loader: the Pipeline interface, the samplers every pipeline
shares, the per-sample dataset of a split, the default pipeline (a torch
DataLoader), and the one place that chooses a split's pipeline.

pipeline_class picks, once per split key, the Pipeline subclass that
reads cfg[key]:
  a shard set                  shards.loader.ShardPipeline (whatever TRAIN.DATA_PIPELINE says)
  an image folder with TRAIN.IMAGE_DECODE gpu (or auto, where CUDA is)
                               device_decode.DeviceDecodePipeline: a LoaderPipeline, its JPEGs decoded
                               on the training device
  TRAIN.DATA_PIPELINE memory   memory.MemoryPipeline (UserError for folders, shards, TRAIN.CROP_SCALE)
  TRAIN.DATA_PIPELINE loader   LoaderPipeline (here); MODEL.DUMMY_INPUT always
  TRAIN.DATA_PIPELINE auto     an image folder: LoaderPipeline (its files are read by the DataLoader's
                               workers); another source: the first class of PIPELINES whose
                               auto_takes(cfg, key) holds: the memory pipeline for mnist5k, CIFAR and
                               TensorSources that fit its budget, else the DataLoader
The side modules (memory.py, shards/loader.py, device_decode.py) import
this one, so PIPELINES names each class's module, imported on first use
(each ends in ``PIPELINE = TheClass``). Adding a pipeline: such a
module, one line in PIPELINES, and its name among the config's
TRAIN.DATA_PIPELINE choices (config/validate.py DATA_PIPELINES, which
load_config checks).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from yacs.config import CfgNode

from distribuuuu.data import balance, datasets, images, sources, transforms
from distribuuuu.data.batches import (
    NormalizedBatches,
    ReadableBatches,
    collate_readable,
    seed_worker,
    track_workers,
)
from distribuuuu.errors import UserError


# ---------------------------------------------------------------------------------------------
# The pipeline interface
# ---------------------------------------------------------------------------------------------
class Pipeline:
    """How cfg[key]'s data becomes batches on one rank. The contract
    every pipeline keeps (the engine relies on it): train_loader's
    loader has
      len(loader)                     the batches left in this epoch
      loader.dataset                  the per-sample data: len(), .classes (take_bad_count() where an
                                      image can be unreadable: take_bad_image_count)
      loader.sampler.set_epoch(e, s)  reshuffle for epoch e, skipping the s samples all ranks already
                                      consumed (a resume mid-epoch); the same order on every rank
      iteration                       (images, target): float images, normalized; int64 labels
    eval_loader's keeps len(), .dataset and the iteration, and is exact:
    each sample on one rank only. part: None (the whole split), or
    TRAIN.VAL_SPLIT's 'train' (kept) or 'val' (held-out) part.
    """

    name = ""  # the TRAIN.DATA_PIPELINE value that forces it (its key in PIPELINES)

    def __init__(self, cfg: CfgNode, key: str) -> None:
        self.cfg, self.key = cfg, key

    @classmethod
    def refusal(cls, cfg: CfgNode, key: str) -> str | None:
        """Why it cannot read cfg[key] when TRAIN.DATA_PIPELINE forces
        it (None: it can)."""
        return None

    @classmethod
    def auto_takes(cls, cfg: CfgNode, key: str) -> bool:
        """Whether TRAIN.DATA_PIPELINE auto reads cfg[key] (not an image
        folder) this way (asked in PIPELINES' order)."""
        return False

    def train_loader(
        self, part: str | None, rank: int, world_size: int, device: torch.device
    ) -> Any:
        raise NotImplementedError

    def eval_loader(
        self, part: str | None, rank: int, world_size: int, device: torch.device
    ) -> Any:
        raise NotImplementedError

    def sampler(self, dataset: Sized, train: bool, rank: int, world_size: int) -> Sampler:
        """Training: resumable even for one process, so set_epoch(epoch,
        start) always works; its seed is the engine's cfg's
        (engine.trainer.seeded_cfg draws one for RNG_SEED None), so the
        logged seed repeats the shuffle; a tool without one gets 0;
        TRAIN.CLASS_BALANCE sampler: its order is balance.BalancedDraw's
        (every class equally often), and every rank says (at INFO: rank
        0 prints) when the class sizes spread. Evaluation: exact."""
        if not train:
            return ShardedEvalSampler(dataset, num_replicas=world_size, rank=rank)
        balance.note_spread(self.cfg, dataset)  # the classes' sizes, when they spread widely
        draw = (
            balance.BalancedDraw(dataset)
            if self.cfg.TRAIN.CLASS_BALANCE == "sampler"
            else torch.randperm
        )
        return ResumableDistributedSampler(
            dataset,
            num_replicas=world_size,
            rank=rank,
            seed=self.cfg.RNG_SEED or 0,
            repeats=self.cfg.TRAIN.REPEATED_AUG,
            draw=draw,
        )


# ---------------------------------------------------------------------------------------------
# The samplers every pipeline shares: which samples each rank reads, in
# which order
# ---------------------------------------------------------------------------------------------
class ShardedEvalSampler(Sampler[int]):
    """Rank r of W gets the indices r, r+W, r+2W, ...: every sample
    exactly once over all ranks.

    Written by hand because DistributedSampler pads every rank to the
    same length by repeating samples (or drops them with drop_last), so
    metrics summed over ranks would count some images twice (or not at
    all). Here ranks may differ in length by one, and a rank may get
    nothing.
    """

    def __init__(self, dataset: Sized, num_replicas: int, rank: int) -> None:
        _check_shard(num_replicas, rank)
        self.indices = range(rank, len(dataset), num_replicas)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class ResumableDistributedSampler(Sampler[int]):
    """One seeded permutation per epoch, the same on every rank, sharded
    over ranks, able to start part-way.

    The position is counted in samples (all ranks together), so a
    resume, even with another world size, goes on with the next unseen
    sample; the fewer than W left-over samples are dropped, never
    repeated. ``repeats`` k > 1 is repeated augmentation: the k copies
    of an index land on different ranks. ``draw`` makes the epoch's
    order: a permutation, or TRAIN.CLASS_BALANCE sampler's draw
    (balance.BalancedDraw). Why not torch's DistributedSampler:
    docs/reliability.md; repeated augmentation: docs/recipes.md.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int,
        rank: int,
        seed: int = 0,
        repeats: int = 1,
        draw: Callable[..., torch.Tensor] = torch.randperm,
    ) -> None:
        _check_shard(num_replicas, rank, repeats)
        self.size, self.num_replicas, self.rank, self.seed = len(dataset), num_replicas, rank, seed
        self.repeats, self.draw = (
            repeats,
            draw,
        )  # draw(size, generator=): the epoch's indices, all ranks' together
        self.epoch, self.start = 0, 0
        self.on_epoch: Callable[[int, int], None] | None = (
            None  # called with (seed, epoch) by set_epoch
        )

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Shuffle for ``epoch``, skipping the first ``start`` samples
        of its permutation."""
        if not 0 <= start <= self.size:
            raise ValueError(f"start {start} is not in [0, {self.size}]")
        self.epoch, self.start = epoch, start
        if self.on_epoch is not None:
            self.on_epoch(self.seed, epoch)

    def __iter__(self) -> Iterator[int]:
        order = self.draw(
            self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)
        )
        if (
            self.repeats > 1
        ):  # each index written `repeats` times in a row: the copies land on different ranks
            order = order.repeat_interleave(self.repeats)[: self.size]
        rest = order[self.start :]
        usable = len(rest) // self.num_replicas * self.num_replicas
        return iter(rest[self.rank : usable : self.num_replicas].tolist())

    def __len__(self) -> int:
        return (self.size - self.start) // self.num_replicas


def _check_shard(num_replicas: int, rank: int, repeats: int = 1) -> None:
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")


# ---------------------------------------------------------------------------------------------
# The per-sample dataset of a split, which every pipeline starts from
# ---------------------------------------------------------------------------------------------
def build_dataset(cfg: CfgNode, train: bool) -> Dataset:
    """The whole TRAIN (train=True, augmented) or TEST dataset, with its
    per-sample transforms: items are (float32 [C, H, W] normalized, int
    label), one at a time."""
    return build_split_dataset(cfg, "TRAIN" if train else "TEST", train, batched=False)


def build_split_dataset(cfg: CfgNode, key: str, train: bool, batched: bool) -> Dataset:
    """The data of cfg[key], with the training transforms (train) or the
    eval ones: an image folder's items are listed here and decoded one
    at a time (images.FolderDataset); other sources: _source_dataset.
    batched=True (TRAIN.IMAGE_DECODE fast; gpu and auto start from it:
    device_decode.py): folder items are uint8 crops
    (images.FastTrainDecode / FastEvalDecode), normalized (and erased)
    per batch on the device."""
    if cfg.MODEL.DUMMY_INPUT or sources.source_kind(cfg[key].DATASET) not in ("folder", "shards"):
        return _source_dataset(cfg, key, train)
    chans, size, recipe = (
        cfg.MODEL.IN_CHANS,
        cfg.TRAIN.IM_SIZE,
        transforms.recipe_of(cfg),
    )  # val: TRAIN.IM_SIZE too
    sources.require_image_chans(cfg, key)
    listing = images.require_no_loop(images.list_split(*sources.split_classes(cfg, key)), key)
    policy, mode = transforms.augment_policy(cfg) if train else None, "L" if chans == 1 else "RGB"
    if (
        batched
    ):  # decode + geometry in the dataset's loader, so that its errors meet the bad-image handling
        load: Callable = (
            images.FastTrainDecode(size, mode, recipe)
            if train
            else images.FastEvalDecode(
                recipe.eval_resize(size, cfg.TEST.IM_SIZE), size, mode, recipe
            )
        )
        return images.FolderDataset(
            listing, load, policy, cfg.TRAIN.BAD_IMAGES, replace_bad=train
        )  # erased per batch
    tf = transforms.folder_transform(
        train,
        size,
        cfg.TEST.IM_SIZE,
        chans,
        policy=policy,
        erase=cfg.TRAIN.RANDOM_ERASE if train else 0.0,
        recipe=recipe,
    )
    return images.FolderDataset(
        listing,
        functools.partial(images.open_image, mode=mode),
        tf,
        cfg.TRAIN.BAD_IMAGES,
        replace_bad=train,
    )


def _source_dataset(cfg: CfgNode, key: str, train: bool) -> Dataset:
    """The data of a source that is not a folder of image files:
    MODEL.DUMMY_INPUT's random tensors, synthetic data or a user's
    Dataset (ready items, never transformed), or the uint8 images of
    mnist5k, CIFAR or a registered TensorSource with the small-image
    recipe (pad-and-crop, transforms.small_image_transform)."""
    chans, size = cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE
    if cfg.MODEL.DUMMY_INPUT:
        return datasets.RandomTensorDataset(
            cfg[key].SYNTHETIC_SAMPLES,
            cfg.MODEL.NUM_CLASSES,
            (chans, size, size),
            seed=0 if key == "TRAIN" else 1,
        )
    data = sources.registered_data(cfg, key)
    if data is not None and not isinstance(data, datasets.TensorSource):
        return data
    src, recipe = sources.tensor_source(cfg, key, data), transforms.recipe_of(cfg)
    tf = transforms.small_image_transform(
        train,
        size,
        src.images.shape[-1],
        pad=src.pad,
        flip=src.flip,
        stats=transforms.stats_for_channels(recipe.stats or src.stats, chans),
        policy=transforms.augment_policy(cfg) if train else None,
        erase=cfg.TRAIN.RANDOM_ERASE if train else 0.0,
        recipe=recipe,
    )
    return datasets.TensorImageDataset(src.images, src.targets, src.classes, tf)


# ---------------------------------------------------------------------------------------------
# The default pipeline: a torch DataLoader
# ---------------------------------------------------------------------------------------------
class LoaderPipeline(Pipeline):
    """A DataLoader with worker processes over the split's per-sample
    items (TRAIN.DATA_PIPELINE loader; what auto falls back to): image
    folders, synthetic data, a registered Dataset, MODEL.DUMMY_INPUT,
    and the tensor sources the in-memory pipeline does not take.
    TRAIN.IMAGE_DECODE fast: a folder item is a uint8 crop decoded in
    the worker, each batch normalized on the device
    (batches.NormalizedBatches). An unreadable image is replaced by the
    next readable one in training (every rank keeps its batch size); in
    evaluation it is left out of its batch (collate_readable): n counts
    distinct readable images.
    """

    name = "loader"

    @classmethod
    def auto_takes(cls, cfg: Any, key: str) -> bool:
        return True  # reads every source: the last resort of 'auto'

    def train_loader(
        self, part: str | None, rank: int, world_size: int, device: torch.device
    ) -> Any:
        cfg = self.cfg
        dataset, sampler, fast = self.items(True, part, rank, world_size)
        # An image folder's items are seeded by (seed, epoch, index), so
        # that a resumed epoch redraws the same augmentations; not with
        # TRAIN.REPEATED_AUG > 1, whose copies of an index need their
        # own draws.
        folder = getattr(dataset, "dataset", dataset)  # (a VAL_SPLIT part's whole folder)
        if cfg.TRAIN.REPEATED_AUG == 1 and isinstance(folder, images.FolderDataset):
            sampler.on_epoch = folder.seed_items
        # Drop the last partial batch (a BatchNorm batch of 1 fails)
        # unless that would leave nothing.
        drop_last = len(sampler) >= cfg.TRAIN.BATCH_SIZE
        loader = self.data_loader(
            dataset, sampler, cfg.TRAIN.BATCH_SIZE, drop_last, rank, device, stream=0
        )
        erase = cfg.TRAIN.RANDOM_ERASE
        return (
            NormalizedBatches(loader, transforms.image_stats(cfg), device, erase)
            if fast
            else loader
        )

    def eval_loader(
        self, part: str | None, rank: int, world_size: int, device: torch.device
    ) -> Any:
        dataset, sampler, fast = self.items(False, part, rank, world_size)
        loader = ReadableBatches(
            self.data_loader(
                dataset,
                sampler,
                self.cfg.TEST.BATCH_SIZE,
                False,
                rank,
                device,
                stream=1,
                collate_fn=collate_readable,
            )
        )
        return (
            NormalizedBatches(loader, transforms.image_stats(self.cfg), device) if fast else loader
        )

    def items(
        self, train: bool, part: str | None, rank: int, world_size: int
    ) -> tuple[Dataset, Sampler, bool]:
        """(the per-sample dataset of the split or its part, its
        sampler, whether it is an image folder read by the fast path:
        uint8 items, normalized per batch)."""
        cfg = self.cfg
        fast = (
            cfg.TRAIN.IMAGE_DECODE != "pil"
            and not cfg.MODEL.DUMMY_INPUT
            and sources.source_kind(cfg[self.key].DATASET) == "folder"
        )
        dataset = build_split_dataset(cfg, self.key, train, batched=fast)
        if part is not None:
            dataset = datasets.part_of(cfg, dataset, part)
        return dataset, self.sampler(dataset, train, rank, world_size), fast

    def data_loader(
        self,
        dataset: Dataset,
        sampler: Sampler,
        batch_size: int,
        drop_last: bool,
        rank: int,
        device: torch.device,
        stream: int,
        collate_fn: Callable | None = None,
    ) -> DataLoader:
        """TRAIN.WORKERS processes kept alive between epochs; pinned
        batches only for a GPU (docs/performance.md). The workers' base
        seed is fixed by RNG_SEED (or the seed torch was given when it
        is None), different per rank and per loader (stream), so that
        their augmentations differ."""
        cfg, workers = self.cfg, self.cfg.TRAIN.WORKERS
        base = cfg.RNG_SEED if cfg.RNG_SEED is not None else torch.initial_seed()
        seed = int(np.random.SeedSequence([base % 2**64, rank, stream]).generate_state(1)[0])
        return track_workers(
            DataLoader(
                dataset,
                batch_size=batch_size,
                sampler=sampler,
                drop_last=drop_last,
                num_workers=workers,
                persistent_workers=workers > 0,
                pin_memory=cfg.TRAIN.PIN_MEMORY and device.type == "cuda",
                worker_init_fn=seed_worker,
                generator=torch.Generator().manual_seed(seed),
                collate_fn=collate_fn,
            )
        )


PIPELINE = (
    LoaderPipeline  # the class of PIPELINES' 'loader' entry, as each side module names its own
)


# ---------------------------------------------------------------------------------------------
# Choosing the pipeline of a split
# ---------------------------------------------------------------------------------------------
# TRAIN.DATA_PIPELINE's names besides 'auto', each with the module whose
# PIPELINE is its class; 'auto' asks them in this order. A shard set's
# pipeline is chosen by the source's kind, not by a name.
PIPELINES: dict[str, str] = {
    "memory": "distribuuuu.data.memory",
    "loader": "distribuuuu.data.pipeline",
}
SHARD_PIPELINE = "distribuuuu.data.shards.loader"
DEVICE_DECODE = "distribuuuu.data.device_decode"  # an image folder's JPEGs decoded on the device


def registered(name: str) -> type[Pipeline]:
    """The class of TRAIN.DATA_PIPELINE ``name``: the PIPELINE of its
    module, imported on first use."""
    return importlib.import_module(PIPELINES[name]).PIPELINE


def pipeline_class(cfg: CfgNode, key: str) -> type[Pipeline]:
    """The pipeline that reads cfg[key] (module docstring); UserError
    when TRAIN.DATA_PIPELINE forces one that cannot read it."""
    choice, names = cfg.TRAIN.DATA_PIPELINE, ("auto", *PIPELINES)
    if choice not in names:
        raise UserError(f"TRAIN.DATA_PIPELINE must be one of {', '.join(names)}, got {choice!r}")
    if cfg.MODEL.DUMMY_INPUT:
        return LoaderPipeline  # random tensors, whatever the choice
    refusal = registered(choice).refusal(cfg, key) if choice != "auto" else None
    if refusal is not None:
        raise UserError(refusal)
    kind = sources.source_kind(cfg[key].DATASET)
    if kind == "shards":
        return importlib.import_module(
            SHARD_PIPELINE
        ).PIPELINE  # read as a stream, whatever the choice
    decode = cfg.TRAIN.IMAGE_DECODE  # auto may decode on the device only where CUDA is
    if kind == "folder" and (decode == "gpu" or decode == "auto" and torch.cuda.is_available()):
        return importlib.import_module(DEVICE_DECODE).PIPELINE
    if choice != "auto":
        return registered(choice)
    if kind == "folder":
        return LoaderPipeline
    return next(cls for cls in map(registered, PIPELINES) if cls.auto_takes(cfg, key))


def data_pipeline(cfg: CfgNode, key: str) -> str:
    """The name of pipeline_class(cfg, key): 'memory', 'loader' or
    'shards'."""
    return pipeline_class(cfg, key).name


# ---------------------------------------------------------------------------------------------
# One rank's loaders
# ---------------------------------------------------------------------------------------------
def build_train_loader(cfg: CfgNode, rank: int, world_size: int, device: torch.device) -> Any:
    """The TRAIN data (with TRAIN.VAL_SPLIT, the kept part only),
    augmented, in a resumable shuffle. Rank 0 says what the recipe is,
    and what ready-made items (dummy input, a registered Dataset) lack."""
    if rank == 0:
        if cfg.MODEL.DUMMY_INPUT or sources.get_source(cfg.TRAIN.DATASET) is not None:
            sources.note_ready_items(cfg)
        transforms.log_recipe(cfg)
    pipeline = pipeline_class(cfg, "TRAIN")(cfg, "TRAIN")
    return pipeline.train_loader("train" if cfg.TRAIN.VAL_SPLIT else None, rank, world_size, device)


def build_val_loader(cfg: CfgNode, rank: int, world_size: int, device: torch.device) -> Any:
    """The validation data: with TRAIN.VAL_SPLIT > 0 the part of the
    TRAIN data held out from training, with the eval transforms; else
    the TEST data (as build_test_loader). Sharded exactly."""
    if not cfg.TRAIN.VAL_SPLIT:
        return build_test_loader(cfg, rank, world_size, device)
    return pipeline_class(cfg, "TRAIN")(cfg, "TRAIN").eval_loader("val", rank, world_size, device)


def build_test_loader(cfg: CfgNode, rank: int, world_size: int, device: torch.device) -> Any:
    """The TEST data, whatever TRAIN.VAL_SPLIT is. Sharded exactly."""
    return pipeline_class(cfg, "TEST")(cfg, "TEST").eval_loader(None, rank, world_size, device)


def take_bad_image_count(loader: DataLoader) -> int:
    """Unreadable images this process's loader skipped since the last
    call (0 for tensor sources)."""
    take = getattr(loader.dataset, "take_bad_count", None)
    return take() if take else 0


def unreadable_so_far(loader: Any, met: list[int]) -> list[int]:
    """Collective: met (the epoch's unreadable training samples until
    now, as a checkpoint carries them) and those the loader found on any
    rank since the last call, each once: an image folder's sample
    indices, merged over the ranks (a file drawn on two ranks,
    TRAIN.REPEATED_AUG, or also tried as a stand-in, is one); a shard
    set reads each record once an epoch: one -1 per unreadable record."""
    from distribuuuu.launch import comm

    folder = getattr(
        loader.dataset, "dataset", loader.dataset
    )  # (a TRAIN.VAL_SPLIT part: its whole folder)
    take = getattr(folder, "take_unreadable", None)
    found = [met, *comm.all_gather_object(take() if take else [-1] * take_bad_image_count(loader))]
    return sorted({i for part in found for i in part if i >= 0}) + [-1] * sum(
        part.count(-1) for part in found
    )


def shard_plan(loader: Any) -> dict[str, Any] | None:
    """What decides the batches of a shard set's epoch
    (shards.reader.describe_plan), kept in checkpoints; None for other
    data."""
    plan = getattr(loader, "shard_plan", None)
    return plan() if plan is not None else None


def require_same_plan(loader: Any, samples_in_epoch: int, ckpt: dict[str, Any], path: str) -> None:
    """A mid-epoch position on shards means particular batches: refuse
    to resume it under another plan."""
    now, then = shard_plan(loader), ckpt.get("shard_plan")
    if now is None or samples_in_epoch == 0 or then == now:
        return
    changed = (
        ", ".join(f"{k} {then.get(k)} -> {v}" for k, v in now.items() if then.get(k) != v)
        if then
        else "unknown"
    )
    raise UserError(
        f"{path} stopped {samples_in_epoch} samples into an epoch of a shard set, whose "
        "batches depend on the world size, TRAIN.WORKERS, BATCH_SIZE, ACCUM_STEPS and "
        "SHARD_SHUFFLE "
        f"({changed}); resume with the values it was written with, then change them at an epoch end"
    )

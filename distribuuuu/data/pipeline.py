"""The seam of the input pipelines: one Pipeline subclass per way of reading a split.

loaders.pipeline_class picks the class for a split key once (TRAIN.DATA_PIPELINE, the source's kind,
the memory budget); loaders.build_train_loader / build_val_loader / build_test_loader then call the
chosen pipeline's train_loader or eval_loader. The pipelines:
  memory.MemoryPipeline       the whole split as one tensor on the device (mnist5k, CIFAR, TensorSources)
  dataloader.LoaderPipeline   a torch DataLoader over per-sample items (folders, synthetic, Datasets)
  shards.loader.ShardPipeline a shard set, read as a stream (every sample once per epoch)
Adding one is a subclass and one line in loaders.PIPELINES (and its name in config/validate.py).

The samplers here are the pipelines' shared part: a resumable shuffled one for training (it restarts
mid-epoch at the next unseen sample) and an exact one for evaluation (every sample once over all ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler
from yacs.config import CfgNode


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
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
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
    """One seeded permutation per epoch, sharded over ranks, able to start part-way through.

    Every rank draws the same permutation (seed + epoch), skips the ``start`` samples that all
    ranks together already consumed this epoch, and takes every W-th of the rest. Written by hand
    because torch's DistributedSampler cannot start mid-epoch, and pads with repeated samples
    where this one drops the (fewer than W) left-over samples, so an epoch never counts a sample
    twice. Because the position is counted in samples, not batches, a run can resume with another
    world size and continue with the very next unseen samples.

    ``repeats`` k > 1 is repeated augmentation (Hoffer et al., 2020; DeiT uses k = 3): each index of
    the permutation is written k times in a row and the first len(dataset) of that order make the
    epoch, so an epoch keeps its length but holds about len(dataset) / k distinct images. Every
    W-th position goes to a rank, so the k copies of an index (k consecutive positions) land on k
    different ranks when k <= W, each with its own random augmentation, in the same global step.
    With fewer ranks than k, some copies share a rank (with 1 process all k come in one batch),
    where the per-image augmentation still differs.
    """

    def __init__(self, dataset: Sized, num_replicas: int, rank: int, seed: int = 0, repeats: int = 1) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
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
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=g)
        if self.repeats > 1:  # the copies of an index stay adjacent, hence on different ranks
            order = order.repeat_interleave(self.repeats)[:self.size]
        rest = order[self.start:]
        usable = len(rest) // self.num_replicas * self.num_replicas
        return iter(rest[self.rank:usable:self.num_replicas].tolist())

    def __len__(self) -> int:
        return (self.size - self.start) // self.num_replicas


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

    name = ""  # the TRAIN.DATA_PIPELINE value that forces it (its key in loaders.PIPELINES)

    def __init__(self, cfg: CfgNode, key: str) -> None:
        self.cfg, self.key = cfg, key

    @classmethod
    def refusal(cls, cfg: CfgNode, key: str) -> str | None:
        """Why it cannot read cfg[key] when TRAIN.DATA_PIPELINE forces it (None: it can)."""
        return None

    @classmethod
    def auto_takes(cls, cfg: CfgNode, key: str) -> bool:
        """Whether TRAIN.DATA_PIPELINE auto reads cfg[key] this way (asked in loaders.PIPELINES' order)."""
        return False

    def train_loader(self, part: str | None, rank: int, world_size: int, device: torch.device) -> Any:
        raise NotImplementedError

    def eval_loader(self, part: str | None, rank: int, world_size: int, device: torch.device) -> Any:
        raise NotImplementedError

    def seed(self) -> int:
        """The shuffle's seed: the engine's cfg holds the run's (engine.state.seeded_cfg draws one for
        RNG_SEED None), so the logged seed repeats the shuffle; a tool without one gets 0."""
        return self.cfg.RNG_SEED if self.cfg.RNG_SEED is not None else 0

    def sampler(self, dataset: Sized, train: bool, rank: int, world_size: int) -> Sampler:
        """Training: a ResumableDistributedSampler even for one process (set_epoch(epoch, start) always
        works); the same seed on every rank gives disjoint shards. Evaluation: a ShardedEvalSampler."""
        if not train:
            return ShardedEvalSampler(dataset, num_replicas=world_size, rank=rank)
        return ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=self.seed(),
                                           repeats=self.cfg.TRAIN.REPEATED_AUG)

"""Samplers: a resumable shuffled sampler for training and an exact one for evaluation."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized

import torch
from torch.utils.data import Sampler


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

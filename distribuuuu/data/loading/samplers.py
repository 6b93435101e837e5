"""Which samples each rank reads, in which order: the samplers every
pipeline shares (training: one resumable shuffle for all ranks;
evaluation: each sample on exactly one rank)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized

import torch
from torch.utils.data import Sampler


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

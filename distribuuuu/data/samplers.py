"""Samplers: the exact evaluation sampler (training uses torch's DistributedSampler as is)."""

from __future__ import annotations

from typing import Iterator, Sized

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

"""The plan of one epoch over a shard set: which samples each rank and
loader worker reads, in which batches. Pure arithmetic on the index's
per-shard counts; nothing is read here.

1. The shards are put in a new order each epoch (seed + epoch) and read
   as one stream of N samples.
2. Rank r of W takes the contiguous range [r*N//W, (r+1)*N//W) of that
   stream: the ranges differ by at most one sample and cover the stream
   exactly once, whatever N, W and the shard count are (a sample-level
   split: no rank waits for a shard that another rank holds, none is
   left out).
3. Training: every rank runs the same number of steps (a step is a
   collective), the largest range over BATCH_SIZE rounded up to whole
   optimizer steps; each rank cuts its range into that many batches
   whose sizes differ by at most one, so no step gets a tiny batch and
   nothing is dropped. Evaluation: ceil(range / TEST.BATCH_SIZE) batches
   per rank; ranks may differ (no collective per batch).
4. Loader worker w of K yields the rank's batches w, w+K, w+2K, ...: the
   round-robin order in which a DataLoader collects its workers' items.
   Each worker reads one contiguous part of the rank's range (worker 0's
   samples first, then worker 1's, ...), so it streams its shards front
   to back.
5. Inside a worker's part, blocks of TRAIN.SHARD_SHUFFLE consecutive
   samples are read whole and yielded in a random order seeded by (seed,
   epoch, the block's position): a shuffle of samples, not only of
   shards, that a resumed epoch can seek into (a shuffle buffer's state
   could only be rebuilt by reading everything before it again).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class WorkerPlan:
    """One loader worker's share of a rank's epoch: its first stream
    position and its batches."""

    begin: int  # stream position of the worker's first sample
    batches: tuple[tuple[int, int], ...]  # (batch index in the rank's epoch, batch size), in order

    @property
    def num_samples(self) -> int:
        return sum(size for _, size in self.batches)

    def samples_before(self, step: int) -> int:
        """Samples of this worker's batches with index < step (what a
        resumed epoch has consumed)."""
        return sum(size for j, size in self.batches if j < step)


def shard_order(num_shards: int, seed: int, epoch: int) -> np.ndarray:
    """The order the shards are streamed in this epoch (the same on
    every rank)."""
    return np.random.default_rng([seed, epoch]).permutation(num_shards)


def rank_range(num_samples: int, world_size: int, rank: int) -> tuple[int, int]:
    """[begin, end) of the stream that rank reads."""
    return rank * num_samples // world_size, (rank + 1) * num_samples // world_size


def even_sizes(count: int, parts: int) -> list[int]:
    """count cut into `parts` sizes that differ by at most one, larger
    first."""
    return [count // parts + (1 if i < count % parts else 0) for i in range(parts)]


def train_steps(num_samples: int, world_size: int, batch_size: int, accum: int) -> int:
    """Steps (micro-batches) per epoch on every rank: the largest range
    in batches, in whole optimizer steps."""
    largest = -(-num_samples // world_size)
    steps = -(-largest // batch_size)
    return -(-steps // accum) * accum


def smallest_train_batch(num_samples: int, world_size: int, batch_size: int, accum: int) -> int:
    """The smallest training batch of any rank: 0 means some step would
    have no sample there (BATCH_SIZE 1 with ranges of unequal size, or
    ACCUM_STEPS rounding up a short epoch)."""
    return num_samples // world_size // train_steps(num_samples, world_size, batch_size, accum)


def rank_batches(
    num_samples: int, world_size: int, rank: int, batch_size: int, accum: int, train: bool
) -> tuple[int, list[int]]:
    """(first stream position, batch sizes) of rank's epoch; see the
    module docstring (3)."""
    begin, end = rank_range(num_samples, world_size, rank)
    count = end - begin
    steps = (
        train_steps(num_samples, world_size, batch_size, accum)
        if train
        else -(-count // batch_size)
    )
    return begin, even_sizes(count, steps) if steps else []


def worker_plans(begin: int, sizes: list[int], workers: int) -> list[WorkerPlan]:
    """Each loader worker's part of a rank's epoch (workers:
    TRAIN.WORKERS, 0 meaning the one main process)."""
    k = max(1, workers)
    plans, position = [], begin
    for w in range(k):
        batches = tuple((j, sizes[j]) for j in range(w, len(sizes), k))
        plans.append(WorkerPlan(position, batches))
        position += sum(size for _, size in batches)
    return plans


def locate(counts_in_order: np.ndarray, position: int) -> tuple[int, int]:
    """(index into the epoch's shard order, sample offset inside that
    shard) of a stream position."""
    ends = np.cumsum(counts_in_order)
    i = int(np.searchsorted(ends, position, side="right"))
    return i, position - (int(ends[i - 1]) if i else 0)


def block_order(seed: int, epoch: int, block_begin: int, length: int, shuffle: bool) -> np.ndarray:
    """The order a block of `length` samples starting at stream position
    block_begin is yielded in."""
    if not shuffle:
        return np.arange(length)
    return np.random.default_rng([seed, epoch, block_begin]).permutation(length)

"""ShardDataset: one rank's batches of a shard set, made by its
DataLoader workers (plan.py says which samples and in which order;
tar.py reads them).

An IterableDataset that yields whole batches (the DataLoader runs with
batch_size=None), because the plan decides each batch's size and
members: worker w of K makes the rank's batches w, w+K, ..., and the
DataLoader collects its workers' items round-robin, which is exactly
batch order 0, 1, 2, ... Written here rather than with webdataset's
pipeline: exactly-once splitting with equal step counts, a resumable
shuffle and per-batch seeding need the whole epoch's plan, which its
per-worker shard lists and shuffle buffer cannot give
(docs/data-at-scale.md).

Reproducible: the random crops and flips of batch j depend only on
(seed, epoch, rank, j), not on what the worker process did before, so a
resumed epoch augments every batch as the straight run did.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info

from distribuuuu.data.decoding.cpu import DECODE_ERRORS
from distribuuuu.data.loading.items import UnreadableImage
from distribuuuu.data.shards import plan, tar
from distribuuuu.data.shards.index import ShardSet

log = logging.getLogger("distribuuuu")

Decode = Callable[[bytes], torch.Tensor]


class ShardDataset(IterableDataset):
    """Rank `rank` of `world_size`'s batches of a shard set; see the
    module docstring.

    Acts as its own sampler for the engine: set_epoch(epoch, start)
    (start: samples all ranks consumed this epoch, a multiple of
    batch_size x world_size), and `seed`. len() is the split's sample
    count.
    """

    def __init__(
        self,
        shard_set: ShardSet,
        decode: Decode,
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        accum: int,
        workers: int,
        train: bool,
        seed: int,
        shuffle_block: int,
        bad_images: str,
        label_map: list[int] | None = None,
        collate_images: Callable[[list], Any] = default_collate,
    ) -> None:
        self.shard_set, self.decode, self.classes = shard_set, decode, shard_set.classes
        self.fields = shard_set.fields  # which members are the image and the label (fields.py)
        # a batch's decoded items -> its images (the device decode's: a list)
        self.collate_images = collate_images
        self.rank, self.world_size = rank, world_size
        self.batch_size, self.accum = batch_size, accum
        self.workers, self.train, self.shuffle_block = workers, train, max(1, shuffle_block)
        self.bad_images, self.label_map = bad_images, label_map
        # (seed, epoch, start step) in shared memory: persistent
        # workers, started once, read the epoch the engine sets before
        # each one (a plain attribute would stay as it was when they
        # started).
        self._position = multiprocessing.Array("q", [seed, 0, 0], lock=False)
        self.counts = np.array([s.num_samples for s in shard_set.shards])
        # Shared with the worker processes, which inherit it when they
        # start (as loading.items.ImageDataset's).
        self.unreadable = multiprocessing.Value("i", 0)

    seed = property(
        lambda self: self._position[0], lambda self, v: self._position.__setitem__(0, v)
    )
    epoch = property(lambda self: self._position[1])
    start_step = property(lambda self: self._position[2])

    def __len__(self) -> int:
        return int(self.counts.sum())

    def steps(self) -> int:
        """Batches of this rank per epoch (training: the same on every
        rank)."""
        return len(
            plan.rank_batches(
                len(self), self.world_size, self.rank, self.batch_size, self.accum, self.train
            )[1]
        )

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        micro = self.batch_size * self.world_size
        if start % micro:
            raise ValueError(f"start {start} is not a whole number of steps of {micro} samples")
        self._position[1], self._position[2] = epoch, start // micro

    def take_unreadable(self) -> list[int]:
        """-1 for each record found unreadable since the last call (a
        record has no index of its own)."""
        with self.unreadable.get_lock():
            count, self.unreadable.value = self.unreadable.value, 0
        return [-1] * count

    # -- reading
    # ---------------------------------------------------------------------------------
    def _my_plan(self) -> plan.WorkerPlan:
        begin, sizes = plan.rank_batches(
            len(self), self.world_size, self.rank, self.batch_size, self.accum, self.train
        )
        info = get_worker_info()
        plans = plan.worker_plans(begin, sizes, self.workers)
        if (info.num_workers if info else 1) != len(plans):
            raise RuntimeError(
                f"planned for {self.workers} loader workers, read by "
                f"{info.num_workers if info else 'the main process alone'}"
            )
        # The DataLoader asks its workers round-robin from worker 0, and
        # the first batch of a resumed epoch (start_step) belongs to
        # plan part start_step mod K: worker i plays part (i + start)
        # mod K.
        return plans[((info.id if info else 0) + self.start_step) % len(plans)]

    def _stream(self, position: int) -> Iterator[tar.Sample]:
        """The epoch's stream of samples from `position` on, shard after
        shard."""
        order = plan.shard_order(len(self.counts), self.seed, self.epoch)
        i, offset = plan.locate(self.counts[order], position)
        for k in order[i:]:
            shard, got = self.shard_set.shards[k], offset
            records = tar.samples(shard.path, skip=offset)
            for sample in records:
                got += 1
                if got == shard.num_samples and next(records, None) is not None:
                    # The index's last sample must end the shard: read
                    # one ahead, or the extra samples of the epoch's
                    # last shard would go unnoticed (the plan stops
                    # pulling).
                    got += 1 + sum(1 for _ in records)
                    break
                yield sample
                if got == shard.num_samples:
                    break
            if got != shard.num_samples:
                raise tar.ShardError(
                    f"shard {shard.path} holds {got} samples, but its index "
                    f"{self.shard_set.index_path} records {shard.num_samples}; re-run `distribuuuu "
                    "data shard`"
                )
            offset = 0

    def _ordered(self, part: plan.WorkerPlan, skip: int) -> Iterator[tar.Sample]:
        """The worker's samples in the order it batches them (block
        shuffle), after the first `skip`."""
        k, end = self.shuffle_block, part.begin + part.num_samples
        first = part.begin + skip // k * k
        stream = self._stream(first)
        for block in range(first, end, k):
            length = min(k, end - block)
            samples = [next(stream) for _ in range(length)]
            order = plan.block_order(self.seed, self.epoch, block, length, self.train)
            drop = skip % k if block == first else 0
            for i in order[drop:]:
                yield samples[i]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        part = self._my_plan()
        samples = self._ordered(part, part.samples_before(self.start_step))
        for j, size in part.batches:
            if j < self.start_step:
                continue
            batch = [next(samples) for _ in range(size)]
            made = self._make_batch(j, batch)
            if made is not None:
                yield made

    def _make_batch(
        self, j: int, batch: list[tar.Sample]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Decode a batch with its own random stream; unreadable records
        are replaced (training) or left out."""
        seed = int(
            np.random.SeedSequence([self.seed, self.epoch, self.rank, j]).generate_state(1)[0]
        )
        with torch.random.fork_rng(devices=[]):
            # the crops draw from it (torch.manual_seed seeds every device)
            torch.default_generator.manual_seed(seed)
            items = [self._item(sample) for sample in batch]
        good = [item for item in items if item is not None]
        if not good:
            if self.train:
                raise UnreadableImage(
                    f"every record of a batch of {len(batch)} is unreadable (first key "
                    f"{batch[0][0]!r}); are these image shards?"
                )
            return None
        if self.train:  # every rank keeps its batch size: a readable record of the batch stands in
            good += [good[i % len(good)] for i in range(len(items) - len(good))]
        # default_collate (not torch.stack) builds the batch in a
        # worker's shared memory, saving a copy
        return self.collate_images([g[0] for g in good]), torch.tensor([g[1] for g in good])

    def _item(self, sample: tar.Sample) -> tuple[torch.Tensor, int] | None:
        key, fields = sample
        try:
            image, label = self.fields.read(fields)  # MissingField: a ValueError
            return self.decode(image), self.label_map[label] if self.label_map else label
        except DECODE_ERRORS as e:
            self.note_unreadable(f"record {key!r}", e)
            return None

    def note_unreadable(self, record: str, error: Exception) -> None:
        """UnreadableImage under TRAIN.BAD_IMAGES fail; else a warning
        naming the record, and one more counted."""
        where = f"{record} of {self.shard_set.index_path}"
        if self.bad_images == "fail":
            raise UnreadableImage(
                f"cannot decode {where} ({type(error).__name__}: {error}); fix the shard, or set "
                "TRAIN.BAD_IMAGES skip to skip unreadable records"
            ) from None
        log.warning("skipping unreadable %s (%s: %s)", where, type(error).__name__, error)
        with self.unreadable.get_lock():
            self.unreadable.value += 1


def describe_plan(dataset: ShardDataset) -> dict[str, Any]:
    """What a resumed epoch must find unchanged: mid-epoch positions
    mean these batches."""
    return {
        "world_size": dataset.world_size,
        "workers": max(1, dataset.workers),
        "batch_size": dataset.batch_size,
        "accum": dataset.accum,
        "shuffle_block": dataset.shuffle_block,
    }

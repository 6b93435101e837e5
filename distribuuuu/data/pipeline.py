"""The seam of the input pipelines: one Pipeline subclass per way of reading a split.

loaders.pipeline_class picks the class for a split key once (TRAIN.DATA_PIPELINE, the source's kind,
the memory budget); loaders.build_train_loader / build_val_loader / build_test_loader then call the
chosen pipeline's train_loader or eval_loader. The pipelines:
  memory.MemoryPipeline       the whole split as one tensor on the device (mnist5k, CIFAR, TensorSources)
  dataloader.LoaderPipeline   a torch DataLoader over per-sample items (folders, synthetic, Datasets)
  shards.loader.ShardPipeline a shard set, read as a stream (every sample once per epoch)
Adding one is a subclass here and one line in loaders.PIPELINES.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

import torch
from torch.utils.data import Sampler
from yacs.config import CfgNode

from distribuuuu.data.samplers import ResumableDistributedSampler, ShardedEvalSampler


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

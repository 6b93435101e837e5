"""ZeRO stage 1: DDP's replicas, with the optimizer state sharded over
the ranks.

Each rank keeps the optimizer state of its share of the parameters only
and broadcasts its updated share after the step (torch's
ZeroRedundancyOptimizer). Checkpoints gather that state on rank 0 first,
so the file is the same as ddp's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from distribuuuu.optim import optimizer_class, param_groups
from distribuuuu.strategies import DDPStrategy


class Zero1(DDPStrategy):
    name = "zero1"

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        cls, kwargs = optimizer_class(self.cfg)
        o = self.cfg.OPTIM
        return ZeroRedundancyOptimizer(
            param_groups(self.cfg, model),
            optimizer_class=cls,
            lr=o.BASE_LR,
            weight_decay=o.WEIGHT_DECAY,
            **kwargs,
        )

    def checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, shards: str
    ) -> tuple[dict[str, Any], bool]:
        optimizer.consolidate_state_dict(to=0)  # a collective: the shards of the state, on rank 0
        return super().checkpoint_state(model, optimizer, shards)


STRATEGY = Zero1

"""One process, one device: the base Strategy as it is (also what
fsdp/zero1/ddp become alone)."""

from __future__ import annotations

import logging

from torch import nn

from distribuuuu.strategies import Strategy

log = logging.getLogger("distribuuuu")


class Single(Strategy):
    name = "single"

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.cfg.DIST.STRATEGY == "fsdp":
            log.warning("DIST.STRATEGY fsdp with one process: nothing to shard, training unsharded")
        return model


STRATEGY = Single

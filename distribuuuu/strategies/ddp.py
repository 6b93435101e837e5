"""DistributedDataParallel: a whole replica per process, gradients all-reduced in buckets."""

from __future__ import annotations

import contextlib
import logging

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distribuuuu.strategies import Strategy

log = logging.getLogger("distribuuuu")


class DDPStrategy(Strategy):
    name = "ddp"

    def wrap(self, model: nn.Module, units: list[nn.Module]) -> nn.Module:
        d, device = self.cfg.DIST, self.ctx.device
        device_ids = [device.index] if device.type == "cuda" else None
        # A frozen backbone (TRAIN.FREEZE_BACKBONE_EPOCHS, engine/hooks.py) is registered with DDP at
        # wrap time, trainable, and gets no gradient while frozen: DDP must look for unused parameters
        # or it waits for their gradients. It costs one graph traversal per step; the frozen backward
        # that is skipped costs far more.
        find_unused = d.FIND_UNUSED_PARAMETERS or self.cfg.TRAIN.FREEZE_BACKBONE_EPOCHS != 0
        if find_unused and not d.FIND_UNUSED_PARAMETERS:
            log.info("DDP find_unused_parameters on: TRAIN.FREEZE_BACKBONE_EPOCHS leaves the backbone "
                     "without gradients")
        # None (BUCKET_CAP_MB 0) keeps torch's small first bucket, which starts communicating sooner.
        self.ddp = DDP(model, device_ids=device_ids, bucket_cap_mb=d.BUCKET_CAP_MB or None,
                       static_graph=d.STATIC_GRAPH, gradient_as_bucket_view=d.GRADIENT_AS_BUCKET_VIEW,
                       find_unused_parameters=find_unused)
        return self.ddp

    def no_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        # Gradients are all-reduced only on the last micro-batch; before that they just add up.
        # The DDP module itself, also when torch.compile wraps it.
        return contextlib.nullcontext() if sync else self.ddp.no_sync()


STRATEGY = DDPStrategy

"""DataParallel: one process drives all its GPUs (the seed's snmc_dp);
plain with one GPU or none."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distribuuuu.errors import UserError
from distribuuuu.optim import AMP_DTYPES
from distribuuuu.strategies import Strategy


class _AutocastReplica(nn.Module):
    """One DataParallel replica whose forward re-enters autocast with
    the run's dtype."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module, self.dtype = module, dtype

    def forward(self, *args, **kwargs):
        for device_type in ("cuda", "cpu"):
            if torch.is_autocast_enabled(device_type):
                with torch.autocast(device_type, dtype=self.dtype):
                    return self.module(*args, **kwargs)
        return self.module(*args, **kwargs)


class AutocastDataParallel(nn.DataParallel):
    """DataParallel that keeps TRAIN.AMP's dtype in its worker threads.

    torch's parallel_apply re-enters ``autocast(device_type,
    enabled=...)`` in each worker thread without a dtype, so the
    replicas run in the device's default dtype (float16 on CUDA) while
    the main thread asked for bfloat16, and no GradScaler guards that
    fp16. Each replica here enters autocast with the dtype itself.
    State-dict keys are DataParallel's (the wrapper is per call).
    """

    def __init__(self, module: nn.Module, amp_dtype: torch.dtype | None) -> None:
        super().__init__(module)
        self.amp_dtype = amp_dtype

    def parallel_apply(self, replicas, inputs, kwargs):
        if self.amp_dtype is not None:
            replicas = [_AutocastReplica(r, self.amp_dtype) for r in replicas]
        return super().parallel_apply(replicas, inputs, kwargs)


class DP(Strategy):
    name = "dp"
    dp: AutocastDataParallel | None = None

    @classmethod
    def check_config(cls, cfg: Any, world_size: int) -> None:
        super().check_config(cfg, world_size)
        if world_size > 1:
            raise UserError(
                f"DIST.STRATEGY dp is ONE process driving all local GPUs, but {world_size} "
                "processes were started; run it with plain python, or use DIST.STRATEGY ddp"
            )

    def wrap(self, model: nn.Module) -> nn.Module:
        if torch.cuda.device_count() > 1:  # its replicas keep TRAIN.AMP's dtype
            self.dp = AutocastDataParallel(model, AMP_DTYPES[self.cfg.TRAIN.AMP])
            return self.dp
        return model

    def gpus(self) -> list[torch.device]:
        """DataParallel's every device (the engine syncs and measures
        them all)."""
        if self.ctx.device.type == "cuda" and self.dp is not None:
            return [torch.device("cuda", i) for i in self.dp.device_ids]
        return super().gpus()


STRATEGY = DP

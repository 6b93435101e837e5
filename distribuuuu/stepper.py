"""One optimizer step made of TRAIN.ACCUM_STEPS micro-batches.

Everything between "a batch arrived" and "the weights moved" lives here, in this order:
mixup/cutmix -> channels_last -> autocast forward and loss -> (scaled) backward, under DDP's
no_sync for all but the last micro-batch -> unscale -> gradient clipping -> non-finite check ->
optimizer step -> EMA update. The engine calls ``micro_step`` once per batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from timm.utils import ModelEmaV3
from torch.nn.parallel import DistributedDataParallel as DDP
from yacs.config import CfgNode

from distribuuuu import models, sharding

AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class MicroStep:
    logits: torch.Tensor
    loss: torch.Tensor  # the batch-mean loss, before the 1/ACCUM_STEPS scaling
    target: torch.Tensor  # the hard labels (also under mixup: top-1 is counted against them)
    stepped: bool | None  # None: not the last micro-batch; False: step skipped (non-finite)


def ema_decay_per_step(cfg: CfgNode, global_batch: int) -> float:
    """TRAIN.EMA_DECAY is given per step at OPTIM.REF_BATCH_SIZE; a step of another global batch
    covers global_batch / REF_BATCH_SIZE such steps, so the decay is raised to that power."""
    return cfg.TRAIN.EMA_DECAY ** (global_batch / cfg.OPTIM.REF_BATCH_SIZE)


class Stepper:
    """Forward, backward and optimizer step with AMP, accumulation, clipping, checks and EMA."""

    def __init__(self, cfg: CfgNode, device: torch.device, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, global_batch: int) -> None:
        t = cfg.TRAIN
        self.model, self.optimizer, self.device = model, optimizer, device
        self.accum, self.micro = t.ACCUM_STEPS, 0
        self.sharded = sharding.is_sharded(getattr(model, "_orig_mod", model))
        self.amp_dtype = AMP_DTYPES[t.AMP]
        self.channels_last = t.CHANNELS_LAST
        self.clip, self.check_finite = t.CLIP_GRAD_NORM, t.NONFINITE != "off"
        # GradScaler only for fp16: bf16 has fp32's range and needs no loss scaling.
        self.scaler = torch.amp.GradScaler(device.type, enabled=t.AMP == "fp16")
        self.mixup = None
        if t.MIXUP_ALPHA > 0 or t.CUTMIX_ALPHA > 0:
            self.mixup = Mixup(mixup_alpha=t.MIXUP_ALPHA, cutmix_alpha=t.CUTMIX_ALPHA,
                               label_smoothing=t.LABEL_SMOOTHING, num_classes=cfg.MODEL.NUM_CLASSES)
            self.criterion: torch.nn.Module = SoftTargetCrossEntropy()  # mixed targets are soft
        else:
            self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=t.LABEL_SMOOTHING)
        self.ema = None
        if t.EMA_DECAY > 0:
            self.ema = ModelEmaV3(models.unwrap(model), decay=ema_decay_per_step(cfg, global_batch))

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def prepare(self, images: torch.Tensor) -> torch.Tensor:
        return images.contiguous(memory_format=torch.channels_last) if self.channels_last else images

    def micro_step(self, images: torch.Tensor, target: torch.Tensor) -> MicroStep:
        last = self.micro == self.accum - 1
        hard = target
        if self.mixup is not None:
            images, target = self.mixup(images, target)
        # Gradients are all-reduced only on the last micro-batch; before that they just add up.
        ddp = getattr(self.model, "_orig_mod", self.model)  # torch.compile wraps the DDP module
        no_sync = isinstance(ddp, DDP) and not last
        if self.sharded:  # FSDP: reduce-scatter the gradients on the last micro-batch only
            sharding.set_gradient_sync(ddp, last)
        with ddp.no_sync() if no_sync else contextlib.nullcontext():
            with self.autocast():
                logits = self.model(self.prepare(images))
                loss = self.criterion(logits, target)
            self.scaler.scale(loss / self.accum).backward()
        self.micro = 0 if last else self.micro + 1
        return MicroStep(logits, loss, hard, self._step() if last else None)

    def _step(self) -> bool:
        self.scaler.unscale_(self.optimizer)  # true gradients for clipping and the check (fp16 only)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        finite: bool | torch.Tensor = True
        if self.clip > 0:
            # The total norm is non-finite iff some gradient is: it doubles as the check.
            norm = torch.nn.utils.clip_grad_norm_(params, self.clip, foreach=True)
            finite = torch.isfinite(sharding.local_tensor(norm))  # FSDP: a replicated DTensor
        elif self.check_finite:
            finite = grads_finite(params, self.sharded)
        if self.check_finite and not bool(finite):  # the one host sync this check costs
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.update()  # under fp16: a smaller loss scale for the next step
            return False
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(models.unwrap(self.model))
        return True

    def state_dict(self) -> dict:
        state = {"scaler": self.scaler.state_dict()}
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None and "ema" in state:
            self.ema.load_state_dict(state["ema"])


def grads_finite(params: list[torch.nn.Parameter], sharded: bool = False) -> torch.Tensor:
    """Whether every gradient is finite, as a 0-d bool tensor (no host sync yet).

    DDP has already averaged the gradients, so a NaN on any rank is a NaN on all of them and
    every rank reaches the same answer without a collective. Under FSDP each rank holds other
    shards, so the ranks' answers are combined with one all-reduce.
    """
    grads = [sharding.local_tensor(p.grad) for p in params if p.grad is not None]
    finite = torch.tensor(True, device=grads[0].device) if grads else torch.tensor(True)
    if grads:
        finite = torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()  # one multi-tensor kernel
    if sharded:
        bad = (~finite).to(torch.int32).reshape(1)
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        finite = bad[0] == 0
    return finite

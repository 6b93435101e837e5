"""One optimizer step made of TRAIN.ACCUM_STEPS micro-batches.

Everything between "a batch arrived" and "the weights moved" lives here, in this order:
mixup/cutmix -> channels_last -> autocast forward and loss -> (scaled) backward, under the
strategy's no_sync for all but the last micro-batch -> unscale -> gradient clipping -> non-finite check ->
optimizer step -> EMA update. The engine calls ``micro_step`` once per batch. What differs
between the ways of training (the no-sync context, the gradient check under sharding) is asked
of the Strategy.

Under fp16 a non-finite gradient is usually no failure: the GradScaler grows the loss scale every
2000 clean steps until the scaled gradients overflow, then skips that step and halves the scale.
Such a step counts as a step (as it does with TRAIN.NONFINITE off); it is a failure only when the
loss itself is non-finite on some rank, or the scale has fallen below ``FP16_MIN_LOSS_SCALE``.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from timm.utils import ModelEmaV3
from yacs.config import CfgNode

from distribuuuu import models
from distribuuuu.launch import comm
from distribuuuu.strategies.base import AMP_DTYPES, Strategy, local_tensor

log = logging.getLogger("distribuuuu")

__all__ = ["AMP_DTYPES", "FP16_MIN_LOSS_SCALE", "MicroStep", "Stepper", "ema_decay_per_step"]
# fp16: below this loss scale an overflow is a failure, not the GradScaler's normal probing (it
# starts at 2**16 and halves per overflow, so ~17 overflows in a row without a finite step get here):
# the gradients overflow fp16 even unscaled.
FP16_MIN_LOSS_SCALE = 1.0


@dataclass
class MicroStep:
    logits: torch.Tensor
    loss: torch.Tensor  # the batch-mean loss, before the 1/ACCUM_STEPS scaling
    target: torch.Tensor  # the hard labels (also under mixup: top-1 is counted against them)
    stepped: bool | None  # None: not the last micro-batch; False: step skipped (non-finite)
    # True with stepped True: fp16 only, the GradScaler skipped the update for an overflow (no failure)
    overflow: bool = False


def ema_decay_per_step(cfg: CfgNode, global_batch: int) -> float:
    """TRAIN.EMA_DECAY is given per step at OPTIM.REF_BATCH_SIZE; a step of another global batch
    covers global_batch / REF_BATCH_SIZE such steps, so the decay is raised to that power."""
    return cfg.TRAIN.EMA_DECAY ** (global_batch / cfg.OPTIM.REF_BATCH_SIZE)


class Stepper:
    """Forward, backward and optimizer step with AMP, accumulation, clipping, checks and EMA."""

    def __init__(self, cfg: CfgNode, device: torch.device, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, global_batch: int, strategy: Strategy | None = None) -> None:
        t = cfg.TRAIN
        self.model, self.optimizer, self.device = model, optimizer, device
        # The strategy that wrapped the model (None: one plain process, Strategy's defaults).
        self.strategy = strategy if strategy is not None else Strategy(cfg, None)
        self.accum, self.micro = t.ACCUM_STEPS, 0
        self.amp_dtype = AMP_DTYPES[t.AMP]
        self.channels_last = t.CHANNELS_LAST
        self.clip, self.check_finite = t.CLIP_GRAD_NORM, t.NONFINITE != "off"
        # GradScaler only for fp16: bf16 has fp32's range and needs no loss scaling.
        self.scaler = torch.amp.GradScaler(device.type, enabled=t.AMP == "fp16")
        self.loss_finite: torch.Tensor | None = None  # fp16: all micro-batch losses of this step finite
        self.overflows = 0  # fp16 steps the GradScaler skipped (logged, not failures)
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
        # Gradients are synchronised only on the last micro-batch; before that they just add up.
        with self.strategy.no_sync(last):
            with self.autocast():
                logits = self.model(self.prepare(images))
                loss = self.criterion(logits, target)
            self.scaler.scale(loss / self.accum).backward()
        if self.scaler.is_enabled() and self.check_finite:  # on the device: no host sync here
            ok = torch.isfinite(loss.detach())
            self.loss_finite = ok if self.loss_finite is None else self.loss_finite & ok
        self.micro = 0 if last else self.micro + 1
        if not last:
            return MicroStep(logits, loss, hard, None)
        stepped = self._step()
        return MicroStep(logits, loss, hard, stepped is not False, overflow=stepped is None)

    def _step(self) -> bool | None:
        """True: the optimizer stepped; False: a non-finite step (a failure); None: fp16 overflow."""
        loss_finite, self.loss_finite = self.loss_finite, None
        self.scaler.unscale_(self.optimizer)  # true gradients for clipping and the check (fp16 only)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        finite: bool | torch.Tensor = True
        if self.clip > 0:
            # The total norm is non-finite iff some gradient is: it doubles as the check.
            norm = torch.nn.utils.clip_grad_norm_(params, self.clip, foreach=True)
            finite = torch.isfinite(local_tensor(norm))  # FSDP: a replicated DTensor
        elif self.check_finite:
            finite = self.strategy.grads_finite(params)
        if self.check_finite and not bool(finite):  # the one host sync this check costs
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.update()  # under fp16: a smaller loss scale for the next step
            return None if self._scaler_overflow(loss_finite) else False
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(models.unwrap(self.model))
        return True

    def _scaler_overflow(self, loss_finite: torch.Tensor | None) -> bool:
        """fp16, after a non-finite gradient: was it the GradScaler's normal overflow?

        Every rank reaches this branch together (the gradients were averaged, or voted on under
        FSDP), so the loss vote below is a collective all ranks join; it runs on overflow steps only.
        """
        if not self.scaler.is_enabled():
            return False
        loss_bad = loss_finite is not None and not bool(loss_finite)
        if comm.any_rank([loss_bad])[0] or self.scaler.get_scale() < FP16_MIN_LOSS_SCALE:
            return False
        self.overflows += 1
        log.info("fp16: gradients overflowed, the GradScaler skipped this step and lowered the loss "
                 "scale to %g (normal: %d such steps so far)", self.scaler.get_scale(), self.overflows)
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

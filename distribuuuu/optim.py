"""The learning-rate schedule, and one optimizer step (``Stepper``); the optimizer itself is built by
the strategy (strategies.build_optimizer).

The schedule is a pure function of the (fractional) epoch, so it has no state to save: a resumed
run recomputes the same LR from its epoch and step. The engine calls ``Stepper.micro_step`` once per
batch; the non-finite guard around the step (TRAIN.NONFINITE) is nonfinite.py's.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from timm.utils import ModelEmaV3
from yacs.config import CfgNode

from distribuuuu import models, nonfinite
from distribuuuu.inferred import warmup_epochs
from distribuuuu.strategies import AMP_DTYPES, Strategy, local_tensor


# -- the learning-rate schedule ---------------------------------------------------------------------
def peak_lr(cfg: CfgNode, global_batch: int) -> float:
    """BASE_LR, or BASE_LR x global batch / REF_BATCH_SIZE under the linear scaling rule."""
    if cfg.OPTIM.LR_SCALING == "linear":
        return cfg.OPTIM.BASE_LR * global_batch / cfg.OPTIM.REF_BATCH_SIZE
    return cfg.OPTIM.BASE_LR


def lr_factor(cfg: CfgNode, epoch: float) -> float:
    """Multiplier of the peak LR at a fractional epoch: a linear warmup from WARMUP_FACTOR to exactly 1
    at warmup_epochs(cfg), then the policy, whose decay runs over the epochs after the warmup."""
    o = cfg.OPTIM
    warm = warmup_epochs(cfg)
    if epoch < warm:
        alpha = epoch / warm
        ramp = o.WARMUP_FACTOR * (1.0 - alpha) + alpha
        return ramp * (o.LR_MULT ** (sum(1 for s in o.STEPS if epoch >= s) - 1) if o.LR_POLICY == "steps" else 1.0)
    done = (epoch - warm) / max(o.MAX_EPOCH - warm, 1e-12)  # the fraction of the decay behind
    if o.LR_POLICY == "cos":
        return (1.0 - o.MIN_LR) * 0.5 * (1.0 + math.cos(math.pi * done)) + o.MIN_LR
    if o.LR_POLICY == "steps":  # one LR_MULT per step already passed (STEPS count from the run's start)
        return o.LR_MULT ** (sum(1 for s in o.STEPS if epoch >= s) - 1)
    if o.LR_POLICY == "linear":
        return 1.0 - (1.0 - o.MIN_LR) * done
    return 1.0  # "constant"


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The scheduled LR into every group, times the group's ``lr_scale`` (OPTIM.BACKBONE_LR_SCALE):
    warmup and decay move all groups together and keep their ratio."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


# -- one optimizer step ----------------------------------------------------------------------------
@dataclass
class MicroStep:
    logits: torch.Tensor
    loss: torch.Tensor  # the batch-mean loss, before the 1/ACCUM_STEPS scaling
    target: torch.Tensor  # the hard labels (also under mixup: top-1 is counted against them)
    # None: not the last micro-batch; False: step skipped (non-finite); True: stepped, or on the
    # device path (Stepper.on_device) stepped unless ``skipped`` (a 0-d device bool) says otherwise
    stepped: bool | None
    skipped: torch.Tensor | None = None


def ema_decay_per_step(cfg: CfgNode, global_batch: int) -> float:
    """TRAIN.EMA_DECAY is given per step at OPTIM.REF_BATCH_SIZE; a step of another global batch
    covers global_batch / REF_BATCH_SIZE such steps, so the decay is raised to that power."""
    return cfg.TRAIN.EMA_DECAY ** (global_batch / cfg.OPTIM.REF_BATCH_SIZE)


class Stepper:
    """One optimizer step made of TRAIN.ACCUM_STEPS micro-batches, in this order: mixup/cutmix ->
    channels_last -> autocast forward and loss -> (scaled) backward, under the strategy's no_sync for
    all but the last micro-batch -> unscale -> gradient clipping -> non-finite check -> optimizer step ->
    EMA update. What differs between strategies (no_sync, the gradient check under sharding) is asked
    of the Strategy; the non-finite guard's bookkeeping is nonfinite.py's."""

    def __init__(self, cfg: CfgNode, device: torch.device, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, global_batch: int, strategy: Strategy) -> None:
        t = cfg.TRAIN
        self.model, self.optimizer, self.device, self.strategy = model, optimizer, device, strategy
        self.accum, self.micro = t.ACCUM_STEPS, 0
        self.amp_dtype, self.channels_last = AMP_DTYPES[t.AMP], t.CHANNELS_LAST
        self.clip, self.check_finite = t.CLIP_GRAD_NORM, t.NONFINITE != "off"
        # GradScaler only for fp16: bf16 has fp32's range and needs no loss scaling.
        self.scaler = torch.amp.GradScaler(device.type, enabled=t.AMP == "fp16")
        self.mixup, self.criterion = _mixup_and_criterion(cfg)
        decay = ema_decay_per_step(cfg, global_batch)
        self.ema = ModelEmaV3(models.unwrap(model), decay=decay) if t.EMA_DECAY > 0 else None
        # The skip decided on the device (nonfinite.py); else one host sync per step.
        self.on_device = (self.check_finite and not self.scaler.is_enabled()
                          and getattr(optimizer, "_step_supports_amp_scaling", False))
        # BatchNorm's running statistics (and any buffer a forward pass writes), and their copy from
        # before this step's first forward pass: a skipped step puts them back.
        self.buffers = [b for b in model.buffers() if b.numel()] if self.check_finite else []
        self.saved_buffers = [torch.empty_like(b) for b in self.buffers]
        self.skips = nonfinite.DeviceSkips(cfg, device)
        self.loss_finite: torch.Tensor | None = None  # fp16: all micro-batch losses of this step finite
        self.overflows = 0  # fp16 steps the GradScaler skipped (logged, not failures)
        # The kernels built here (fused or multi-tensor): a checkpoint's param groups bring theirs back.
        self.kernels = [(g.get("fused"), g.get("foreach")) for g in _groups(optimizer)]

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def prepare(self, images: torch.Tensor) -> torch.Tensor:
        return images.contiguous(memory_format=torch.channels_last) if self.channels_last else images

    def micro_step(self, images: torch.Tensor, target: torch.Tensor) -> MicroStep:
        last = self.micro == self.accum - 1
        hard = target
        if self.micro == 0 and self.buffers:  # before the step's first forward pass writes them
            torch._foreach_copy_(self.saved_buffers, self.buffers)
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
        skipped = None
        if self.on_device and not nonfinite.momentum_unborn(self.optimizer):
            skipped, stepped = self._step_on_device(), True
        else:
            stepped = self._step()
        return MicroStep(logits, loss, hard, stepped is not False, skipped=skipped)

    def _finite(self) -> bool | torch.Tensor:
        """After unscaling: clip (its total norm doubles as the check), or check the gradients."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.clip > 0:  # the total norm is non-finite iff some gradient is
            norm = torch.nn.utils.clip_grad_norm_(params, self.clip, foreach=True)
            return torch.isfinite(local_tensor(norm))  # FSDP: a replicated DTensor
        if self.check_finite:
            return self.strategy.grads_finite(params)
        return True

    def _step_on_device(self) -> torch.Tensor:
        """Step with the skip decided on the device; returns the 0-d bool 'skipped' flag."""
        skipped = ~torch.as_tensor(self._finite(), device=self.device).reshape(())
        opt = self.optimizer
        opt.grad_scale, opt.found_inf = None, skipped.to(torch.float32)  # read by the fused kernel
        try:
            opt.step()
        finally:
            del opt.grad_scale, opt.found_inf
        opt.zero_grad(set_to_none=True)
        for b, saved in zip(self.buffers, self.saved_buffers):
            b.copy_(torch.where(skipped, saved, b))
        if self.ema is not None:
            nonfinite.ema_update_unless(self.ema, self.model, skipped)
        self.skips.count(skipped)
        return skipped

    def _step(self) -> bool | None:
        """True: the optimizer stepped; False: a non-finite step (a failure); None: fp16 overflow."""
        loss_finite, self.loss_finite = self.loss_finite, None
        self.scaler.unscale_(self.optimizer)  # true gradients for clipping and the check (fp16 only)
        finite = self._finite()
        if self.check_finite and not bool(finite):  # the one host sync this check costs
            self.optimizer.zero_grad(set_to_none=True)
            if self.buffers:  # the forward pass never happened
                torch._foreach_copy_(self.buffers, self.saved_buffers)
            self.scaler.update()  # under fp16: a smaller loss scale for the next step
            return None if nonfinite.fp16_overflow(self, loss_finite) else False
        with nonfinite.kernel_for_new_buffers(self.optimizer):
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
        """After the optimizer's state: the kernels stay those built now (a checkpoint from before
        the fused kernels would bring 'foreach' back, which takes no found_inf)."""
        groups = _groups(self.optimizer)
        if len(groups) == len(self.kernels):
            for g, (fused, foreach) in zip(groups, self.kernels):
                g["fused"], g["foreach"] = fused, foreach
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None and "ema" in state:
            self.ema.load_state_dict(state["ema"])


def _groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [g for opt in nonfinite.optimizers_of(optimizer) for g in opt.param_groups]


def _mixup_and_criterion(cfg: CfgNode) -> tuple[Mixup | None, torch.nn.Module]:
    """timm's Mixup/CutMix with a soft-target loss (mixed targets are soft), or plain cross-entropy."""
    t = cfg.TRAIN
    if t.MIXUP_ALPHA > 0 or t.CUTMIX_ALPHA > 0:
        mixup = Mixup(mixup_alpha=t.MIXUP_ALPHA, cutmix_alpha=t.CUTMIX_ALPHA,
                      label_smoothing=t.LABEL_SMOOTHING, num_classes=cfg.MODEL.NUM_CLASSES)
        return mixup, SoftTargetCrossEntropy()
    return None, torch.nn.CrossEntropyLoss(label_smoothing=t.LABEL_SMOOTHING)

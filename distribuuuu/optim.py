"""The optimizer, its learning-rate schedule, and one optimizer step
(``Stepper``).

- ``build_optimizer``: OPTIM.OPTIMIZER over the model's parameter
  groups, with torch's fused kernel where it has one (the non-finite
  guard skips a step on the device through it). The strategy calls it
  over the parameters it trains (strategies/: ZeRO shards the state,
  FSDP has no fused SGD).
- ``Schedule``: the LR as a pure function of the fractional epoch
  (warmup, then OPTIM.LR_POLICY): it has no state to save; a resumed run
  recomputes the same LR from its epoch and sample.
- ``Stepper.micro_step``: once per batch; TRAIN.ACCUM_STEPS
  micro-batches make one optimizer step, whose tail (the step itself,
  the EMA, a skip for non-finite numbers) is the guard's (nonfinite.py).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from timm.optim import get_optimizer_info, param_groups_weight_decay
from timm.utils import ModelEmaV3
from yacs.config import CfgNode

from distribuuuu import heads, models, nonfinite

# TRAIN.AMP's autocast dtypes: the stepper's autocast and dp's replicas
# use the same ones.
AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


# -- the optimizer
# ------------------------------------------------------------------------------------
def param_groups(cfg: CfgNode, model: torch.nn.Module) -> list[dict]:
    """One group with weight decay on everything (Distribuuuu), or, with
    OPTIM.NO_WD_NORM_BIAS, a second without it for 1-d parameters (norm
    weights, biases), as timm does."""
    if not cfg.OPTIM.NO_WD_NORM_BIAS:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    else:
        groups = param_groups_weight_decay(model, cfg.OPTIM.WEIGHT_DECAY)
    scale = cfg.OPTIM.BACKBONE_LR_SCALE
    return groups if scale == 1.0 else _split_backbone(model, groups, scale)


def _split_backbone(model: torch.nn.Module, groups: list[dict], scale: float) -> list[dict]:
    """OPTIM.BACKBONE_LR_SCALE != 1: each group split into the
    backbone's and the head's (heads.py); every group then carries
    ``lr_scale`` (timm's name), which the schedule multiplies the LR by.
    Groups are the same as before that key existed when it is 1, so
    older checkpoints resume."""
    split = []
    for group in groups:
        backbone, head = heads.split_parameters(models.unwrap(model), group["params"])
        split += [
            {**group, "params": params, "lr_scale": s}
            for params, s in ((backbone, scale), (head, 1.0))
            if params
        ]  # ZeRO wants no empty group
    return split


def describe_groups(optimizer: torch.optim.Optimizer) -> str:
    """'0.309M parameters at 0.1 x the LR, 0.000645M parameters at 1 x
    the LR' (for the log)."""
    by_scale: dict[float, int] = {}
    for group in optimizer.param_groups:
        scale = group.get("lr_scale", 1.0)
        by_scale[scale] = by_scale.get(scale, 0) + sum(p.numel() for p in group["params"])
    return ", ".join(f"{n / 1e6:.3g}M parameters at {s:g} x the LR" for s, n in by_scale.items())


FUSED = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
)  # torch's optimizers with fused CPU/CUDA kernels


def optimizer_class(
    cfg: CfgNode, fused_sgd: bool = True
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """OPTIM.OPTIMIZER's class and its keyword arguments besides lr and
    weight_decay: torch's SGD with Distribuuuu's keys, or timm's
    (MOMENTUM where the optimizer has one). FUSED ones take the
    found_inf flag that lets the non-finite guard skip a step without a
    host sync. SGD with DAMPENING runs the multi-tensor kernel
    (nonfinite.prime_momentum's zero buffers match torch's first step
    only without)."""
    o = cfg.OPTIM
    if o.OPTIMIZER != "sgd":
        return _timm_optimizer(o)
    kernel = dict(fused=True) if fused_sgd and o.DAMPENING == 0 else dict(foreach=True)
    return torch.optim.SGD, dict(
        momentum=o.MOMENTUM, dampening=o.DAMPENING, nesterov=o.NESTEROV, **kernel
    )


def _timm_optimizer(o: CfgNode) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    info = get_optimizer_info(o.OPTIMIZER)
    kwargs = dict(info.defaults or {})
    if info.has_momentum:
        kwargs.setdefault("momentum", o.MOMENTUM)
    if info.opt_class in FUSED:
        kwargs["fused"] = True
    return info.opt_class, kwargs


def build_optimizer(
    cfg: CfgNode, model: torch.nn.Module, fused_sgd: bool = True
) -> torch.optim.Optimizer:
    """The optimizer of one replica; ``fused_sgd`` False: SGD's
    multi-tensor kernels (FSDP: torch has no sharding rule for the fused
    SGD kernel)."""
    cls, kwargs = optimizer_class(cfg, fused_sgd)
    return cls(
        param_groups(cfg, model),
        lr=cfg.OPTIM.BASE_LR,
        weight_decay=cfg.OPTIM.WEIGHT_DECAY,
        **kwargs,
    )


# -- the learning-rate schedule
# -----------------------------------------------------------------------
def peak_lr(cfg: CfgNode, global_batch: int) -> float:
    """BASE_LR, or BASE_LR x global batch / REF_BATCH_SIZE under the
    linear scaling rule."""
    if cfg.OPTIM.LR_SCALING == "linear":
        return cfg.OPTIM.BASE_LR * global_batch / cfg.OPTIM.REF_BATCH_SIZE
    return cfg.OPTIM.BASE_LR


WARMUP_MAX_SHARE = 0.5  # a warmup longer than this share of the run does not fit ...
WARMUP_SHORT_SHARE = 0.2  # ... and is shortened to this share of it


def warmup_epochs(cfg: CfgNode) -> float:
    """The warmup the schedule runs: OPTIM.WARMUP_EPOCHS, or a fifth of
    the run when that is over half of OPTIM.MAX_EPOCH (5 warmup epochs
    of a 3-epoch run never reached the printed peak LR). Computed where
    used, not written into the config: a run resumed with a longer
    OPTIM.MAX_EPOCH (a safe key: the schedule follows it, its decay too)
    is not refused for a changed OPTIM.WARMUP_EPOCHS."""
    o = cfg.OPTIM
    if o.WARMUP_EPOCHS <= WARMUP_MAX_SHARE * o.MAX_EPOCH:
        return float(o.WARMUP_EPOCHS)
    return round(WARMUP_SHORT_SHARE * o.MAX_EPOCH, 4)


# OPTIM.LR_POLICY: the multiplier of the peak LR, given the epoch and
# the fraction of the decay behind (the epochs after the warmup); during
# the warmup the ramp multiplies the policy's value at 0.
POLICIES = {
    "cos": lambda o, epoch, done: (
        (1.0 - o.MIN_LR) * 0.5 * (1.0 + math.cos(math.pi * done)) + o.MIN_LR
    ),
    "steps": lambda o, epoch, done: (
        o.LR_MULT ** (sum(1 for s in o.STEPS if epoch >= s) - 1)
    ),  # STEPS from the start
    "linear": lambda o, epoch, done: 1.0 - (1.0 - o.MIN_LR) * done,
    "constant": lambda o, epoch, done: 1.0,
}


class Schedule:
    """The LR at a fractional epoch: a linear warmup from WARMUP_FACTOR
    x peak to exactly the peak at warmup_epochs(cfg), then
    OPTIM.LR_POLICY over the epochs after the warmup."""

    def __init__(self, cfg: CfgNode, peak: float) -> None:
        self.o, self.peak, self.warm = cfg.OPTIM, peak, warmup_epochs(cfg)
        self.policy, self.decay_epochs = (
            POLICIES[cfg.OPTIM.LR_POLICY],
            max(cfg.OPTIM.MAX_EPOCH - self.warm, 1e-12),
        )

    def __call__(self, epoch: float) -> float:
        if epoch >= self.warm:
            return self.peak * self.policy(self.o, epoch, (epoch - self.warm) / self.decay_epochs)
        alpha = epoch / self.warm
        return (
            self.peak
            * (self.o.WARMUP_FACTOR * (1.0 - alpha) + alpha)
            * self.policy(self.o, epoch, 0.0)
        )

    def apply(self, optimizer: torch.optim.Optimizer, epoch: float) -> float:
        """The LR into every group, times the group's ``lr_scale``
        (OPTIM.BACKBONE_LR_SCALE): warmup and decay move all groups
        together and keep their ratio. Returns the LR."""
        lr = self(epoch)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        return lr


# -- one optimizer step
# -------------------------------------------------------------------------------
@dataclass
class MicroStep:
    logits: torch.Tensor
    loss: torch.Tensor  # the batch-mean loss, before the 1/ACCUM_STEPS scaling
    target: torch.Tensor  # the hard labels (also under mixup: top-1 is counted against them)
    last: bool  # the micro-batch that ended an optimizer step (taken, unless the guard skipped it)


def ema_decay_per_step(cfg: CfgNode, global_batch: int) -> float:
    """TRAIN.EMA_DECAY is given per step at OPTIM.REF_BATCH_SIZE; a step
    of another global batch covers global_batch / REF_BATCH_SIZE such
    steps, so the decay is raised to that power."""
    return cfg.TRAIN.EMA_DECAY ** (global_batch / cfg.OPTIM.REF_BATCH_SIZE)


class Stepper:
    """One optimizer step made of TRAIN.ACCUM_STEPS micro-batches, in
    this order: mixup/cutmix -> channels_last -> autocast forward and
    loss -> (scaled) backward, under the strategy's no_sync for all but
    the last micro-batch -> unscale (fp16) -> gradient clipping -> the
    guard's step (the optimizer's and the EMA's, unless the numbers are
    not finite) -> zero_grad. The loop asks it, never its guard."""

    def __init__(
        self,
        cfg: CfgNode,
        device: torch.device,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        global_batch: int,
        strategy: Any,
    ) -> None:
        t = cfg.TRAIN
        self.model, self.optimizer, self.device = model, optimizer, device
        self.accum, self.micro, self.no_sync = t.ACCUM_STEPS, 0, strategy.no_sync
        self.clip = t.CLIP_GRAD_NORM
        # the memory layout the model trains in (a no-op for the usual one)
        layout = torch.channels_last if t.CHANNELS_LAST else torch.contiguous_format
        self.prepare = functools.partial(torch.Tensor.contiguous, memory_format=layout)
        amp = AMP_DTYPES[t.AMP]
        self.autocast = functools.partial(torch.autocast, device.type, amp, amp is not None)
        # GradScaler only for fp16: bf16 has fp32's range and needs no loss scaling.
        self.scaler = torch.amp.GradScaler(device.type, enabled=t.AMP == "fp16")
        self.mixup, self.criterion = _mixup_and_criterion(cfg)
        decay = ema_decay_per_step(cfg, global_batch)
        self.ema = ModelEmaV3(models.unwrap(model), decay=decay) if t.EMA_DECAY > 0 else None
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        nonfinite.prime_momentum(optimizer)
        grads_finite = functools.partial(strategy.grads_finite, self.params)
        self.guard = nonfinite.guard_for(cfg, model, optimizer, self.scaler, self.ema, grads_finite)
        # fp16: an overflow is told from a failure by the losses
        self.watch_loss = self.scaler.is_enabled() and t.NONFINITE != "off"
        # The kernels built here (fused or multi-tensor): a checkpoint's
        # param groups bring theirs back.
        self.kernels = [(g.get("fused"), g.get("foreach")) for g in _groups(optimizer)]

    def weigh_classes(self, cfg: CfgNode, weight: torch.Tensor) -> None:
        """TRAIN.CLASS_BALANCE loss: the training loss weighs class c by
        weight[c] (known once the data is built, after the Stepper).
        Evaluation's loss stays unweighted."""
        self.mixup, self.criterion = _mixup_and_criterion(cfg, weight.to(self.device))

    def micro_step(self, images: torch.Tensor, target: torch.Tensor) -> MicroStep:
        self.micro += 1
        last, hard = self.micro == self.accum, target
        if self.micro == 1:
            self.guard.before_forward()
        if self.mixup is not None:
            images, target = self.mixup(images, target)
        # Gradients are synchronised only on the last micro-batch; before that they add up.
        with contextlib.nullcontext() if last else self.no_sync():
            with self.autocast():
                logits = self.model(self.prepare(images))
                loss = self.criterion(logits, target)
            self.scaler.scale(loss / self.accum).backward()
        if self.watch_loss:
            self.guard.watch_loss(loss)
        if last:
            self.micro = 0
            self.optimizer_step()
        return MicroStep(logits, loss, hard, last)

    def optimizer_step(self) -> None:
        self.scaler.unscale_(self.optimizer)  # fp16: the true gradients, to clip and check
        norm = None
        if self.clip > 0:  # the total norm is non-finite iff a gradient is: it doubles as the check
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
            norm = nonfinite.local_tensor(norm)
        self.guard.step(norm)
        self.optimizer.zero_grad(set_to_none=True)

    def settle(self, global_step: int) -> int:
        """The steps the guard skipped since the last call (one host
        sync); NonFiniteLoss past TRAIN.NONFINITE's limits."""
        return self.guard.settle(global_step)

    def take_epoch_skips(self) -> int:
        """The steps skipped in the epoch so far (settled), from zero again."""
        return self.guard.take_epoch_skips()

    def state_dict(self) -> dict:
        state = {"scaler": self.scaler.state_dict(), "epoch_skips": self.guard.epoch_skips}
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """After the optimizer's state: the kernels stay those built now
        (a checkpoint from before the fused kernels would bring
        'foreach' back, which takes no found_inf)."""
        groups = _groups(self.optimizer)
        if len(groups) == len(self.kernels):
            for g, (fused, foreach) in zip(groups, self.kernels):
                g["fused"], g["foreach"] = fused, foreach
        nonfinite.prime_momentum(self.optimizer)  # a checkpoint may lack some buffers
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None and "ema" in state:
            self.ema.load_state_dict(state["ema"])
        self.guard.epoch_skips = state.get("epoch_skips", 0)


def _groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [g for opt in nonfinite.optimizers_of(optimizer) for g in opt.param_groups]


def _mixup_and_criterion(
    cfg: CfgNode, weight: torch.Tensor | None = None
) -> tuple[Mixup | None, torch.nn.Module]:
    """timm's Mixup/CutMix with a soft-target loss (mixed targets are
    soft, label smoothing is Mixup's), or plain cross-entropy. weight:
    TRAIN.CLASS_BALANCE loss's per-class weights (torch's cross-entropy
    takes them with soft targets too: sum over c of -weight[c] target[c]
    log p[c], timm's has no weights)."""
    t = cfg.TRAIN
    if t.MIXUP_ALPHA > 0 or t.CUTMIX_ALPHA > 0:
        mixup = Mixup(
            mixup_alpha=t.MIXUP_ALPHA,
            cutmix_alpha=t.CUTMIX_ALPHA,
            label_smoothing=t.LABEL_SMOOTHING,
            num_classes=cfg.MODEL.NUM_CLASSES,
        )
        return mixup, SoftTargetCrossEntropy() if weight is None else torch.nn.CrossEntropyLoss(
            weight=weight
        )
    return None, torch.nn.CrossEntropyLoss(weight=weight, label_smoothing=t.LABEL_SMOOTHING)

"""SGD and the learning-rate schedule, evaluated per iteration.

The schedule is a pure function of the (fractional) epoch, so it has no state to save: a resumed
run recomputes the same LR from its epoch and step.
"""

from __future__ import annotations

import inspect
import math

import torch
from timm.optim import create_optimizer_v2, param_groups_weight_decay
from torch.distributed.optim import ZeroRedundancyOptimizer
from yacs.config import CfgNode


def param_groups(cfg: CfgNode, model: torch.nn.Module) -> list[dict]:
    """One group with weight decay on everything (Distribuuuu), or, with OPTIM.NO_WD_NORM_BIAS,
    a second group without it for 1-d parameters (norm weights, biases), as timm does."""
    if not cfg.OPTIM.NO_WD_NORM_BIAS:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    return param_groups_weight_decay(model, cfg.OPTIM.WEIGHT_DECAY)


def build_optimizer(cfg: CfgNode, model: torch.nn.Module) -> torch.optim.Optimizer:
    """torch's SGD with Distribuuuu's keys, or timm's AdamW / LAMB / LARS; multi-tensor kernels."""
    o = cfg.OPTIM
    groups = param_groups(cfg, model)
    if o.OPTIMIZER == "sgd":
        cls, kwargs = torch.optim.SGD, dict(momentum=o.MOMENTUM, dampening=o.DAMPENING, nesterov=o.NESTEROV,
                                           foreach=True)
    else:
        # timm's factory knows LAMB and LARS; MOMENTUM is used where the optimizer has one.
        probe = create_optimizer_v2(groups, opt=o.OPTIMIZER, lr=o.BASE_LR, weight_decay=o.WEIGHT_DECAY,
                                    momentum=o.MOMENTUM, filter_bias_and_bn=False)
        if cfg.DIST.STRATEGY != "zero1":
            return probe
        # Rebuild it the same way under ZeRO: its class and the defaults its constructor takes.
        cls = type(probe)
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in probe.defaults.items() if k in accepted and k not in ("lr", "weight_decay")}
    if cfg.DIST.STRATEGY == "zero1" and torch.distributed.is_initialized():
        # ZeRO stage 1: each rank keeps the optimizer state of its share of the parameters only
        # and broadcasts its updated share after the step.
        return ZeroRedundancyOptimizer(groups, optimizer_class=cls, lr=o.BASE_LR, weight_decay=o.WEIGHT_DECAY, **kwargs)
    return cls(groups, lr=o.BASE_LR, weight_decay=o.WEIGHT_DECAY, **kwargs)


def peak_lr(cfg: CfgNode, global_batch: int) -> float:
    """BASE_LR, or BASE_LR x global batch / REF_BATCH_SIZE under the linear scaling rule."""
    if cfg.OPTIM.LR_SCALING == "linear":
        return cfg.OPTIM.BASE_LR * global_batch / cfg.OPTIM.REF_BATCH_SIZE
    return cfg.OPTIM.BASE_LR


def lr_factor(cfg: CfgNode, epoch: float) -> float:
    """Multiplier of the peak LR at a fractional epoch: policy x linear warmup."""
    o = cfg.OPTIM
    if o.LR_POLICY == "cos":
        cos = 0.5 * (1.0 + math.cos(math.pi * epoch / o.MAX_EPOCH))
        factor = (1.0 - o.MIN_LR) * cos + o.MIN_LR
    elif o.LR_POLICY == "steps":  # one LR_MULT per step already passed
        passed = sum(1 for s in o.STEPS if epoch >= s) - 1
        factor = o.LR_MULT ** passed
    elif o.LR_POLICY == "linear":
        factor = 1.0 - (1.0 - o.MIN_LR) * epoch / o.MAX_EPOCH
    else:  # "constant" (after the warmup)
        factor = 1.0
    if epoch < o.WARMUP_EPOCHS:
        alpha = epoch / o.WARMUP_EPOCHS
        factor *= o.WARMUP_FACTOR * (1.0 - alpha) + alpha
    return factor


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr

"""SGD and the learning-rate schedule, evaluated per iteration.

The schedule is a pure function of the (fractional) epoch, so it has no state to save: a resumed
run recomputes the same LR from its epoch and step.
"""

from __future__ import annotations

import math

import torch
from yacs.config import CfgNode


def build_optimizer(cfg: CfgNode, model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD over all parameters (as Distribuuuu), multi-tensor (foreach) kernels."""
    return torch.optim.SGD(
        model.parameters(),
        lr=cfg.OPTIM.BASE_LR,
        momentum=cfg.OPTIM.MOMENTUM,
        dampening=cfg.OPTIM.DAMPENING,
        nesterov=cfg.OPTIM.NESTEROV,
        weight_decay=cfg.OPTIM.WEIGHT_DECAY,
        foreach=True,
    )


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
    else:  # "steps": one LR_MULT per step already passed
        passed = sum(1 for s in o.STEPS if epoch >= s) - 1
        factor = o.LR_MULT ** passed
    if epoch < o.WARMUP_EPOCHS:
        alpha = epoch / o.WARMUP_EPOCHS
        factor *= o.WARMUP_FACTOR * (1.0 - alpha) + alpha
    return factor


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr

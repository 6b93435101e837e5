"""SGD and the learning-rate schedule, evaluated per iteration.

The schedule is a pure function of the (fractional) epoch, so it has no state to save: a resumed
run recomputes the same LR from its epoch and step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from timm.optim import get_optimizer_info, param_groups_weight_decay
from yacs.config import CfgNode

from distribuuuu import heads, models
from distribuuuu.inferred import warmup_epochs


def param_groups(cfg: CfgNode, model: torch.nn.Module) -> list[dict]:
    """One group with weight decay on everything (Distribuuuu), or, with OPTIM.NO_WD_NORM_BIAS,
    a second group without it for 1-d parameters (norm weights, biases), as timm does.

    OPTIM.BACKBONE_LR_SCALE != 1 splits each group into the backbone's and the head's (heads.py);
    every group then carries ``lr_scale`` (timm's name), which ``set_lr`` multiplies the LR by.
    Groups are the same as before that key existed when it is 1, so older checkpoints resume.
    """
    if not cfg.OPTIM.NO_WD_NORM_BIAS:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    else:
        groups = param_groups_weight_decay(model, cfg.OPTIM.WEIGHT_DECAY)
    scale = cfg.OPTIM.BACKBONE_LR_SCALE
    if scale == 1.0:
        return groups
    split = []
    for group in groups:
        backbone, head = heads.split_parameters(models.unwrap(model), group["params"])
        split += [{**group, "params": params, "lr_scale": s}
                  for params, s in ((backbone, scale), (head, 1.0)) if params]  # ZeRO wants no empty group
    return split


def describe_groups(optimizer: torch.optim.Optimizer) -> str:
    """'0.309M parameters at 0.1 x the LR, 0.000645M parameters at 1 x the LR' (for the log)."""
    by_scale: dict[float, int] = {}
    for group in optimizer.param_groups:
        scale = group.get("lr_scale", 1.0)
        by_scale[scale] = by_scale.get(scale, 0) + sum(p.numel() for p in group["params"])
    return ", ".join(f"{n / 1e6:.3g}M parameters at {s:g} x the LR" for s, n in by_scale.items())


FUSED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)  # torch's optimizers with fused CPU/CUDA kernels


def optimizer_class(cfg: CfgNode, fused_sgd: bool = True) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """OPTIM.OPTIMIZER's class and its keyword arguments besides lr and weight_decay: torch's SGD
    with Distribuuuu's keys, or timm's AdamW / LAMB / LARS (MOMENTUM is used where the optimizer has
    one, as timm's factory does).

    torch's SGD, Adam and AdamW run their fused kernels (CPU and CUDA): one launch per step, and they
    take a device flag (``found_inf``) that skips the update and its step count on the device, which
    the non-finite check uses instead of a host sync (engine/stepper.py). Others keep the synced check.
    """
    o = cfg.OPTIM
    if o.OPTIMIZER == "sgd":
        kernel = dict(fused=True) if fused_sgd else dict(foreach=True)
        return torch.optim.SGD, dict(momentum=o.MOMENTUM, dampening=o.DAMPENING, nesterov=o.NESTEROV, **kernel)
    info = get_optimizer_info(o.OPTIMIZER)
    kwargs = dict(info.defaults or {})
    if info.has_momentum:
        kwargs.setdefault("momentum", o.MOMENTUM)
    if info.opt_class in FUSED:
        kwargs["fused"] = True
    return info.opt_class, kwargs


def build_optimizer(cfg: CfgNode, model: torch.nn.Module, fused_sgd: bool = True) -> torch.optim.Optimizer:
    """The optimizer of one replica (ZeRO's sharded one: strategies/zero1.py); ``fused_sgd`` False:
    SGD's multi-tensor kernels (FSDP: torch has no sharding rule for the fused SGD kernel)."""
    cls, kwargs = optimizer_class(cfg, fused_sgd)
    return cls(param_groups(cfg, model), lr=cfg.OPTIM.BASE_LR, weight_decay=cfg.OPTIM.WEIGHT_DECAY, **kwargs)


def peak_lr(cfg: CfgNode, global_batch: int) -> float:
    """BASE_LR, or BASE_LR x global batch / REF_BATCH_SIZE under the linear scaling rule."""
    if cfg.OPTIM.LR_SCALING == "linear":
        return cfg.OPTIM.BASE_LR * global_batch / cfg.OPTIM.REF_BATCH_SIZE
    return cfg.OPTIM.BASE_LR


def lr_factor(cfg: CfgNode, epoch: float) -> float:
    """Multiplier of the peak LR at a fractional epoch: a linear warmup from WARMUP_FACTOR to exactly 1
    at warmup_epochs(cfg), then the policy. The cosine and linear decays run over the epochs after the
    warmup (timm's warmup_prefix), so the LR reaches the peak the run's header prints; multiplying
    the decay by the ramp (pycls, Distribuuuu) peaked below it: at 75% for 1 warmup epoch of 3."""
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

"""The non-finite guard (TRAIN.NONFINITE): what the step and the loop do beside their main path when
the loss or the gradients are not finite. The step and the loop call it; a first reader may skip it.

A skipped step leaves no trace: BatchNorm's buffers are restored from a copy taken before the
forward pass, and the optimizer, EMA and counters do not move. With torch's fused SGD/Adam/AdamW
and no fp16 the skip is decided on the device (optim.Stepper.on_device): the found-inf flag goes to
the fused kernel, buffers and EMA are selected with torch.where, and ``DeviceSkips`` counts skipped
steps on the device; the trainer reads the count at print steps, checkpoints and the epoch's end
(``reconcile``). Other optimizers and fp16 keep one host sync per step for the check
(docs/reliability.md has the whole design and its measurements).

Under fp16 a non-finite gradient is usually no failure: the GradScaler grows the loss scale every
2000 clean steps until the scaled gradients overflow, then skips that step and halves the scale.
Such a step counts as a step; it is a failure only when the loss itself is non-finite on some rank,
or the scale has fallen below ``FP16_MIN_LOSS_SCALE``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from yacs.config import CfgNode

from distribuuuu import models
from distribuuuu.errors import RunNotSaved, UserError
from distribuuuu.launch import comm

if TYPE_CHECKING:
    from distribuuuu.engine.trainer import Trainer
    from distribuuuu.optim import Stepper

log = logging.getLogger("distribuuuu")

# fp16: below this loss scale an overflow is a failure, not the GradScaler's normal probing (it
# starts at 2**16 and halves per overflow, so ~17 overflows in a row without a finite step get here):
# the gradients overflow fp16 even unscaled.
FP16_MIN_LOSS_SCALE = 1.0
SKIP_FIELDS = ("skips", "run", "longest", "tried", "good_before_over", "over")


class NonFiniteLoss(UserError, RuntimeError):
    """The loss or the gradients stayed non-finite (TRAIN.NONFINITE).

    A UserError: the cure is a setting (the LR, clipping) or the data, so every rank ends with one
    message and exit status 2, no traceback. The ranks agree on it (the step's vote, or the
    epoch's reduced loss), so none is left waiting; checkpoints and metrics so far stay.
    """


def nonfinite_advice(cfg: CfgNode) -> str:
    """What to change after non-finite numbers, and what is kept (the end of NonFiniteLoss's message)."""
    clip = ("lower TRAIN.CLIP_GRAD_NORM" if cfg.TRAIN.CLIP_GRAD_NORM > 0
            else "clip the gradients (e.g. TRAIN.CLIP_GRAD_NORM 1.0)")
    return (f"lower OPTIM.BASE_LR (now {cfg.OPTIM.BASE_LR:g}), {clip}, or check the data for bad values; "
            f"the checkpoints and metrics so far are kept in {cfg.OUT_DIR}")


# -- the step's side (optim.Stepper) ----------------------------------------------------------------
class DeviceSkips:
    """Since the host last read them (take): skipped steps, the current run of them, the longest run,
    steps tried, steps taken before the run first went past max_skips, and whether it did. On the
    device: counting costs a handful of tiny kernels and no host sync."""

    def __init__(self, cfg: CfgNode, device: torch.device) -> None:
        # Longest run of skipped steps allowed (stop: none); past it, the trainer ends the run.
        self.max_skips = 0 if cfg.TRAIN.NONFINITE == "stop" else cfg.TRAIN.NONFINITE_MAX_SKIPS
        self.v = torch.zeros(len(SKIP_FIELDS), dtype=torch.int64, device=device)

    def count(self, skipped: torch.Tensor) -> None:
        v, bad = self.v, skipped.to(torch.int64)
        v[0] += bad
        v[1] = (v[1] + 1) * bad  # the current run (0 after a step taken)
        v[2] = torch.maximum(v[2], v[1])
        v[3] += 1
        newly_over = (v[1] > self.max_skips) & (v[5] == 0)
        v[4] = torch.where(newly_over, v[3] - v[0], v[4])
        v[5] |= newly_over.to(torch.int64)

    def take(self) -> dict[str, int]:
        """SKIP_FIELDS since the last call: one host sync. The current run goes on across calls."""
        taken = dict(zip(SKIP_FIELDS, self.v.tolist()))
        run = self.v[1].clone()
        self.v.zero_()
        self.v[1] = self.v[2] = run
        return taken


def optimizers_of(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizer, and the local one ZeroRedundancyOptimizer wraps (it copies its groups' keys in)."""
    inner = getattr(optimizer, "optim", None)
    return [optimizer, *([inner] if isinstance(inner, torch.optim.Optimizer) else [])]


def momentum_unborn(optimizer: torch.optim.Optimizer) -> bool:
    """SGD with momentum before its buffers exist: the fused kernel would make them from this
    step's gradients even when found_inf skips it, so this step is checked on the host."""
    opt = optimizers_of(optimizer)[-1]  # ZeRO: the local optimizer holds the state
    return any(group.get("momentum", 0) and p.grad is not None and "momentum_buffer" not in (opt.state.get(p) or {})
               for group in opt.param_groups if "dampening" in group for p in group["params"])


@contextlib.contextmanager
def kernel_for_new_buffers(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Fused SGD makes momentum buffers only when no parameter has one: a step that gives some
    parameters their first (an unfrozen backbone, a parameter without a gradient so far) runs the
    multi-tensor kernel, which makes them from the gradients, and GradScaler's synced path."""
    unborn = momentum_unborn(optimizer)
    groups = [g for opt in optimizers_of(optimizer) for g in opt.param_groups if g.get("fused")] if unborn else []
    saved = [(g["fused"], g["foreach"]) for g in groups]
    amp = getattr(optimizer, "_step_supports_amp_scaling", None)
    for g in groups:
        g["fused"], g["foreach"] = False, True
    if groups:
        optimizer._step_supports_amp_scaling = False
    try:
        yield
    finally:
        for g, (fused, foreach) in zip(groups, saved):
            g["fused"], g["foreach"] = fused, foreach
        if groups:
            optimizer._step_supports_amp_scaling = amp


def ema_update_unless(ema: Any, model: torch.nn.Module, skipped: torch.Tensor) -> None:
    """timm's EMA update, kept as it was where ``skipped`` (no host sync)."""
    decay = ema.get_decay()
    with torch.no_grad():
        for e, m in zip(ema.module.state_dict().values(), models.unwrap(model).state_dict().values()):
            moved = e.lerp(m.to(e.dtype), 1.0 - decay) if e.is_floating_point() else m
            e.copy_(torch.where(skipped, e, moved))


def fp16_overflow(stepper: Stepper, loss_finite: torch.Tensor | None) -> bool:
    """fp16, after a non-finite gradient: was it the GradScaler's normal overflow?

    Every rank reaches this branch together (the gradients were averaged, or voted on under
    FSDP), so the loss vote below is a collective all ranks join; it runs on overflow steps only.
    """
    scaler = stepper.scaler
    if not scaler.is_enabled():
        return False
    loss_bad = loss_finite is not None and not bool(loss_finite)
    if comm.any_rank([loss_bad])[0] or scaler.get_scale() < FP16_MIN_LOSS_SCALE:
        return False
    stepper.overflows += 1
    log.info("fp16: gradients overflowed, the GradScaler skipped this step and lowered the loss "
             "scale to %g (normal: %d such steps so far)", scaler.get_scale(), stepper.overflows)
    return True


# -- the loop's side (engine.trainer.Trainer) -------------------------------------------------------
def _setting(cfg: CfgNode) -> str:
    return ("TRAIN.NONFINITE stop ends the run at the first one" if cfg.TRAIN.NONFINITE == "stop" else
            f"TRAIN.NONFINITE skip allows NONFINITE_MAX_SKIPS {cfg.TRAIN.NONFINITE_MAX_SKIPS} in a row")


def on_skipped_step(trainer: Trainer) -> None:
    """A step skipped on every rank for non-finite numbers (host-checked): within TRAIN.NONFINITE's
    limits, or the end of the run."""
    cfg, state = trainer.cfg, trainer.state
    state.bad_steps += 1
    trainer.epoch_skips += 1
    if cfg.TRAIN.NONFINITE == "stop" or state.bad_steps > cfg.TRAIN.NONFINITE_MAX_SKIPS:
        raise NonFiniteLoss(f"non-finite loss or gradients at step {state.global_step + 1} "
                            f"({state.bad_steps} in a row; {_setting(cfg)}); {nonfinite_advice(cfg)}")
    log.warning("non-finite loss or gradients: step skipped on every rank (%d in a row, at most %d)",
                state.bad_steps, cfg.TRAIN.NONFINITE_MAX_SKIPS)


def reconcile(trainer: Trainer) -> None:
    """Read the stepper's device count of skipped steps (one host sync: print steps, checkpoints,
    the epoch's end): global_step stops counting them, and TRAIN.NONFINITE's limits apply. Every
    rank skipped the same steps (the flag was averaged or reduced) and reads at the same
    iteration, so all raise NonFiniteLoss together."""
    cfg, state, stepper = trainer.cfg, trainer.state, trainer.stepper
    if not stepper.on_device:
        return
    v = stepper.skips.take()
    start = state.global_step - v["tried"]  # exact: the step count at the previous reading
    state.global_step -= v["skips"]
    state.bad_steps = v["run"]
    trainer.epoch_skips += v["skips"]
    if v["over"]:  # the message the synced check gives at that step
        raise NonFiniteLoss(f"non-finite loss or gradients at step {start + v['good_before_over'] + 1} "
                            f"({stepper.skips.max_skips + 1} in a row; {_setting(cfg)}); {nonfinite_advice(cfg)}")
    if v["skips"]:
        log.warning("non-finite loss or gradients: step skipped on every rank (%d in a row, at most %d; %d "
                    "skipped after step %d)", v["longest"], cfg.TRAIN.NONFINITE_MAX_SKIPS, v["skips"], start)


def require_saved(trainer: Trainer) -> None:
    """A run that could not save is not done: the last checkpoint refused (non-finite weights or
    buffers at the end), or none written of those due. Collective (rank 0 knows): all ranks raise."""
    saves = trainer.saves
    last, none = comm.any_rank([bool(saves["last_refused"]), bool(saves["refused"]) and not saves["written"]])
    if last or none:
        why = ("the weights or buffers are not finite at the end" if last else
               "none of the checkpoints due was written (the weights were not finite each time)")
        raise RunNotSaved(f"the run could not save: {why}; no usable checkpoint of it is in "
                          f"{trainer.run.checkpoints}; {nonfinite_advice(trainer.cfg)}")

"""The non-finite guard (TRAIN.NONFINITE): the tail of an optimizer
step, which skips a step whose loss or gradients are not finite without
a trace, and ends a run of such steps.

The Stepper (optim.py) owns one guard, made by ``guard_for``, and calls
it twice per optimizer step: ``before_forward`` (a copy of what a
forward pass writes: BatchNorm's statistics) and ``step`` (the optimizer
step and the EMA, unless the gradients are not finite). The loop calls
``settle`` where it needs the exact count of skipped steps (print steps,
checkpoints, an epoch's end), ``saved`` after each checkpoint and
``require_saved`` at the end. The three guards, chosen once per run:

- ``Unguarded`` (TRAIN.NONFINITE off): every step is taken; only each
  epoch's loss is checked (engine/hooks.py NonFiniteEpochCheck).
- ``OnDevice`` (skip/stop with torch's fused SGD/Adam/AdamW, no fp16):
  the found-inf flag goes to the fused kernel, buffers and EMA are
  selected with torch.where, skipped steps are counted on the device: a
  step costs no host sync.
- ``Synced`` (fp16, timm's optimizers): one host sync per step decides.
  Under fp16 a non-finite gradient is usually no failure: the GradScaler
  grows the loss scale until the scaled gradients overflow, then skips
  that step and halves the scale; it counts as a failure only when the
  loss itself is not finite on some rank, or the scale fell below
  FP16_MIN_LOSS_SCALE.

A skipped step is still a step of the schedule: global_step counts it,
as timm's update count and Lightning's global_step count a step the
GradScaler skipped; the epoch's train record says how many were skipped.
docs/reliability.md has the design and its measurements.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from yacs.config import CfgNode

from distribuuuu import models
from distribuuuu.errors import RunNotSaved, UserError
from distribuuuu.launch import comm

log = logging.getLogger("distribuuuu")

# fp16: below this loss scale an overflow is a failure, not the
# GradScaler's normal probing (it starts at 2**16 and halves per
# overflow, so ~17 overflows in a row without a finite step get here).
FP16_MIN_LOSS_SCALE = 1.0


class NonFiniteLoss(UserError, RuntimeError):
    """The loss or the gradients stayed non-finite (TRAIN.NONFINITE).

    A UserError: the cure is a setting (the LR, clipping) or the data,
    so every rank ends with one message and exit status 2, no traceback.
    The ranks agree on it (the gradients are averaged, the epoch's loss
    reduced), so none is left waiting; checkpoints and metrics so far
    stay.
    """


def advice(cfg: CfgNode) -> str:
    """What to change after non-finite numbers, and what is kept (the
    end of NonFiniteLoss's message)."""
    clip = (
        "lower TRAIN.CLIP_GRAD_NORM"
        if cfg.TRAIN.CLIP_GRAD_NORM > 0
        else "clip the gradients (e.g. TRAIN.CLIP_GRAD_NORM 1.0)"
    )
    return (
        f"lower OPTIM.BASE_LR (now {cfg.OPTIM.BASE_LR:g}), {clip}, or check the data for bad "
        f"values; the checkpoints and metrics so far are kept in {cfg.OUT_DIR}"
    )


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """0-d bool tensor, no host sync yet: every value of the
    floating-point tensors is finite (their 2-norm is non-finite iff
    some value is; torch's multi-tensor kernels compute it)."""
    floats = [t for t in tensors if t.is_floating_point()]
    return torch.isfinite(torch.nn.utils.get_total_norm(floats, foreach=True))


def grads_finite(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """0-d bool tensor, no host sync yet: every gradient of params is
    finite."""
    return torch.isfinite(
        torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)
    )


def optimizers_of(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizer, and the local one ZeroRedundancyOptimizer wraps
    (it copies its groups' keys in)."""
    inner = getattr(optimizer, "optim", None)
    return [optimizer, *([inner] if isinstance(inner, torch.optim.Optimizer) else [])]


def guard_for(
    cfg: CfgNode,
    device: torch.device,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    ema: Any,
    grads_finite: Callable[[], torch.Tensor],
) -> Unguarded:
    """The guard of this run (module docstring), decided once."""
    if cfg.TRAIN.NONFINITE == "off":
        return Unguarded(cfg, device, model, optimizer, scaler, ema)
    fused = getattr(optimizer, "_step_supports_amp_scaling", False)
    on_device = fused and not scaler.is_enabled()
    return (OnDevice if on_device else Synced)(
        cfg, device, model, optimizer, scaler, ema, grads_finite
    )


class Unguarded:
    """TRAIN.NONFINITE off: the plain optimizer step. Also keeps the
    checkpoint writes, read at the end."""

    def __init__(
        self,
        cfg: CfgNode,
        device: torch.device,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        ema: Any,
    ) -> None:
        self.cfg, self.model, self.optimizer, self.scaler, self.ema = (
            cfg,
            model,
            optimizer,
            scaler,
            ema,
        )
        self.saves = {"written": 0, "refused": 0, "last_refused": False}
        self.epoch_skips = 0  # steps skipped in the epoch so far, known after settle()
        self.overflows = 0  # fp16 steps the GradScaler skipped (logged, not failures)

    def before_forward(self) -> None:
        """Before an optimizer step's first forward pass."""

    def step(self, norm: torch.Tensor | None) -> None:
        """The optimizer step (and the EMA's); ``norm``: the clipped
        gradients' total norm, if clipped."""
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.ema is not None:
            self.ema.update(models.unwrap(self.model))

    def settle(self, step: int) -> int:
        """The steps skipped since the last call, exact (``step``: the
        loop's global_step now)."""
        return 0

    def take_epoch_skips(self) -> int:
        skips, self.epoch_skips = self.epoch_skips, 0
        return skips

    def saved(self, finite: bool) -> None:
        """Rank 0: a checkpoint due was written (finite weights) or
        refused."""
        self.saves["written" if finite else "refused"] += 1
        self.saves["last_refused"] = not finite

    def require_saved(self, folder: str) -> None:
        """A run that could not save is not done: the last checkpoint
        refused (non-finite weights or buffers at the end), or none
        written of those due. Collective (rank 0 knows): all ranks
        raise."""
        s = self.saves
        last, none = comm.max_over_ranks([s["last_refused"], s["refused"] > 0 and not s["written"]])
        if last or none:
            why = (
                "the weights or buffers are not finite at the end"
                if last
                else "none of the checkpoints due was written (the weights were not finite each "
                "time)"
            )
            raise RunNotSaved(
                f"the run could not save: {why}; no usable checkpoint of it is in {folder}; "
                f"{advice(self.cfg)}"
            )


# Device counts since the last settle: skipped steps, the current run of
# them, the longest run, steps tried, and the tried index (1-based) at
# which the run first went past the limit (0: never).
_SKIPS, _RUN, _LONGEST, _TRIED, _OVER = range(5)


class Synced(Unguarded):
    """TRAIN.NONFINITE skip/stop with one host sync per step (fp16, or
    an optimizer without a fused kernel)."""

    def __init__(
        self,
        cfg: CfgNode,
        device: torch.device,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        ema: Any,
        grads_finite: Callable[[], torch.Tensor],
    ) -> None:
        super().__init__(cfg, device, model, optimizer, scaler, ema)
        self.grads_finite = grads_finite
        # Longest run of skipped steps allowed (stop: none); past it,
        # settle() ends the run.
        self.max_skips = 0 if cfg.TRAIN.NONFINITE == "stop" else cfg.TRAIN.NONFINITE_MAX_SKIPS
        self.counts = torch.zeros(
            5, dtype=torch.int64, device=device if self.on_device() else "cpu"
        )
        # BatchNorm's running statistics (and any buffer a forward pass
        # writes), and their copy from before this step's first forward
        # pass: a skipped step puts them back.
        self.buffers = [b for b in model.buffers() if b.numel()]
        self.copies = [torch.empty_like(b) for b in self.buffers]
        self.loss_finite: torch.Tensor | None = (
            None  # fp16: every micro-batch loss of this step finite
        )

    @staticmethod
    def on_device() -> bool:
        return False

    def before_forward(self) -> None:
        if self.buffers:
            torch._foreach_copy_(self.copies, self.buffers)

    def watch_loss(self, loss: torch.Tensor) -> None:
        """fp16, each micro-batch: whether its loss is finite (a
        non-finite gradient with finite losses is the GradScaler's
        normal overflow); on the device, no sync."""
        ok = torch.isfinite(loss.detach())
        self.loss_finite = ok if self.loss_finite is None else self.loss_finite & ok

    def step(self, norm: torch.Tensor | None) -> None:
        loss_finite, self.loss_finite = self.loss_finite, None
        finite = bool(
            torch.isfinite(norm) if norm is not None else self.grads_finite()
        )  # the host sync
        if finite:
            super().step(norm)
        else:  # the forward pass never happened: its buffers back; fp16: a smaller loss scale next
            for b, copy in zip(self.buffers, self.copies):
                b.copy_(copy)
            self.scaler.update()
        self.count(torch.tensor(not finite and not self._fp16_overflow(loss_finite)))

    def _fp16_overflow(self, loss_finite: torch.Tensor | None) -> bool:
        """fp16, after a non-finite gradient: was it the GradScaler's
        normal overflow? Every rank gets here together (the gradients
        were averaged), so the loss vote is a collective all ranks join."""
        if not self.scaler.is_enabled():
            return False
        loss_bad = loss_finite is not None and not bool(loss_finite)
        if comm.max_over_ranks([loss_bad])[0] or self.scaler.get_scale() < FP16_MIN_LOSS_SCALE:
            return False
        self.overflows += 1
        log.info(
            "fp16: gradients overflowed, the GradScaler skipped this step and lowered the loss "
            "scale to %g (normal: %d such steps so far)",
            self.scaler.get_scale(),
            self.overflows,
        )
        return True

    def count(self, skipped: torch.Tensor) -> None:
        """A handful of tiny kernels on the device: no host sync."""
        c, bad = self.counts, skipped.to(self.counts.device, torch.int64)
        c[_SKIPS] += bad
        c[_TRIED] += 1
        c[_RUN] = (c[_RUN] + 1) * bad  # 0 after a step taken
        c[_LONGEST] = torch.maximum(c[_LONGEST], c[_RUN])
        c[_OVER] = torch.where((c[_RUN] > self.max_skips) & (c[_OVER] == 0), c[_TRIED], c[_OVER])

    def settle(self, step: int) -> int:
        """One host sync. Every rank skipped the same steps (the flag
        was averaged or reduced) and settles at the same step, so all
        raise NonFiniteLoss together."""
        skips, run, longest, tried, over = self.counts.tolist()
        self.counts.zero_()
        self.counts[_RUN] = self.counts[_LONGEST] = (
            run  # a run of skipped steps goes on across calls
        )
        self.epoch_skips += skips
        if over:
            setting = (
                "TRAIN.NONFINITE stop ends the run at the first one"
                if self.cfg.TRAIN.NONFINITE == "stop"
                else f"TRAIN.NONFINITE skip allows NONFINITE_MAX_SKIPS {self.max_skips} in a row"
            )
            raise NonFiniteLoss(
                f"non-finite loss or gradients at step {step - tried + over} ({self.max_skips + 1} "
                f"in a row; {setting}); {advice(self.cfg)}"
            )
        if skips:
            log.warning(
                "non-finite loss or gradients: step skipped on every rank (%d in a row, at most "
                "%d; %d skipped before step %d)",
                longest,
                self.max_skips,
                skips,
                step,
            )
        return skips


class OnDevice(Synced):
    """TRAIN.NONFINITE skip/stop decided on the device (torch's fused
    SGD/Adam/AdamW, no fp16)."""

    @staticmethod
    def on_device() -> bool:
        return True

    def step(self, norm: torch.Tensor | None) -> None:
        finite = torch.isfinite(norm) if norm is not None else self.grads_finite()
        skipped = ~finite.to(self.counts.device).reshape(())
        opt = self.optimizer
        opt.grad_scale, opt.found_inf = (
            None,
            skipped.to(torch.float32),
        )  # the fused kernel skips on found_inf
        try:
            opt.step()
        finally:
            del opt.grad_scale, opt.found_inf
        for b, copy in zip(self.buffers, self.copies):
            b.copy_(torch.where(skipped, copy, b))
        if self.ema is not None:
            _ema_update_unless(self.ema, self.model, skipped)
        self.count(skipped)


def prime_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Fused SGD's momentum buffers made as zeros before the first step
    (and after a checkpoint is loaded).

    torch's fused SGD makes them at its first step, even one that
    found_inf skips (then from uninitialised memory), and refuses a step
    where some parameters have one and others not (a backbone unfrozen
    later). A zero buffer gives exactly torch's first step: momentum x 0
    + gradient (DAMPENING 0; other dampening runs the multi-tensor
    kernel, optim.optimizer_class)."""
    opt = optimizers_of(optimizer)[-1]  # ZeRO: the local optimizer holds the state
    for group in opt.param_groups:
        if group.get("fused") and group.get("momentum") and "dampening" in group:
            for p in group["params"]:
                if opt.state[p].get("momentum_buffer") is None:
                    opt.state[p]["momentum_buffer"] = torch.zeros_like(p)


def _ema_update_unless(ema: Any, model: torch.nn.Module, skipped: torch.Tensor) -> None:
    """timm's EMA update, kept as it was where ``skipped`` (no host
    sync)."""
    decay = ema.get_decay()
    with torch.no_grad():
        for e, m in zip(
            ema.module.state_dict().values(), models.unwrap(model).state_dict().values()
        ):
            moved = e.lerp(m.to(e.dtype), 1.0 - decay) if e.is_floating_point() else m
            e.copy_(torch.where(skipped, e, moved))

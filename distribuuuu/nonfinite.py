"""The non-finite guard (TRAIN.NONFINITE): the tail of an optimizer
step, which skips a step whose loss or gradients are not finite without
a trace, and ends a run of such steps.

The Stepper (optim.py) owns one guard, made by ``guard_for``, and calls
it twice per optimizer step: ``before_forward`` (a copy of what a
forward pass writes: BatchNorm's statistics) and ``step`` (the optimizer
step and the EMA, unless the gradients are not finite). ``settle`` gives
the exact count of skipped steps where the loop needs it (print steps,
checkpoints, an epoch's end). The guards:

- ``Unguarded`` (TRAIN.NONFINITE off): every step is taken; only each
  epoch's loss is checked (engine/hooks.py NonFiniteEpochCheck).
- ``OnDevice`` (skip/stop with torch's fused SGD/Adam/AdamW, no fp16):
  the found-inf flag goes to the fused kernel, buffers and EMA are
  selected with torch.where, and each step's flag is kept on the
  device until settle: a step costs no host sync.
- ``Synced`` (fp16, timm's optimizers): one host sync per step decides.
  Under fp16 a non-finite gradient is usually no failure: the
  GradScaler skips that step and lowers the scale; it counts as a
  failure only when the loss itself is not finite on some rank, or the
  scale fell below FP16_MIN_LOSS_SCALE.

A skipped step is still a step of the schedule: global_step counts it,
as timm's update count and Lightning's global_step count a step the
GradScaler skipped. docs/reliability.md has the design and its
measurements.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from yacs.config import CfgNode

from distribuuuu import models
from distribuuuu.errors import UserError
from distribuuuu.launch import comm

log = logging.getLogger("distribuuuu")

# fp16: below this loss scale an overflow is a failure, not the
# GradScaler's normal probing (it starts at 2**16 and halves per
# overflow: ~17 overflows in a row without a finite step get here).
FP16_MIN_LOSS_SCALE = 1.0


class NonFiniteLoss(UserError, RuntimeError):
    """The loss or the gradients stayed non-finite (TRAIN.NONFINITE).

    A UserError: the cure is a setting (the LR, clipping) or the data,
    so every rank ends with one message and exit status 2. The ranks
    agree on it (the gradients are averaged, the epoch's loss reduced),
    so none is left waiting; checkpoints and metrics so far stay.
    """


class NonFiniteWeights(NonFiniteLoss):
    """A checkpoint is due and a weight or buffer is not finite: one
    sample of extreme values overflows a BatchNorm statistic while the
    loss and the gradients stay finite. It stays so (inf x momentum is
    inf), and every later checkpoint would be refused: the run ends at
    this one instead of training on with nothing saved."""


def advice(cfg: CfgNode) -> str:
    """What to change after non-finite numbers, and what is kept (the
    end of NonFiniteLoss's message)."""
    clip = "clip the gradients (e.g. TRAIN.CLIP_GRAD_NORM 1.0)"
    if cfg.TRAIN.CLIP_GRAD_NORM > 0:
        clip = "lower TRAIN.CLIP_GRAD_NORM"
    return (
        f"lower OPTIM.BASE_LR (now {cfg.OPTIM.BASE_LR:g}), {clip}, or check the data for bad "
        f"values; {kept(cfg)}"
    )


def kept(cfg: CfgNode) -> str:
    """What stays after a run ends on numbers that are not finite."""
    return f"the checkpoints and metrics so far are kept in {cfg.OUT_DIR}"


def not_finite_weights(
    cfg: CfgNode, model: torch.nn.Module, step: int, epoch: int
) -> NonFiniteWeights:
    """Collective: the error naming the first weight or buffer of model
    that is not finite on any rank (its shard, under FSDP)."""
    hits = [hit for hit in comm.all_gather_object(_first_not_finite(model)) if hit]
    name, value = hits[0] if hits else ("a weight or buffer", "not finite")
    why = advice(cfg)
    if name in dict(model.named_buffers()):
        why = (
            "a statistic of the data the forward pass keeps (BatchNorm's), which one batch of "
            "extreme values (a sample of 1e20, say) overflows though the loss stays finite: check "
            f"the data for extreme values; {kept(cfg)}"
        )
    return NonFiniteWeights(
        f"the weights are not finite at step {step} (epoch {epoch}): {name} ({value}); no "
        f"checkpoint of them is written, nor would a later one be, so the run ends here; {why}"
    )


def _first_not_finite(model: torch.nn.Module) -> tuple[str, str] | None:
    """(name, 'inf' or 'nan') of this rank's first weight or buffer that
    is not finite, None when all are."""
    for name, tensor in model.state_dict().items():
        values = local_tensor(tensor)
        if values.is_floating_point() and not bool(torch.isfinite(values).all()):
            value = "nan" if bool(values.isnan().any()) else "inf"
            return name, value
    return None


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """0-d bool tensor, no host sync yet: every value of the floating
    point tensors is finite (their 2-norm is non-finite iff one is)."""
    floats = [t for t in tensors if t.is_floating_point()]
    return torch.isfinite(torch.nn.utils.get_total_norm(floats, foreach=True))


def grads_finite(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """0-d bool tensor, no host sync yet: every gradient is finite."""
    grads = [p.grad for p in params if p.grad is not None]
    return torch.isfinite(torch.nn.utils.get_total_norm(grads, foreach=True))


def optimizers_of(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizer, and the local one ZeroRedundancyOptimizer wraps."""
    inner = getattr(optimizer, "optim", None)
    return [optimizer, *([inner] if isinstance(inner, torch.optim.Optimizer) else [])]


def guard_for(
    cfg: CfgNode,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    ema: Any,
    grads_finite: Callable[[], torch.Tensor],
) -> Guard:
    """The guard of this run (module docstring), decided once."""
    if cfg.TRAIN.NONFINITE == "off":
        return Unguarded(cfg, model, optimizer, scaler, ema)
    fused = getattr(optimizer, "_step_supports_amp_scaling", False)
    guard = OnDevice if fused and not scaler.is_enabled() else Synced
    return guard(cfg, model, optimizer, scaler, ema, grads_finite)


class Guard:
    """What every guard does: the optimizer step and the EMA's; the
    variants decide when a step is skipped."""

    def __init__(
        self,
        cfg: CfgNode,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        ema: Any,
    ) -> None:
        self.cfg, self.model, self.optimizer = cfg, model, optimizer
        self.scaler, self.ema = scaler, ema
        self.epoch_skips = 0  # steps skipped in the epoch so far, known after settle()

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


class Unguarded(Guard):
    """TRAIN.NONFINITE off: the plain optimizer step."""


class Synced(Guard):
    """TRAIN.NONFINITE skip/stop with one host sync per step (fp16, or an
    optimizer without a fused kernel)."""

    def __init__(
        self,
        cfg: CfgNode,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        ema: Any,
        grads_finite: Callable[[], torch.Tensor],
    ) -> None:
        super().__init__(cfg, model, optimizer, scaler, ema)
        self.grads_finite = grads_finite
        # The longest run of skipped steps allowed (stop: none); past it,
        # settle() ends the run.
        self.max_skips = 0 if cfg.TRAIN.NONFINITE == "stop" else cfg.TRAIN.NONFINITE_MAX_SKIPS
        self.skipped: list[torch.Tensor | bool] = []  # each step's, since the last settle
        self.run = 0  # skipped steps in a row, across settles
        # BatchNorm's running statistics (and any buffer a forward pass
        # writes), and their copy from before this step's first forward
        # pass: a skipped step puts them back.
        self.buffers = [b for b in model.buffers() if b.numel()]
        self.copies = [torch.empty_like(b) for b in self.buffers]
        self.loss_finite: torch.Tensor | None = None  # fp16: every micro-batch's loss finite
        self.overflows = 0  # fp16 steps the GradScaler skipped (logged, not failures)

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
        finite = bool(torch.isfinite(norm) if norm is not None else self.grads_finite())  # the sync
        if finite:
            super().step(norm)
            self.skipped.append(False)
            return
        # The forward pass never happened: its buffers back; fp16: a smaller scale next.
        for b, copy in zip(self.buffers, self.copies):
            b.copy_(copy)
        self.scaler.update()
        self.skipped.append(not self._fp16_overflow(loss_finite))

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

    def settle(self, step: int) -> int:
        """One host sync. Every rank skipped the same steps (the flag was
        averaged or reduced) and settles at the same step, so all raise
        NonFiniteLoss together."""
        flags = self.skipped  # Synced's: bools already
        if flags and isinstance(flags[0], torch.Tensor):
            flags = torch.stack(flags).tolist()  # OnDevice's: one sync for all
        self.skipped = []
        first = step - len(flags) + 1  # the step of flags[0]
        longest = self.run
        for i, bad in enumerate(flags):
            self.run = self.run + 1 if bad else 0
            longest = max(longest, self.run)
            if self.run > self.max_skips:
                raise NonFiniteLoss(self._past_the_limit(first + i))
        skips = sum(flags)
        self.epoch_skips += skips
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

    def _past_the_limit(self, step: int) -> str:
        setting = f"TRAIN.NONFINITE skip allows NONFINITE_MAX_SKIPS {self.max_skips} in a row"
        if self.cfg.TRAIN.NONFINITE == "stop":
            setting = "TRAIN.NONFINITE stop ends the run at the first one"
        return (
            f"non-finite loss or gradients at step {step} ({self.max_skips + 1} in a row; "
            f"{setting}); {advice(self.cfg)}"
        )


class OnDevice(Synced):
    """TRAIN.NONFINITE skip/stop decided on the device (torch's fused
    SGD/Adam/AdamW, no fp16): no host sync until settle."""

    def step(self, norm: torch.Tensor | None) -> None:
        finite = torch.isfinite(norm) if norm is not None else self.grads_finite()
        skipped = ~finite
        self.optimizer.found_inf = skipped.float()  # as the GradScaler sets it: the kernel skips
        self.optimizer.step()
        for b, copy in zip(self.buffers, self.copies):
            b.copy_(torch.where(skipped, copy, b))
        if self.ema is not None:
            _ema_update_unless(self.ema, self.model, skipped)
        self.skipped.append(skipped)


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
    """timm's EMA update, kept as it was where ``skipped`` (no host sync)."""
    decay = ema.get_decay()
    with torch.no_grad():
        pairs = zip(ema.module.state_dict().values(), models.unwrap(model).state_dict().values())
        for e, m in pairs:
            moved = e.lerp(m.to(e.dtype), 1.0 - decay) if e.is_floating_point() else m
            e.copy_(torch.where(skipped, e, moved))

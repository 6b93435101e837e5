"""One optimizer step made of TRAIN.ACCUM_STEPS micro-batches.

Everything between "a batch arrived" and "the weights moved" lives here, in this order:
mixup/cutmix -> channels_last -> autocast forward and loss -> (scaled) backward, under the
strategy's no_sync for all but the last micro-batch -> unscale -> gradient clipping -> non-finite check ->
optimizer step -> EMA update. The engine calls ``micro_step`` once per batch. What differs
between the ways of training (the no-sync context, the gradient check under sharding) is asked
of the Strategy.

A skipped step leaves no trace: BatchNorm's buffers are restored from a copy taken before the
forward pass, and the optimizer, EMA and counters do not move. With torch's fused SGD/Adam/AdamW
(optim.FUSED) and no fp16, the skip is decided on the device: the found-inf flag goes to the
optimizer as GradScaler hands it (``found_inf``: the fused kernel skips the update and the step
count), buffers and EMA are selected with it (torch.where), and a device counter of skipped steps
is read by the trainer at print steps, checkpoints and the epoch's end (``take_skips``). Other
optimizers (LAMB, LARS, ZeRO's wrapper) and fp16 keep one host sync per step for the check, as does
fused SGD's first step with momentum (its kernel would make the momentum buffers from a skipped step).

Under fp16 a non-finite gradient is usually no failure: the GradScaler grows the loss scale every
2000 clean steps until the scaled gradients overflow, then skips that step and halves the scale.
Such a step counts as a step (as it does with TRAIN.NONFINITE off); it is a failure only when the
loss itself is non-finite on some rank, or the scale has fallen below ``FP16_MIN_LOSS_SCALE``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from timm.utils import ModelEmaV3
from yacs.config import CfgNode

from distribuuuu import models
from distribuuuu.launch import comm
from distribuuuu.strategies import AMP_DTYPES, Strategy, local_tensor

log = logging.getLogger("distribuuuu")

SKIP_FIELDS = ("skips", "run", "longest", "tried", "good_before_over", "over")
__all__ = ["AMP_DTYPES", "SKIP_FIELDS", "FP16_MIN_LOSS_SCALE", "MicroStep", "Stepper", "ema_decay_per_step"]
# fp16: below this loss scale an overflow is a failure, not the GradScaler's normal probing (it
# starts at 2**16 and halves per overflow, so ~17 overflows in a row without a finite step get here):
# the gradients overflow fp16 even unscaled.
FP16_MIN_LOSS_SCALE = 1.0


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
        # The skip decided on the device (module docstring); else one host sync per step.
        self.on_device = (self.check_finite and not self.scaler.is_enabled()
                          and getattr(optimizer, "_step_supports_amp_scaling", False))
        # BatchNorm's running statistics (and any buffer a forward pass writes), and their copy from
        # before this step's first forward pass: a skipped step puts them back.
        self.buffers = [b for b in model.buffers() if b.numel()] if self.check_finite else []
        self.saved_buffers = [torch.empty_like(b) for b in self.buffers]
        # Longest run of skipped steps allowed (stop: none); past it, the trainer ends the run.
        self.max_skips = 0 if t.NONFINITE == "stop" else t.NONFINITE_MAX_SKIPS
        # Since the host last read it (take_skips): skipped steps, the current run of them, the longest
        # run, steps tried, steps taken before the run first went past max_skips, and whether it did.
        self.skips = torch.zeros(len(SKIP_FIELDS), dtype=torch.int64, device=device)
        # The kernels optim built (fused or multi-tensor): a checkpoint's param groups bring theirs back.
        self.kernels = [(g.get("fused"), g.get("foreach")) for opt in self._optimizers() for g in opt.param_groups]

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
        if self.on_device and not self._momentum_unborn():
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

    def _momentum_unborn(self) -> bool:
        """SGD with momentum before its buffers exist: the fused kernel would make them from this
        step's gradients even when found_inf skips it, so this step is checked on the host."""
        opt = self._optimizers()[-1]  # ZeRO: the local optimizer holds the state
        return any(group.get("momentum", 0) and p.grad is not None and "momentum_buffer" not in (opt.state.get(p) or {})
                   for group in opt.param_groups if "dampening" in group for p in group["params"])

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizer, and the local one ZeroRedundancyOptimizer wraps (it copies its groups' keys in)."""
        inner = getattr(self.optimizer, "optim", None)
        return [self.optimizer, *([inner] if isinstance(inner, torch.optim.Optimizer) else [])]

    @contextlib.contextmanager
    def _kernel_for_new_buffers(self) -> Iterator[None]:
        """Fused SGD makes momentum buffers only when no parameter has one: a step that gives some
        parameters their first (an unfrozen backbone, a parameter without a gradient so far) runs the
        multi-tensor kernel, which makes them from the gradients, and GradScaler's synced path."""
        unborn = self._momentum_unborn()
        groups = [g for opt in self._optimizers() for g in opt.param_groups if g.get("fused")] if unborn else []
        saved = [(g["fused"], g["foreach"]) for g in groups]
        amp = getattr(self.optimizer, "_step_supports_amp_scaling", None)
        for g in groups:
            g["fused"], g["foreach"] = False, True
        if groups:
            self.optimizer._step_supports_amp_scaling = False
        try:
            yield
        finally:
            for g, (fused, foreach) in zip(groups, saved):
                g["fused"], g["foreach"] = fused, foreach
            if groups:
                self.optimizer._step_supports_amp_scaling = amp

    def _step_on_device(self) -> torch.Tensor:
        """Step with the skip decided on the device; returns the 0-d bool 'skipped' flag."""
        finite = self._finite()
        skipped = ~torch.as_tensor(finite, device=self.device).reshape(())
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
            self._ema_update(skipped)
        self._count_skip(skipped)
        return skipped

    def _count_skip(self, skipped: torch.Tensor) -> None:
        """The device counters of SKIP_FIELDS, a handful of tiny kernels and no host sync."""
        v, bad = self.skips, skipped.to(torch.int64)
        v[0] += bad
        v[1] = (v[1] + 1) * bad  # the current run (0 after a step taken)
        v[2] = torch.maximum(v[2], v[1])
        v[3] += 1
        newly_over = (v[1] > self.max_skips) & (v[5] == 0)
        v[4] = torch.where(newly_over, v[3] - v[0], v[4])
        v[5] |= newly_over.to(torch.int64)

    def _ema_update(self, skipped: torch.Tensor) -> None:
        """timm's EMA update, kept as it was where ``skipped`` (no host sync)."""
        decay = self.ema.get_decay()
        model = models.unwrap(self.model)
        with torch.no_grad():
            for e, m in zip(self.ema.module.state_dict().values(), model.state_dict().values()):
                moved = e.lerp(m.to(e.dtype), 1.0 - decay) if e.is_floating_point() else m
                e.copy_(torch.where(skipped, e, moved))

    def take_skips(self) -> dict[str, int]:
        """SKIP_FIELDS since the last call (all 0 off the device path): one host sync, at print
        steps, checkpoints and the epoch's end. The current run goes on across calls."""
        if not self.on_device:
            return dict.fromkeys(SKIP_FIELDS, 0)
        taken = dict(zip(SKIP_FIELDS, self.skips.tolist()))
        run = self.skips[1].clone()
        self.skips.zero_()
        self.skips[1] = self.skips[2] = run
        return taken

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
            return None if self._scaler_overflow(loss_finite) else False
        with self._kernel_for_new_buffers():
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
        """After the optimizer's state: the kernels stay those built now (a checkpoint from before
        the fused kernels would bring 'foreach' back, which takes no found_inf)."""
        groups = [g for opt in self._optimizers() for g in opt.param_groups]
        if len(groups) == len(self.kernels):
            for g, (fused, foreach) in zip(groups, self.kernels):
                g["fused"], g["foreach"] = fused, foreach
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None and "ema" in state:
            self.ema.load_state_dict(state["ema"])

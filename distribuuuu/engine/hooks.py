"""Hooks: what happens around the training loop, in small pieces a user can add to.

A hook subclasses ``HookBase`` and overrides some of its six methods; each gets the Trainer
(trainer.py), whose attributes it reads (and, for ``stop_reason``, writes). The call order:

    before_fit                    after the model, the data and a resume are ready
    for each epoch:
        before_epoch              the model is in train mode already: a hook may put parts of it in
                                  eval mode for the epoch (the built-in FreezeBackboneHook does)
        for each batch:
            after_step            after every micro-batch; ``trainer.step_out.stepped`` is None
                                  between optimizer steps under TRAIN.ACCUM_STEPS, True/False at a step
                                  (True with the skip decided on the device: ``step_out.skipped``
                                  holds its flag, and state.global_step is exact after each reading)
        after_epoch               ``trainer.train_metrics`` (reduced over ranks), state.epoch counts it;
                                  the built-in EvalHook evaluates here and calls
            after_eval            ``trainer.eval_records`` (``trainer.eval_split`` "val"; "test" once
                                  after the last epoch, for the checkpoint chosen by TRAIN.VAL_SPLIT)
    after_fit                     ``trainer.summary``

Each event runs the hooks in list order: the built-in ones (``default_hooks``), then TRAIN.HOOKS
("package.module:ClassName", made with no arguments), then those passed to ``fit``. Built-in, in order:
FreezeBackboneHook (only with TRAIN.FREEZE_BACKBONE_EPOCHS), EarlyStopHook (target / patience),
MetricsHook (metrics.jsonl / csv / TensorBoard), NonFiniteEpochCheck, EvalHook (evaluation on EVAL_PERIOD epochs), CheckpointHook (step / time / epoch / best checkpoints
and stop signals). So a user's after_epoch runs after the epoch's checkpoint.

Every rank runs every hook: a hook that does a collective (any_rank, a checkpoint) does it in the
same order everywhere. A hook that ends the run sets ``trainer.stop_reason`` from values that are
the same on every rank (reduced metrics, or an any_rank vote); the loop stops after that epoch.
"""

from __future__ import annotations

import importlib
import logging
import math
import time
from typing import TYPE_CHECKING, Any

from torch import nn
from yacs.config import CfgNode

from distribuuuu import heads, models
from distribuuuu.engine import evaluation
from distribuuuu.errors import UserError
from distribuuuu.launch import comm, signals
from distribuuuu.launch.signals import Preempted
from distribuuuu.logger import format_seconds
from distribuuuu.nonfinite import NonFiniteLoss, nonfinite_advice, reconcile

if TYPE_CHECKING:
    from distribuuuu.engine.trainer import Trainer

log = logging.getLogger("distribuuuu")

EVENTS = ("before_fit", "before_epoch", "after_step", "after_epoch", "after_eval", "after_fit")


class HookBase:
    """Override any of the events; the defaults do nothing. See the module docstring for the order."""

    def before_fit(self, trainer: Trainer) -> None:
        pass

    def before_epoch(self, trainer: Trainer) -> None:
        pass

    def after_step(self, trainer: Trainer) -> None:
        pass

    def after_epoch(self, trainer: Trainer) -> None:
        pass

    def after_eval(self, trainer: Trainer) -> None:
        pass

    def after_fit(self, trainer: Trainer) -> None:
        pass


def overrides(hook: Any, event: str) -> bool:
    """Whether the hook does something on event (the loop calls only those: no cost per batch otherwise)."""
    method = getattr(type(hook), event, None)
    return method is not None and method is not getattr(HookBase, event)


def from_config(cfg: CfgNode) -> list[HookBase]:
    """The hooks named in TRAIN.HOOKS ("package.module:ClassName"), each made with no arguments."""
    made = []
    for spec in cfg.TRAIN.get("HOOKS", []):
        module_name, _, class_name = spec.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), class_name) if class_name else None
        except (ImportError, AttributeError) as e:
            raise UserError(f"TRAIN.HOOKS: cannot import {spec} ({type(e).__name__}: {e}); give "
                            "'package.module:ClassName' of a module on the Python path") from None
        if cls is None:
            raise UserError(f"TRAIN.HOOKS: {spec} names no class; give 'package.module:ClassName'")
        made.append(cls())
    return made


def default_hooks(cfg: CfgNode) -> list[HookBase]:
    freeze = [FreezeBackboneHook(cfg)] if cfg.TRAIN.FREEZE_BACKBONE_EPOCHS else []
    return [*freeze, EarlyStopHook(), MetricsHook(), NonFiniteEpochCheck(), EvalHook(), CheckpointHook(cfg)]


class FreezeBackboneHook(HookBase):
    """TRAIN.FREEZE_BACKBONE_EPOCHS N: for the first N epochs (-1: all) the backbone, every parameter
    but the classifier (heads.py), gets no gradient (requires_grad False: no backward through it, no
    optimizer update, no weight decay) and its BatchNorm layers run in eval mode, so its statistics stay
    as loaded too (timm's freeze does the same); the head trains. Decided from the epoch alone, so a
    resumed run is frozen exactly when the uninterrupted run was. Under DDP the strategy sets
    find_unused_parameters (strategies/__init__.py's DDPStrategy): the frozen parameters are registered
    but get no gradient.
    """

    def __init__(self, cfg: CfgNode) -> None:
        self.epochs = cfg.TRAIN.FREEZE_BACKBONE_EPOCHS
        self.frozen: bool | None = None  # what the parameters are set to now (None: not set yet)

    def before_fit(self, trainer: Trainer) -> None:
        net = models.unwrap(trainer.model)
        self.backbone, head = heads.split_parameters(net)
        in_head = {id(m) for layer in heads.head_layers(net) for m in net.get_submodule(layer).modules()}
        self.norms = [m for m in net.modules()
                      if isinstance(m, nn.modules.batchnorm._BatchNorm) and id(m) not in in_head]
        until = "for good" if self.epochs < 0 else "for epoch 1" if self.epochs == 1 else f"for epochs 1-{self.epochs}"
        log.info("backbone frozen %s: %d parameter tensors and %d BatchNorm layers; the classifier %s (%d tensors) "
                 "trains", until, len(self.backbone), len(self.norms), heads.describe(net), len(head))

    def before_epoch(self, trainer: Trainer) -> None:
        frozen = self.epochs < 0 or trainer.state.epoch < self.epochs
        if frozen != self.frozen:
            for p in self.backbone:
                p.requires_grad_(not frozen)
            if self.frozen is not None or not frozen:
                log.info("epoch %d: backbone %s", trainer.state.epoch + 1, "frozen" if frozen else "unfrozen")
            self.frozen = frozen
        if frozen:  # after the trainer's model.train(): the statistics stay fixed this epoch
            for m in self.norms:
                m.eval()


class MetricsHook(HookBase):
    """Rank 0 appends the records to metrics.jsonl / metrics.csv and TensorBoard (run_folder/metrics_files.py),
    and every TRAIN.PRINT_FREQ iterations the printed numbers as TensorBoard scalars by global step."""

    def before_fit(self, trainer: Trainer) -> None:
        state = trainer.state  # a fresh start sets an earlier run's records aside; a resume repairs them
        self.writer = trainer.run.metrics(trainer.ctx.is_main, state.epoch if trainer.resumed else None,
                                          state.global_step)

    def after_step(self, trainer: Trainer) -> None:
        if trainer.step_scalars is not None:  # a print step of rank 0
            self.writer.write_step(trainer.state.global_step, trainer.step_scalars)

    def after_epoch(self, trainer: Trainer) -> None:
        state = trainer.state
        self.writer.write({"epoch": state.epoch, "split": "train", **trainer.train_metrics, "step": state.global_step})

    def after_eval(self, trainer: Trainer) -> None:
        for record in trainer.eval_records:
            self.writer.write(record)

    def after_fit(self, trainer: Trainer) -> None:
        self.writer.close()


class NonFiniteEpochCheck(HookBase):
    """TRAIN.NONFINITE off checks no step; the epoch's loss (reduced: the same on every rank) is
    checked, after its record and before a checkpoint of the broken weights could replace the last good one."""

    def after_epoch(self, trainer: Trainer) -> None:
        cfg, state, train = trainer.cfg, trainer.state, trainer.train_metrics
        if cfg.TRAIN.NONFINITE == "off" and train["n"] and not math.isfinite(train["loss"]):
            raise NonFiniteLoss(f"the training loss of epoch {state.epoch} (step {state.global_step}) is not "
                                "finite (TRAIN.NONFINITE off checks only each epoch's loss; skip or stop "
                                f"checks every step); {nonfinite_advice(cfg)}")


class EvalHook(HookBase):
    """Every TRAIN.EVAL_PERIOD epochs and after the last: evaluate (raw and EMA), then after_eval."""

    def after_epoch(self, trainer: Trainer) -> None:
        cfg, epoch = trainer.cfg, trainer.state.epoch
        trainer.is_best = False
        if epoch % cfg.TRAIN.EVAL_PERIOD and epoch != cfg.OPTIM.MAX_EPOCH:
            return
        try:
            evaluation.validate(trainer)
            trainer.call("after_eval")
        finally:
            trainer.strategy.release_eval()  # e.g. FSDP's replica: its GPU memory back to training


class EarlyStopHook(HookBase):
    """TRAIN.TARGET_TOP1 (stop once reached; its record gets time_to_target_s) and TRAIN.PATIENCE
    (stop after that many evaluations without a better TRAIN.BEST_METRIC)."""

    def after_eval(self, trainer: Trainer) -> None:
        cfg, state = trainer.cfg, trainer.state
        if trainer.eval_split != "val":
            return
        best_split = "val" if cfg.TRAIN.BEST_METRIC == "top1" else "val_ema"
        for record in trainer.eval_records:
            if record["split"] == best_split and cfg.TRAIN.TARGET_TOP1 and record["top1"] >= cfg.TRAIN.TARGET_TOP1:
                record["time_to_target_s"] = time.perf_counter() - trainer.wall_start
                trainer.stop_reason = (f"target top-1 {cfg.TRAIN.TARGET_TOP1:g}% reached after "
                                       f"{format_seconds(record['time_to_target_s'])}")
                return
        if cfg.TRAIN.PATIENCE and state.evals_since_best >= cfg.TRAIN.PATIENCE:
            trainer.stop_reason = f"early stop: no better {cfg.TRAIN.BEST_METRIC} in {cfg.TRAIN.PATIENCE} evaluations"


class CheckpointTimer:
    """Rank 0's clock for TRAIN.CKPT_PERIOD_MIN (the decision is then shared with max_over_ranks)."""

    def __init__(self, minutes: float) -> None:
        self.period_s, self.last = minutes * 60.0, time.monotonic()

    def due(self) -> bool:
        return self.period_s > 0 and time.monotonic() - self.last >= self.period_s

    def reset(self) -> None:
        self.last = time.monotonic()


def vote_period(cfg: CfgNode, world_size: int) -> int:
    """Optimizer steps between two stop/checkpoint votes: DIST.VOTE_PERIOD_STEPS, or with 0 (auto)
    every step up to 8 processes and every 10 beyond (a vote's latency grows with the processes)."""
    if cfg.DIST.VOTE_PERIOD_STEPS:
        return cfg.DIST.VOTE_PERIOD_STEPS
    return 1 if world_size <= 8 else 10


class CheckpointHook(HookBase):
    """Checkpoints by step (TRAIN.CKPT_PERIOD_STEPS), by time (CKPT_PERIOD_MIN), at each epoch's end
    (best.pth too), and the stop signals (preemption): one vote decides both, so they live together.

    A signal mid-epoch: a step checkpoint, then Preempted; at an epoch's last step: the epoch ends,
    its checkpoint is written, then Preempted.
    """

    def __init__(self, cfg: CfgNode) -> None:
        self.timer = CheckpointTimer(cfg.TRAIN.CKPT_PERIOD_MIN)

    def before_fit(self, trainer: Trainer) -> None:
        self.timer.reset()  # CKPT_PERIOD_MIN counts from the start of training, after setup and resume
        # The step of the last mid-epoch checkpoint (resumed: the one read): a skipped step leaves the
        # state as it was, so that step is not written again under the same name.
        self.saved_step = trainer.state.global_step if trainer.state.samples_in_epoch else -1

    def save(self, trainer: Trainer, **kwargs: Any) -> None:
        self.timer.reset()
        trainer.save(**kwargs)

    def after_step(self, trainer: Trainer) -> None:
        if trainer.step_out.stepped is None:  # not an optimizer-step boundary
            return
        cfg, ctx, state = trainer.cfg, trainer.ctx, trainer.state
        stop_signal = signals.stop_signal()
        by_steps = cfg.TRAIN.CKPT_PERIOD_STEPS and state.global_step % cfg.TRAIN.CKPT_PERIOD_STEPS == 0
        # One small all-reduce: all ranks must take the same decision (and stop for the same signal: the
        # highest number any rank got), or a collective would hang. Its latency grows with the ranks, so
        # they vote every vote_period() steps and at the epoch's end: a signal or a due time-based
        # checkpoint is acted on at the next vote.
        epoch_done = state.samples_in_epoch >= trainer.epoch_samples
        vote = state.global_step % vote_period(cfg, ctx.world_size) == 0 or epoch_done
        stop, by_time = comm.max_over_ranks([stop_signal or 0, ctx.is_main and self.timer.due()]) if vote else (0, 0)
        if (stop or by_steps or by_time) and not epoch_done:
            reconcile(trainer)  # the exact global_step (skipped steps on the device path): a host sync
            by_steps = cfg.TRAIN.CKPT_PERIOD_STEPS and state.global_step % cfg.TRAIN.CKPT_PERIOD_STEPS == 0
            if (stop or by_steps or by_time) and state.global_step != self.saved_step:
                self.saved_step = state.global_step
                self.save(trainer, train_sums=trainer.counter.sums_with_n())
        if stop and epoch_done:
            state.stop_signal = stop  # the epoch is complete: end it, then stop
        elif stop:
            raise Preempted(stop)

    def after_epoch(self, trainer: Trainer) -> None:
        self.save(trainer, is_best=trainer.is_best)
        if trainer.state.stop_signal:  # a preemption signal came at the epoch's last step
            raise Preempted(trainer.state.stop_signal)

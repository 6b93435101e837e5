"""Hooks: what happens around the training loop, in small pieces a user
can add to.

A hook subclasses ``HookBase`` and overrides some of its methods. Each
gets the Trainer (trainer.py: its attributes are read-only to hooks)
and what the event produced, as arguments:

    before_fit(trainer)               after the model, the data and a resume are ready
    for each epoch:
      before_epoch(trainer)           the model is in train mode already: a hook may put
                                      parts of it in eval mode (FreezeBackboneHook does)
      for each batch:
        after_step(trainer, step, printed)
                                      step: optim.MicroStep (logits, loss, target, last:
                                      the micro-batch that ended an optimizer step);
                                      printed: rank 0's printed numbers, else None
        after_print(trainer, printed) rank 0's printed numbers, on print steps only
      after_epoch(trainer, metrics)   the epoch's train metrics (reduced over ranks); the
                                      built-in EvalHook evaluates here and calls
        after_eval(trainer, split, records)
                                      "val" after an evaluation ("test" once after the
                                      last epoch); a record per model
    after_fit(trainer, summary)       the run's summary

Each event runs the hooks in list order: the built-in ones
(``default_hooks``, which says why each stands where it does), then
TRAIN.HOOKS ("package.module:ClassName", made with no arguments), then
those passed to ``fit``. So a user's after_epoch runs after the
epoch's checkpoint, and a user's after_fit sees the temperature in
best.pth.

A hook's own state goes into every checkpoint with
``trainer.remember(name, state)`` (plain Python values); after a resume
its before_fit finds it in ``trainer.state.hooks[name]``.

Every rank runs every hook: a hook that does a collective (a vote, a
checkpoint) does it in the same order everywhere. A hook ends the run
with ``trainer.stop(reason)``, from values that are the same on every
rank (reduced metrics, or a max_over_ranks vote); the loop stops after
that epoch.
"""

from __future__ import annotations

import importlib
import logging
import math
import time
from typing import Any, Protocol

from torch import nn
from yacs.config import CfgNode

from distribuuuu import calibration, heads, models, trackers
from distribuuuu.engine import evaluation
from distribuuuu.errors import UserError
from distribuuuu.launch import comm, signals
from distribuuuu.launch.signals import Preempted
from distribuuuu.logger import format_seconds
from distribuuuu.nonfinite import NonFiniteLoss, advice
from distribuuuu.optim import MicroStep

log = logging.getLogger("distribuuuu")

EVENTS = (
    "before_fit",
    "before_epoch",
    "after_step",
    "after_print",
    "after_epoch",
    "after_eval",
    "after_fit",
)


class Trainer(Protocol):
    """What hooks read of engine/trainer.py's Trainer (trainer.py imports
    this module, so its type is named here by what it offers)."""

    cfg: CfgNode
    ctx: Any  # launch.comm.DistContext
    state: Any  # trainer.TrainState
    folder: Any  # run_folder.RunFolder
    strategy: Any
    model: nn.Module
    stepper: Any  # optim.Stepper
    counter: Any  # evaluation.Counter of the running epoch
    card: Any  # model_card.ModelCard
    val_loader: Any
    wall_start: float
    epoch_samples: int

    def call(self, event: str, *args: Any) -> None: ...
    def stop(self, reason: str) -> None: ...
    def update_best(self, value: float) -> bool: ...
    def remember(self, hook: str, state: Any) -> None: ...
    def settle(self) -> None: ...
    def save(self, is_best: bool = False, train_sums: Any = None) -> None: ...


class HookBase:
    """Override any of the events; the defaults do nothing. See the
    module docstring for the order."""

    def before_fit(self, trainer: Trainer) -> None:
        pass

    def before_epoch(self, trainer: Trainer) -> None:
        pass

    def after_step(
        self, trainer: Trainer, step: MicroStep, printed: dict[str, float] | None
    ) -> None:
        pass

    def after_print(self, trainer: Trainer, printed: dict[str, float]) -> None:
        pass

    def after_epoch(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        pass

    def after_eval(self, trainer: Trainer, split: str, records: list[dict[str, Any]]) -> None:
        pass

    def after_fit(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        pass


def overrides(hook: Any, event: str) -> bool:
    """Whether the hook does something on event (the loop calls only
    those: no cost per batch otherwise)."""
    method = getattr(type(hook), event, None)
    return method is not None and method is not getattr(HookBase, event)


def from_config(cfg: CfgNode) -> list[HookBase]:
    """The hooks named in TRAIN.HOOKS ("package.module:ClassName"), each
    made with no arguments."""
    return [_made(spec) for spec in cfg.TRAIN.HOOKS]


def _made(spec: str) -> HookBase:
    module_name, _, class_name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name) if class_name else None
    except (ImportError, AttributeError) as e:
        raise UserError(
            f"TRAIN.HOOKS: cannot import {spec} ({type(e).__name__}: {e}); give "
            "'package.module:ClassName' of a module on the Python path"
        ) from None
    if cls is None:
        raise UserError(f"TRAIN.HOOKS: {spec} names no class; give 'package.module:ClassName'")
    return cls()


def default_hooks(cfg: CfgNode, world_size: int) -> list[HookBase]:
    """The built-in hooks this config needs, in the order of each event."""
    t, hooks = cfg.TRAIN, []
    if t.TRACKERS:
        # First: a tracker that cannot start refuses the run before MetricsHook sets an
        # earlier run's records aside; an epoch's record reaches the trackers before
        # CheckpointHook ends the job for a stop signal.
        hooks.append(TrackerHook(cfg))
    if t.FREEZE_BACKBONE_EPOCHS:
        # Before the epoch's first step: its before_epoch freezes after model.train().
        hooks.append(FreezeBackboneHook(cfg))
    if t.TARGET_TOP1 or t.PATIENCE:
        # Before MetricsHook: it marks the record that reached the target, which is then
        # written with the mark.
        hooks.append(EarlyStopHook())
    # Writes each epoch's records before the checkpoint that follows them.
    hooks.append(MetricsHook())
    if t.NONFINITE == "off":
        # Before EvalHook and CheckpointHook: a non-finite epoch is neither evaluated nor saved
        # over the last good checkpoint.
        hooks.append(NonFiniteEpochCheck())
    # Evaluates before CheckpointHook saves, so that best.pth is this epoch's when it is best.
    hooks.append(EvalHook())
    # After the evaluation and the checkpoint: it may end the job (a stop signal) once all
    # else of the epoch is done.
    hooks.append(CheckpointHook(cfg, world_size))
    # After the run (after_fit): the temperature of the checkpoint the run chose, once it is
    # the chosen one for good.
    hooks.append(CalibrationHook())
    return hooks


class TrackerHook(HookBase):
    """TRAIN.TRACKERS (trackers.py): global rank 0 writes one run per
    tracker and run folder, continued across resumes (the folder and
    the run ids are remembered in every checkpoint), with the print
    steps' numbers and every record against the global optimizer step.
    The other ranks only hear how the start went. First of the built-in
    hooks, whose before_fit comes before the run record is written: a
    start that fails refuses the run, and a stop signal during it stops
    every rank, with OUT_DIR as it was; an epoch's record reaches the
    trackers before CheckpointHook ends the job for a stop signal."""

    def __init__(self, cfg: CfgNode) -> None:
        trackers.require_installed(cfg.TRAIN.TRACKERS)  # every rank, before anything is built
        self.runs: trackers.Runs | None = None  # rank 0's

    def before_fit(self, trainer: Trainer) -> None:
        failure: str | int | None = None  # rank 0's: a refusal's line, or a stop signal's number
        if trainer.ctx.is_main:
            saved = trainer.state.hooks.get("trackers", {})
            try:
                self.runs = trackers.Runs(trainer.cfg, saved, trainer.card.classes)
                trainer.remember("trackers", self.runs.saved)
            except UserError as e:
                failure = str(e)
            except KeyboardInterrupt as e:  # a stop signal while a tracker started
                failure = signals.stop_status(e) - 128
        failure = comm.broadcast_object(failure)  # rank 0's start decides for every rank
        if isinstance(failure, int):
            raise signals.Terminated(failure)
        if failure:  # the same line on every rank: the spawner prints it once
            raise UserError(failure)

    def after_print(self, trainer: Trainer, printed: dict[str, float]) -> None:
        if self.runs is not None:
            self.runs.log("train_step", printed, trainer.state.global_step)

    def after_epoch(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if self.runs is not None:
            self.runs.log("train", metrics, trainer.state.global_step)

    def after_eval(self, trainer: Trainer, split: str, records: list[dict[str, Any]]) -> None:
        if self.runs is not None:
            for record in records:  # "val" and "val_ema", or "test"
                self.runs.log(record["split"], record, trainer.state.global_step)

    def after_fit(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        if self.runs is not None:
            self.runs.finish("finished")


class FreezeBackboneHook(HookBase):
    """TRAIN.FREEZE_BACKBONE_EPOCHS N: for the first N epochs (-1: all)
    the backbone, every parameter but the classifier (heads.py), gets no
    gradient (requires_grad False: no backward through it, no optimizer
    update, no weight decay) and its BatchNorm layers run in eval mode,
    so its statistics stay as loaded too (timm's freeze does the same);
    the head trains. Decided from the epoch alone, so a resumed run is
    frozen exactly when the uninterrupted run was. Under DDP the
    strategy sets find_unused_parameters (strategies/__init__.py's
    DDPStrategy): the frozen parameters are registered but get no
    gradient.
    """

    def __init__(self, cfg: CfgNode) -> None:
        self.epochs = cfg.TRAIN.FREEZE_BACKBONE_EPOCHS
        self.frozen: bool | None = None  # what the parameters are set to now (None: not set yet)

    def before_fit(self, trainer: Trainer) -> None:
        net = models.unwrap(trainer.model)
        self.backbone, head = heads.split_parameters(net)
        in_head = {
            id(m) for layer in heads.head_layers(net) for m in net.get_submodule(layer).modules()
        }
        self.norms = [
            m
            for m in net.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and id(m) not in in_head
        ]
        until = (
            "for good"
            if self.epochs < 0
            else "for epoch 1"
            if self.epochs == 1
            else f"for epochs 1-{self.epochs}"
        )
        log.info(
            "backbone frozen %s: %d parameter tensors and %d BatchNorm layers; the classifier %s "
            "(%d tensors) trains",
            until,
            len(self.backbone),
            len(self.norms),
            heads.describe(net),
            len(head),
        )

    def before_epoch(self, trainer: Trainer) -> None:
        frozen = self.epochs < 0 or trainer.state.epoch < self.epochs
        if frozen != self.frozen:
            for p in self.backbone:
                p.requires_grad_(not frozen)
            if self.frozen is not None or not frozen:
                log.info(
                    "epoch %d: backbone %s",
                    trainer.state.epoch + 1,
                    "frozen" if frozen else "unfrozen",
                )
            self.frozen = frozen
        if frozen:  # after the trainer's model.train(): the statistics stay fixed this epoch
            for m in self.norms:
                m.eval()


class MetricsHook(HookBase):
    """Rank 0 appends the records to metrics.jsonl / metrics.csv and
    TensorBoard (run_folder/metrics_files.py), and every
    TRAIN.PRINT_FREQ iterations the printed numbers as TensorBoard
    scalars by global step."""

    def before_fit(self, trainer: Trainer) -> None:
        state = (
            trainer.state
        )  # a fresh start sets an earlier run's records aside; a resume repairs them
        self.writer = trainer.folder.metrics(
            trainer.ctx.is_main, state.epoch if trainer.resumed else None, state.global_step
        )

    def after_print(self, trainer: Trainer, printed: dict[str, float]) -> None:
        self.writer.write_step(trainer.state.global_step, printed)

    def after_epoch(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        state = trainer.state
        self.writer.write(
            {"epoch": state.epoch, "split": "train", **metrics, "step": state.global_step}
        )

    def after_eval(self, trainer: Trainer, split: str, records: list[dict[str, Any]]) -> None:
        for record in records:
            self.writer.write(record)

    def after_fit(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self.writer.close()


class NonFiniteEpochCheck(HookBase):
    """TRAIN.NONFINITE off checks no step; the epoch's loss (reduced:
    the same on every rank) is checked, after its record and before a
    checkpoint of the broken weights could replace the last good one."""

    def after_epoch(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        cfg, state = trainer.cfg, trainer.state
        if metrics["n"] and not math.isfinite(metrics["loss"]):
            raise NonFiniteLoss(
                f"the training loss of epoch {state.epoch} (step {state.global_step}) is not "
                "finite (TRAIN.NONFINITE off checks only each epoch's loss; skip or stop checks "
                f"every step); {advice(cfg)}"
            )


class EvalHook(HookBase):
    """Every TRAIN.EVAL_PERIOD epochs and after the last: evaluate (raw
    and EMA), tell the trainer the balanced top-1 and loss of the
    weights TRAIN.BEST_METRIC names (a new best makes best.pth, and its
    confusion matrix OUT_DIR/confusion.csv), then after_eval."""

    def after_epoch(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        cfg, state = trainer.cfg, trainer.state
        if state.epoch % cfg.TRAIN.EVAL_PERIOD and state.epoch != cfg.OPTIM.MAX_EPOCH:
            return
        try:
            nets = {"val": trainer.strategy.eval_model(trainer.model)}
            if trainer.stepper.ema is not None:
                nets["val_ema"] = trainer.stepper.ema.module
            records, confusions = evaluation.validate(
                nets,
                trainer.val_loader,
                cfg,
                trainer.ctx,
                trainer.stepper,
                state.epoch,
                trainer.card.classes,
            )
            i = [r["split"] for r in records].index(
                "val" if cfg.TRAIN.BEST_METRIC == "top1" else "val_ema"
            )
            judged = records[i]
            is_best = trainer.update_best(judged["balanced_top1"], judged["loss"])
            if is_best and trainer.ctx.is_main:  # best.pth's matrix
                trainer.folder.write_confusion(
                    evaluation.confusion_csv(trainer.card.classes, confusions[i])
                )
            log.info(
                "best %s: balanced top-1 %.2f%%, loss %.4f (epoch %d)",
                judged["split"],
                state.best_metric,
                state.best_loss,
                state.best_epoch,
            )
            trainer.call("after_eval", "val", records)
        finally:
            trainer.strategy.release_eval()  # e.g. FSDP's replica: its GPU memory back to training


class EarlyStopHook(HookBase):
    """TRAIN.TARGET_TOP1 (stop once reached; its record gets
    time_to_target_s) and TRAIN.PATIENCE (stop after that many
    evaluations without progress in the second half of the run:
    Trainer.update_best)."""

    def after_eval(self, trainer: Trainer, split: str, records: list[dict[str, Any]]) -> None:
        cfg = trainer.cfg
        if split != "val":
            return
        best_split = "val" if cfg.TRAIN.BEST_METRIC == "top1" else "val_ema"
        for record in records:
            if (
                record["split"] == best_split
                and cfg.TRAIN.TARGET_TOP1
                and record["top1"] >= cfg.TRAIN.TARGET_TOP1
            ):
                record["time_to_target_s"] = time.perf_counter() - trainer.wall_start
                trainer.stop(
                    f"target top-1 {cfg.TRAIN.TARGET_TOP1:g}% reached after "
                    f"{format_seconds(record['time_to_target_s'])}"
                )
                return
        state = trainer.state
        stalled = cfg.TRAIN.PATIENCE and state.evals_without_progress >= cfg.TRAIN.PATIENCE
        if stalled and state.epoch < cfg.OPTIM.MAX_EPOCH:  # (the last epoch ends the run anyway)
            trainer.stop(
                f"early stop: no progress in {cfg.TRAIN.PATIENCE} evaluations (neither a better "
                "val balanced top-1 nor a 1% lower val loss)"
            )


def vote_period(cfg: CfgNode, world_size: int) -> int:
    """Optimizer steps between two stop/checkpoint votes:
    DIST.VOTE_PERIOD_STEPS, or with 0 (auto) every step up to 8
    processes and every 10 beyond (a vote's latency grows with the
    processes)."""
    if cfg.DIST.VOTE_PERIOD_STEPS:
        return cfg.DIST.VOTE_PERIOD_STEPS
    return 1 if world_size <= 8 else 10


class CheckpointHook(HookBase):
    """Checkpoints by step (TRAIN.CKPT_PERIOD_STEPS), by time
    (CKPT_PERIOD_MIN), at each epoch's end (best.pth too), and the stop
    signals (preemption): one vote decides both, so they live together.

    A signal mid-epoch: a step checkpoint, then Preempted; at an epoch's
    last steps or during its evaluation: the epoch ends, its checkpoint
    is written, then Preempted.
    """

    def __init__(self, cfg: CfgNode, world_size: int) -> None:
        self.every_steps = cfg.TRAIN.CKPT_PERIOD_STEPS or math.inf
        self.every_s = cfg.TRAIN.CKPT_PERIOD_MIN * 60.0 or math.inf
        self.vote_every, self.last_save = vote_period(cfg, world_size), time.monotonic()

    def before_fit(self, trainer: Trainer) -> None:
        self.last_save = time.monotonic()  # CKPT_PERIOD_MIN counts from the training's start

    def save(self, trainer: Trainer, **kwargs: Any) -> None:
        self.last_save = time.monotonic()
        trainer.save(**kwargs)

    def after_step(
        self, trainer: Trainer, step: MicroStep, printed: dict[str, float] | None
    ) -> None:
        state = trainer.state
        if not step.last or state.samples_in_epoch >= trainer.epoch_samples:
            return  # not a step's end, or the epoch's last: after_epoch saves and votes
        stop = by_time = 0
        if state.global_step % self.vote_every == 0:
            stop, by_time = self.vote(trainer)
        if stop or by_time or state.global_step % self.every_steps == 0:
            trainer.settle()  # a run past TRAIN.NONFINITE's limits ends before it is saved
            self.save(trainer, train_sums=trainer.counter.sums_with_n())
        if stop:
            raise Preempted(stop)

    def vote(self, trainer: Trainer) -> list[int]:
        """[the highest stop signal any rank got, whether rank 0's clock
        says a time checkpoint is due]: one small all-reduce, so that all
        ranks take the same decision, or a collective would hang. Its
        latency grows with the ranks, hence a vote every vote_period()
        steps; what happened meanwhile is acted on at the next vote."""
        due = trainer.ctx.rank == 0 and time.monotonic() - self.last_save >= self.every_s
        return comm.max_over_ranks([signals.received or 0, due])

    def after_epoch(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        state = trainer.state
        self.save(trainer, is_best=state.best_epoch == state.epoch)  # this epoch's eval: a best
        stop = comm.max_over_ranks([signals.received or 0])[0]  # since the last vote, or in eval
        if stop:
            raise Preempted(stop)


class CalibrationHook(HookBase):
    """After the run: the temperature of the checkpoint it chose
    (best.pth, else last.pth; its raw weights, which eval, predict and
    export use), fitted on the validation split by every rank together
    and written into that checkpoint's model card (calibration.py), with
    one line of ECE before and after."""

    def after_fit(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        folder = trainer.folder
        path = folder.best()
        ckpt = folder.load(path)
        net = trainer.strategy.test_model(trainer.model, ckpt, "model", folder.checkpoints)
        fit = calibration.calibrate(
            net, trainer.val_loader, trainer.ctx.device, trainer.cfg.MODEL.NUM_CLASSES
        )
        if trainer.ctx.is_main:
            calibration.store(path, ckpt, fit)
            epoch = ckpt.get("epoch")
            log.info("[calibration] %s (epoch %s) | %s", path, epoch, calibration.line(fit))
        comm.barrier()  # nobody exits while rank 0 writes

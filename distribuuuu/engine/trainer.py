"""The training loop, readable top to bottom: ``fit(cfg, ctx, hooks=()) -> summary``.

  1. seed every RNG (RNG_SEED, or a fresh seed chosen by rank 0 and logged; a resumed run keeps its seed)
  2. model: build_model -> the strategy wraps it (SyncBN, device, channels_last, activation
     checkpointing, DDP / FSDP / DataParallel, torch.compile) -> its optimizer -> the Stepper
     (AMP, accumulation, mixup, clipping, non-finite check, EMA)
  3. data: training loader (resumable shuffled shards), validation (and test) loaders (exact)
  4. resume from OUT_DIR/checkpoints (TRAIN.AUTO_RESUME), at the very next batch
  5. per epoch: train_epoch -> the hooks' after_epoch (metrics, evaluation, checkpoint, ...)
  6. the test of the chosen checkpoint (TRAIN.VAL_SPLIT), a one-line summary
What happens around the loop (checkpoints, evaluation, early stopping, metrics files) are hooks:
see engine/hooks.py for the events and their order.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from typing import Any

import torch
from yacs.config import CfgNode

from distribuuuu import data, inferred, model_card, models, optim, strategies
from distribuuuu.data import overlap
from distribuuuu.engine import evaluation
from distribuuuu.engine import hooks as hooks_
from distribuuuu.engine.evaluation import Counter
from distribuuuu.engine.hooks import HookBase, NonFiniteLoss, nonfinite_advice
from distribuuuu.engine.state import TrainState, resume_run, seed_everything, seeded_cfg
from distribuuuu.engine.stepper import MicroStep, Stepper
from distribuuuu.errors import RunNotSaved, UserError
from distribuuuu.launch import comm
from distribuuuu.launch.group import DistContext
from distribuuuu.logger import LOGGER_NAME, Progress, format_seconds
from distribuuuu.run_folder import RunFolder

log = logging.getLogger(LOGGER_NAME)


class Trainer:
    """The run and its loop. Hooks read: cfg, ctx, strategy, model (wrapped), optimizer, stepper,
    state (TrainState), train_loader / val_loader / test_loader, card (the checkpoints' model card,
    set with the data), step_out (the last MicroStep), step_scalars (rank 0's printed numbers on
    TRAIN.PRINT_FREQ iterations, else None), seed,
    counter (the epoch's running sums), train_metrics (the last epoch's, reduced over ranks),
    eval_split / eval_records / is_best (the last evaluation), summary (after the loop); and they
    may set stop_reason, which ends the run after the current epoch."""

    def __init__(self, cfg: CfgNode, ctx: DistContext, hooks: Iterable[HookBase] = ()) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.strategy = strategies.build(cfg, ctx)
        self.run = RunFolder(cfg)  # OUT_DIR: the loop reads and writes it only through this object
        self.state = TrainState()
        # Built-in hooks first (their order is the contract in hooks.py), then TRAIN.HOOKS, then these.
        self.hooks: list[HookBase] = [*hooks_.default_hooks(cfg), *hooks_.from_config(cfg), *hooks]
        self._callers = {e: [getattr(h, e) for h in self.hooks if hooks_.overrides(h, e)] for e in hooks_.EVENTS}
        self.stop_reason = ""  # a hook sets it to end the run after this epoch
        self.wall_start = time.perf_counter()
        self.resumed = False
        self.seed = 0  # the run's seed (RNG_SEED, or the one drawn for None): fit() sets it
        self.step_out: MicroStep | None = None
        self.saves = {"written": 0, "refused": 0, "last_refused": 0}  # rank 0's checkpoint writes (save_run)
        self.step_scalars: dict[str, float] | None = None  # rank 0, on print steps: Progress's numbers
        self.train_metrics: dict[str, float] = {}
        self.counter: Counter | None = None
        self.epoch_skips = 0
        self.epoch_samples = 0
        self.test_loader = None
        self.is_best, self.eval_split, self.eval_records = False, "", []  # set by evaluation (EvalHook)

    def call(self, event: str) -> None:
        """Run every hook's ``event`` method, in the hooks' order."""
        for method in self._callers[event]:
            method(self)

    # -- building -------------------------------------------------------------------------------
    def build_model(self, bare: torch.nn.Module | None = None) -> None:
        """The model wrapped by the strategy, its optimizer and the stepper (``bare``: a given CPU model)."""
        cfg, ctx = self.cfg, self.ctx
        self.model = self.strategy.wrap_model(bare if bare is not None else models.build_model(cfg, new_head=True))
        self.optimizer = self.strategy.build_optimizer(self.model)
        self.global_batch = cfg.TRAIN.BATCH_SIZE * ctx.world_size * cfg.TRAIN.ACCUM_STEPS
        self.peak_lr = optim.peak_lr(cfg, self.global_batch)
        if cfg.OPTIM.BACKBONE_LR_SCALE != 1:
            log.info("OPTIM.BACKBONE_LR_SCALE %g: %s", cfg.OPTIM.BACKBONE_LR_SCALE,
                     optim.describe_groups(self.optimizer))
        self.stepper = Stepper(cfg, ctx.device, self.model, self.optimizer, self.global_batch, self.strategy)

    def build_data(self) -> None:
        cfg, ctx = seeded_cfg(self.cfg, self.seed), self.ctx  # the shuffle follows the run's one seed
        overlap.check(cfg, ctx.is_main)  # val images that are train images: rank 0 looks, every rank hears
        self.train_loader = data.build_train_loader(cfg, ctx.rank, ctx.world_size, ctx.device)
        self.val_loader = data.build_val_loader(cfg, ctx.rank, ctx.world_size, ctx.device)  # TRAIN.VAL_SPLIT: held out
        if cfg.TRAIN.VAL_SPLIT and not inferred.test_is_training_data(cfg):  # a folder of class folders: no test set
            self.test_loader = data.build_test_loader(cfg, ctx.rank, ctx.world_size, ctx.device)
        # What every checkpoint says about the model: class names of the data trained on, preprocessing
        self.card = model_card.describe(self.cfg, self.train_loader.dataset)

    def log_facts(self) -> None:
        """The facts of the run, computed and logged once."""
        cfg, ctx, train, val = self.cfg, self.ctx, self.train_loader, self.val_loader
        log.info("world size %d | batch %d per process x %d accumulation = %d global | peak LR %g (BASE_LR %g, "
                 "LR_SCALING %s) | %d train / %d val samples | %d optimizer steps per epoch",
                 ctx.world_size, cfg.TRAIN.BATCH_SIZE, cfg.TRAIN.ACCUM_STEPS, self.global_batch, self.peak_lr,
                 cfg.OPTIM.BASE_LR, cfg.OPTIM.LR_SCALING, len(train.dataset), len(val.dataset),
                 len(train) // cfg.TRAIN.ACCUM_STEPS)
        if ctx.device.type == "cuda":
            log.info("TF32 %s for float32 matmuls and convolutions (CUDNN.TF32 %s)",
                     "on" if cfg.CUDNN.TF32 else "off", cfg.CUDNN.TF32)
        sizes = {"train": len(train.dataset), "valid" if self.test_loader is not None else "val": len(val.dataset)}
        if self.test_loader is not None:
            sizes["test"] = len(self.test_loader.dataset)
        log.info(" - ".join(f"{k}: {v}" for k, v in sizes.items()))  # e.g. train: 45000 - valid: 5000 - test: 10000
        if len(train) < cfg.TRAIN.ACCUM_STEPS:
            raise UserError("an epoch has no complete optimizer step; lower TRAIN.BATCH_SIZE or "
                            "TRAIN.ACCUM_STEPS, or use more data")

    # -- the run --------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train for OPTIM.MAX_EPOCH epochs (resuming if asked); return the run's summary."""
        cfg, state = self.cfg, self.state
        self.wall_start = time.perf_counter()
        self.seed = seed_everything(cfg, self.ctx.rank, self.run.previous_seed() if self.ctx.is_main else None)
        # MODEL.WEIGHTS / PRETRAINED start a new run (a head of another class count is re-initialised);
        # a run about to resume takes its weights from its checkpoint instead, so they are not read.
        bare = models.build_model(cfg, new_head=True, with_weights=not self.run.has_checkpoint())
        record = self.run.prepare_record(self.ctx, bare)  # model.txt before sharding; a collective
        self.build_model(bare)
        self.build_data()
        self.log_facts()
        state.facts = self.run.facts(len(self.train_loader.dataset), len(self.val_loader.dataset))
        self.resumed = resume_run(self) is not None
        self.run.write_record(record, self.seed)  # only now: a refused run leaves OUT_DIR as it was
        self.call("before_fit")
        while state.epoch < cfg.OPTIM.MAX_EPOCH and not self.stop_reason:
            self.stepper.model.train()  # before before_epoch: a hook may put parts in eval mode (a frozen backbone)
            self.call("before_epoch")
            self.epoch_skips = 0  # steps skipped for non-finite numbers in this epoch (its train record)
            self.train_metrics = self.train_epoch(self.train_loader)
            comm.average_buffers(self.model)  # one model on every rank for eval and the checkpoint
            state.epoch, state.samples_in_epoch = state.epoch + 1, 0
            train = self.train_metrics
            log.info("[train] epoch %d/%d done | loss %.4f | acc@1 %.2f | acc@%d %.2f | %.0f img/s | %.1fs",
                     state.epoch, cfg.OPTIM.MAX_EPOCH, train["loss"], train["top1"], cfg.TRAIN.TOPK,
                     train["topk_acc"], train["img_per_s"], train["time_s"])
            self.call("after_epoch")  # metrics, evaluation (after_eval), checkpoint, stop signals

        self.require_saved()
        summary = {"best": state.best_metric, "best_epoch": state.best_epoch, "epochs": state.epoch,
                   "wall_s": time.perf_counter() - self.wall_start, "out_dir": os.path.abspath(cfg.OUT_DIR)}
        if self.test_loader is not None:  # once, on the checkpoint that the validation split chose
            summary["test"] = evaluation.test_chosen_checkpoint(self)
        self.summary = summary
        self.call("after_fit")
        log.info("done%s: best val %s %.2f%% (epoch %d) | %d epochs | wall %s | run folder %s",
                 f" ({self.stop_reason})" if self.stop_reason else "", "top-1" if cfg.TRAIN.BEST_METRIC == "top1"
                 else "EMA top-1", summary["best"], summary["best_epoch"], summary["epochs"],
                 format_seconds(summary["wall_s"]), cfg.OUT_DIR)
        return summary

    def require_saved(self) -> None:
        """A run that could not save is not done: the last checkpoint refused (non-finite weights or
        buffers at the end), or none written of those due. Collective (rank 0 knows): all ranks raise."""
        last, none = comm.any_rank([bool(self.saves["last_refused"]),
                                    bool(self.saves["refused"]) and not self.saves["written"]])
        if last or none:
            why = ("the weights or buffers are not finite at the end" if last else
                   "none of the checkpoints due was written (the weights were not finite each time)")
            raise RunNotSaved(f"the run could not save: {why}; no usable checkpoint of it is in "
                              f"{self.cfg.OUT_DIR}/checkpoints; {nonfinite_advice(self.cfg)}")

    def train_epoch(self, loader: Any) -> dict[str, float]:
        """Train on this rank's shard from state.samples_in_epoch to the end of the epoch; returns
        the epoch's metrics summed over all ranks. Hooks see every batch (after_step)."""
        cfg, ctx, state, stepper = self.cfg, self.ctx, self.state, self.stepper
        self.counter = counter = Counter(ctx.device, cfg.TRAIN.TOPK, skip_nonfinite=cfg.TRAIN.NONFINITE != "off")
        if state.resumed_sums is not None and ctx.is_main:  # the part of the epoch done before a restart
            counter.add(state.resumed_sums)
        state.resumed_sums = None
        micro_batch = cfg.TRAIN.BATCH_SIZE * ctx.world_size  # samples per micro-step, all ranks
        accum = cfg.TRAIN.ACCUM_STEPS
        # A full epoch in samples: whole optimizer steps only (a partial accumulation is dropped); a
        # shard loader plans its own steps, which run every sample (data/shards/plan.py).
        planned = getattr(loader, "epoch_steps", None)
        self.epoch_samples = (planned * micro_batch if planned is not None else
                              len(loader.dataset) // micro_batch // accum * accum * micro_batch)
        loader.sampler.set_epoch(state.epoch, start=state.samples_in_epoch)  # same shuffle on all ranks
        iters = (self.epoch_samples - state.samples_in_epoch) // micro_batch
        progress = Progress(cfg, ctx.is_main, ctx.world_size, state.epoch, iters)
        lr, data_total, first_step_s = self.peak_lr, 0.0, 0.0
        gpus = self.strategy.gpus()
        for gpu in gpus:
            torch.cuda.reset_peak_memory_stats(gpu)
        epoch_start = tick = time.perf_counter()
        try:
            for it, (images, target) in zip(range(iters), loader):
                images, target = images.to(ctx.device, non_blocking=True), target.to(ctx.device, non_blocking=True)
                data_s = time.perf_counter() - tick
                data_total += data_s
                lr = self.peak_lr * optim.lr_factor(cfg, state.epoch + state.samples_in_epoch / self.epoch_samples)
                optim.set_lr(stepper.optimizer, lr)
                self.step_out = out = stepper.micro_step(images, target)
                state.samples_in_epoch += micro_batch
                counter.update(out.logits, out.target, out.loss)  # on-device sums: no host sync here
                if out.stepped is False:
                    self.on_nonfinite()  # every rank skipped this step (or raises NonFiniteLoss)
                elif out.stepped:  # on the device path: unless take_skips says otherwise (reconcile)
                    state.global_step, state.bad_steps = state.global_step + 1, state.bad_steps * (out.skipped is not None)
                    if cfg.TRAIN.COMPILE and state.global_step == 1:  # compile time is not throughput
                        first_step_s = time.perf_counter() - tick
                        log.info("torch.compile + first step: %.1fs (left out of img/s)", first_step_s)
                if (it + 1) % cfg.TRAIN.PRINT_FREQ == 0:  # the same iterations on every rank: a host sync
                    self.reconcile()
                # Shows rank 0's running averages every PRINT_FREQ iterations: a host sync on print steps.
                self.step_scalars = progress.step(it, data_s, images.size(0), lr, counter.result)
                self.call("after_step")  # step checkpoints, stop signals (at optimizer-step boundaries)
                tick = time.perf_counter()
        finally:
            progress.close()  # also when a hook ends the run (Preempted): the bar is left finished
        for gpu in gpus:  # the GPU runs behind the host: the epoch ends when its last kernel does
            torch.cuda.synchronize(gpu)
        seconds = time.perf_counter() - epoch_start - first_step_s
        self.reconcile()
        result = counter.reduce().result()
        bad = int(comm.all_reduce_sum(torch.tensor([data.take_bad_image_count(loader)], device=ctx.device))[0])
        if bad:  # each file was named in the log when it was met
            log.warning("epoch %d: %d unreadable training images skipped (TRAIN.BAD_IMAGES skip)", state.epoch + 1, bad)
        result.update(lr=lr, img_per_s=result["n"] / max(seconds, 1e-9), time_s=seconds, bad_images=bad,
                      skipped_steps=self.epoch_skips, data_frac=data_total / max(seconds, 1e-9),
                      peak_mem_mb=_peak_memory_mb(ctx.device, gpus))
        return result

    def reconcile(self) -> None:
        """Read the stepper's device count of skipped steps (one host sync: print steps, checkpoints,
        the epoch's end): global_step stops counting them, and TRAIN.NONFINITE's limits apply. Every
        rank skipped the same steps (the flag was averaged or reduced) and reads at the same
        iteration, so all raise NonFiniteLoss together."""
        cfg, state = self.cfg, self.state
        v = self.stepper.take_skips()
        if not self.stepper.on_device:
            return
        start = state.global_step - v["tried"]  # exact: the step count at the previous reading
        state.global_step -= v["skips"]
        state.bad_steps = v["run"]
        self.epoch_skips += v["skips"]
        if v["over"]:  # the message the synced check gives at that step
            raise NonFiniteLoss(f"non-finite loss or gradients at step {start + v['good_before_over'] + 1} "
                                f"({self.stepper.max_skips + 1} in a row; {self._setting()}); {nonfinite_advice(cfg)}")
        if v["skips"]:
            log.warning("non-finite loss or gradients: step skipped on every rank (%d in a row, at most %d; %d "
                        "skipped after step %d)", v["longest"], cfg.TRAIN.NONFINITE_MAX_SKIPS, v["skips"], start)

    def _setting(self) -> str:
        cfg = self.cfg
        return ("TRAIN.NONFINITE stop ends the run at the first one" if cfg.TRAIN.NONFINITE == "stop" else
                f"TRAIN.NONFINITE skip allows NONFINITE_MAX_SKIPS {cfg.TRAIN.NONFINITE_MAX_SKIPS} in a row")

    def on_nonfinite(self) -> None:
        """A step skipped on every rank for non-finite numbers: within TRAIN.NONFINITE's limits, or the end."""
        cfg, state = self.cfg, self.state
        state.bad_steps += 1
        self.epoch_skips += 1
        if cfg.TRAIN.NONFINITE == "stop" or state.bad_steps > cfg.TRAIN.NONFINITE_MAX_SKIPS:
            raise NonFiniteLoss(f"non-finite loss or gradients at step {state.global_step + 1} "
                                f"({state.bad_steps} in a row; {self._setting()}); {nonfinite_advice(cfg)}")
        log.warning("non-finite loss or gradients: step skipped on every rank (%d in a row, at most %d)",
                    state.bad_steps, cfg.TRAIN.NONFINITE_MAX_SKIPS)


def _peak_memory_mb(device: torch.device, gpus: list[torch.device] | None = None) -> float:
    """Peak GPU memory of this epoch (the fullest GPU's, under dp), or this process's peak resident set on CPU."""
    if device.type == "cuda":
        return max(torch.cuda.max_memory_allocated(g) for g in (gpus or [device])) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def fit(cfg: CfgNode, ctx: DistContext, hooks: Iterable[HookBase] = ()) -> dict[str, Any]:
    """Train for OPTIM.MAX_EPOCH epochs (resuming if asked) with the built-in hooks, TRAIN.HOOKS and
    ``hooks``; return the run's summary (best, best_epoch, epochs, wall_s, out_dir[, test])."""
    return Trainer(cfg, ctx, hooks).fit()

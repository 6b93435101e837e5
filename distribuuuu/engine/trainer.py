"""The training loop, readable top to bottom: ``fit(cfg, ctx, hooks=()) -> summary``, and the state it
carries, saved to and resumed from a checkpoint.

  1. seed every RNG (RNG_SEED, or a fresh seed chosen by rank 0 and logged; a resumed run keeps its seed)
  2. model: build_model -> the strategy wraps it (SyncBN, device, channels_last, activation
     checkpointing, DDP / FSDP / DataParallel, torch.compile) -> its optimizer -> the Stepper
     (AMP, accumulation, mixup, clipping, non-finite check, EMA: optim.py)
  3. data: training loader (resumable shuffled shards), validation (and test) loaders (exact)
  4. resume from the run folder's latest checkpoint (TRAIN.AUTO_RESUME), at the very next batch
  5. per epoch: train_epoch -> the hooks' after_epoch (metrics, evaluation, checkpoint, ...)
  6. the test of the chosen checkpoint (TRAIN.VAL_SPLIT), a one-line summary
What happens around the loop (checkpoints, evaluation, early stopping, metrics files) are hooks:
see engine/hooks.py for the events and their order.

A checkpoint is a plain dict (the files themselves: weights.py, run_folder):
  model / optimizer (or ``sharded``: the .dcp folder of an FSDP run; the strategy's entries),
  scaler / ema (the stepper's), epoch (epochs completed), samples_in_epoch (position in the
  epoch in progress, all ranks together), global_step, best_metric, best_epoch, evals_since_best,
  cfg (YAML text), rng (python/numpy/torch[/its GPU's cuda] states of every rank: engine/rng.py),
  world_size, train_sums (metrics of the part-done epoch), facts (the data's sizes), seed (the run's
  seed: RNG_SEED, or the one drawn when it is None), card (model_card.ModelCard.to_dict(): the
  config, class names and preprocessing, for using the model from the file alone).
Saving is collective (every rank calls ``Trainer.save``); only rank 0 writes the .pth file.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from yacs.config import CfgNode

from distribuuuu import data, inferred, model_card, models, nonfinite, optim, strategies
from distribuuuu.data import overlap
from distribuuuu.data.shards import plan
from distribuuuu.engine import evaluation, rng
from distribuuuu.engine import hooks as hooks_
from distribuuuu.engine.evaluation import Counter
from distribuuuu.engine.hooks import HookBase
from distribuuuu.errors import UserError
from distribuuuu.launch import comm
from distribuuuu.launch.comm import DistContext
from distribuuuu.logger import LOGGER_NAME, Progress, format_seconds
from distribuuuu.optim import MicroStep, Stepper
from distribuuuu.run_folder import RunFolder

log = logging.getLogger(LOGGER_NAME)


@dataclass
class TrainState:
    """Counters of the run (the model, optimizer, scaler and EMA hold the rest)."""

    epoch: int = 0  # epochs completed
    samples_in_epoch: int = 0  # samples of the epoch in progress consumed by all ranks together
    global_step: int = 0  # optimizer steps taken
    best_metric: float = float("-inf")  # TRAIN.BEST_METRIC's best value so far
    best_epoch: int = 0
    evals_since_best: int = 0  # for TRAIN.PATIENCE
    bad_steps: int = 0  # consecutive non-finite steps
    resumed_sums: list[float] | None = None  # train sums of a resumed, part-done epoch (all ranks)
    stop_signal: int = 0  # a preemption signal agreed at an epoch's last step: stop after its checkpoint
    facts: dict[str, Any] = field(default_factory=dict)  # the data's sizes (RunFolder.data_identity), checked on resume

    COUNTERS = ("epoch", "samples_in_epoch", "global_step", "best_metric", "best_epoch", "evals_since_best")


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
        self.saves = {"written": 0, "refused": 0, "last_refused": 0}  # rank 0's checkpoint writes (save)
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
                     strategies.describe_groups(self.optimizer))
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
        state.facts = self.run.data_identity(len(self.train_loader.dataset), len(self.val_loader.dataset))
        self.resumed = self.resume() is not None
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

        nonfinite.require_saved(self)
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

    def train_epoch(self, loader: Any) -> dict[str, float]:
        """Train on this rank's shard from state.samples_in_epoch to the end of the epoch; returns
        the epoch's metrics summed over all ranks. Hooks see every batch (after_step)."""
        cfg, ctx, state, stepper = self.cfg, self.ctx, self.state, self.stepper
        self.counter = counter = Counter(ctx.device, cfg.TRAIN.TOPK, skip_nonfinite=cfg.TRAIN.NONFINITE != "off")
        if state.resumed_sums is not None and ctx.is_main:  # the part of the epoch done before a restart
            counter.add(state.resumed_sums)
        state.resumed_sums = None
        micro_batch = cfg.TRAIN.BATCH_SIZE * ctx.world_size  # samples per micro-step, all ranks
        self.epoch_samples = _epoch_samples(loader, micro_batch, cfg.TRAIN.ACCUM_STEPS)
        loader.sampler.set_epoch(state.epoch, start=state.samples_in_epoch)  # same shuffle on all ranks
        iters = (self.epoch_samples - state.samples_in_epoch) // micro_batch
        progress = Progress(cfg, ctx.is_main, ctx.world_size, state.epoch, iters)
        lr, data_total, self.first_step_s, gpus = self.peak_lr, 0.0, 0.0, self.strategy.gpus()
        _reset_peak_memory(gpus)
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
                    nonfinite.on_skipped_step(self)  # every rank skipped this step (or raises NonFiniteLoss)
                elif out.stepped:  # on the device path: unless nonfinite.reconcile finds it skipped
                    self._count_step(tick)
                if (it + 1) % cfg.TRAIN.PRINT_FREQ == 0:  # the same iterations on every rank: a host sync
                    nonfinite.reconcile(self)
                # Shows rank 0's running averages every PRINT_FREQ iterations: a host sync on print steps.
                self.step_scalars = progress.step(it, data_s, images.size(0), lr, counter.result)
                self.call("after_step")  # step checkpoints, stop signals (at optimizer-step boundaries)
                tick = time.perf_counter()
        finally:
            progress.close()  # also when a hook ends the run (Preempted): the bar is left finished
        _synchronize(gpus)  # the GPU runs behind the host: the epoch ends when its last kernel does
        seconds = time.perf_counter() - epoch_start - self.first_step_s
        nonfinite.reconcile(self)
        result = counter.reduce().result()
        bad = evaluation.bad_images(loader, ctx, f"unreadable training images skipped in epoch {state.epoch + 1} "
                                    "(TRAIN.BAD_IMAGES skip)")
        result.update(lr=lr, img_per_s=result["n"] / max(seconds, 1e-9), time_s=seconds, bad_images=bad,
                      skipped_steps=self.epoch_skips, data_frac=data_total / max(seconds, 1e-9),
                      peak_mem_mb=_peak_memory_mb(ctx.device, gpus))
        return result

    def _count_step(self, tick: float) -> None:
        state = self.state
        state.global_step += 1
        if self.step_out.skipped is None:  # host-checked: a run of skipped steps ends (device path: reconcile)
            state.bad_steps = 0
        if self.cfg.TRAIN.COMPILE and state.global_step == 1:  # compile time is not throughput
            self.first_step_s = time.perf_counter() - tick
            log.info("torch.compile + first step: %.1fs (left out of img/s)", self.first_step_s)

    # -- the state: save and resume -------------------------------------------------------------
    def save(self, is_best: bool = False, train_sums: torch.Tensor | None = None) -> None:
        """Collective: every rank calls it. Rank 0 writes everything that decides the rest of the run:
        the counters, every rank's RNG streams, the stepper's state (scaler, EMA) and the strategy's
        model/optimizer entries. ``train_sums``: the part-done epoch's metrics (a mid-epoch checkpoint)."""
        cfg, ctx, state = self.cfg, self.ctx, self.state
        rngs = comm.all_gather_object(rng.rng_state())  # each rank's own streams
        if train_sums is not None:
            train_sums = comm.all_reduce_sum(train_sums.clone()).tolist()
        counters = {k: getattr(state, k) for k in TrainState.COUNTERS}
        record = {**self.stepper.state_dict(), **counters, "cfg": cfg.dump(), "rng": rngs,
                  "world_size": ctx.world_size, "train_sums": train_sums, "facts": state.facts, "seed": self.seed,
                  model_card.CARD_KEY: self.card.to_dict(), "shard_plan": plan.plan_of(self.train_loader)}
        entries, finite = self.strategy.checkpoint_state(self.model, self.optimizer, self.run.shards_path(counters))
        record.update(entries)
        if ctx.is_main:
            if not finite:
                log.error("not saving a checkpoint at step %d: the weights are not finite", state.global_step)
            else:
                path = self.run.save(record, is_best=is_best)
                log.info("saved %s%s", path, " (best)" if is_best else "")
            self.saves["written" if finite else "refused"] += 1  # read at the end (nonfinite.require_saved)
            self.saves["last_refused"] = int(not finite)
        comm.barrier()  # nobody races ahead (or exits) while rank 0 writes

    def resume(self) -> dict[str, Any] | None:
        """Continue from OUT_DIR/checkpoints when TRAIN.AUTO_RESUME finds a checkpoint there; returns
        the checkpoint (the stepper's state is loaded from it too) or None. A checkpoint that does not
        fit this run (config, data, model or optimizer: resume_check) is refused before anything is loaded."""
        cfg, state, strategy = self.cfg, self.state, self.strategy
        if not cfg.TRAIN.AUTO_RESUME:
            return None
        ckpt, path = self.run.latest()
        if ckpt is None:
            return None
        net, opt = models.unwrap(self.model), self.optimizer if cfg.TRAIN.LOAD_OPT else None
        plain = strategy.checkable(ckpt)  # the shapes of sharded state: torch checks them while loading
        self.run.check_resume(ckpt, path, state.facts, net if plain else None, opt if plain else None)
        strategy.load_checkpoint(self.model, opt, ckpt, path, self.run.checkpoints)
        for key in TrainState.COUNTERS:
            setattr(state, key, ckpt.get(key, getattr(state, key)))
        plan.require_same_plan(self.train_loader, state.samples_in_epoch, ckpt, path)
        state.resumed_sums = ckpt.get("train_sums")
        # A checkpoint of an older version has no seed: its RNG_SEED None run shuffled with seed 0
        self._keep_seed(ckpt.get("seed", 0 if cfg.RNG_SEED is None else None))
        self._restore_rng(ckpt)
        log.info("resumed from %s: %d epochs done, %d samples into epoch %d, step %d, best %s %.2f",
                 path, state.epoch, state.samples_in_epoch, state.epoch + 1, state.global_step,
                 cfg.TRAIN.BEST_METRIC, state.best_metric)
        self.stepper.load_state_dict(ckpt)
        return ckpt

    def _restore_rng(self, ckpt: dict[str, Any]) -> None:
        """This rank's RNG streams, as saved; after a change of world size they cannot be carried over
        and keep their fresh seeds (the sampler position is in samples: the epoch goes on with the
        next unseen samples)."""
        ctx, saved_world = self.ctx, ckpt.get("world_size", self.ctx.world_size)
        if saved_world == ctx.world_size:
            rng.set_rng_state(ckpt["rng"][ctx.rank])
            return
        log.warning("resuming %d processes from a checkpoint of %d: the global batch and the LR are "
                    "recomputed (see the line above); the epoch continues at sample %d; RNG streams "
                    "are re-seeded", ctx.world_size, saved_world, self.state.samples_in_epoch)

    def _keep_seed(self, seed: int | None) -> None:
        """A resumed run shuffles with the seed it started with (RNG_SEED None: env.json normally hands
        it over before the data is built; this covers a run folder whose env.json is gone)."""
        if seed is None or seed == self.seed:
            return
        log.warning("resume: the checkpoint's run used seed %d, not %d: its shuffle continues", seed, self.seed)
        self.seed = seed
        self.train_loader.sampler.seed = seed  # env.json is written after the resume, with this seed


def seed_everything(cfg: CfgNode, rank: int, previous: int | None = None) -> int:
    """Seed python/numpy/torch with the run's seed + rank (augmentations differ per rank); return the seed.

    The seed is RNG_SEED, else ``previous`` (the seed a resumed run started with), else a fresh
    one drawn by rank 0 and broadcast. Everything seeded from it (the sampler's shuffle, the loader
    workers) uses this one value, so the seed that is logged repeats the run as RNG_SEED."""
    seed = cfg.RNG_SEED
    if seed is None:
        seed = comm.broadcast_object(previous if previous is not None else random.SystemRandom().randrange(2**31))
        how = "the seed of the run being resumed" if previous is not None else "using seed"
        log.info("RNG_SEED is None: %s %d (pass RNG_SEED %d to repeat this run)", how, seed, seed)
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)
    return seed


def seeded_cfg(cfg: CfgNode, seed: int) -> CfgNode:
    """cfg with RNG_SEED set to the run's seed, for what draws from it (the data's shuffle and
    workers); the run's own cfg keeps None, so config.yaml and resume checks see what the user gave."""
    if cfg.RNG_SEED == seed:
        return cfg
    seeded = cfg.clone()
    seeded.defrost()
    seeded.RNG_SEED = seed
    seeded.freeze()
    return seeded


def _epoch_samples(loader: Any, micro_batch: int, accum: int) -> int:
    """A full epoch in samples: whole optimizer steps only (a partial accumulation is dropped); a
    shard loader plans its own steps, which run every sample (data/shards/plan.py)."""
    planned = getattr(loader, "epoch_steps", None)
    if planned is not None:
        return planned * micro_batch
    return len(loader.dataset) // micro_batch // accum * accum * micro_batch


def _reset_peak_memory(gpus: list[torch.device]) -> None:
    for gpu in gpus:
        torch.cuda.reset_peak_memory_stats(gpu)


def _synchronize(gpus: list[torch.device]) -> None:
    for gpu in gpus:
        torch.cuda.synchronize(gpu)


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

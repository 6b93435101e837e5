"""The training loop, read top to bottom: ``fit(cfg, ctx, hooks=()) ->
summary``, and the state it carries, saved to and resumed from a
checkpoint.

  1. seed every RNG (RNG_SEED, or a fresh seed chosen by rank 0 and
     logged; a resumed run keeps its seed)
  2. model: build_model -> the strategy wraps it (SyncBN, device,
     channels_last, activation checkpointing, DDP / FSDP / DataParallel,
     torch.compile) -> its optimizer -> the Stepper (AMP, accumulation,
     mixup, clipping, the non-finite guard, EMA: optim.py, nonfinite.py)
  3. data: training loader (resumable shuffled shards), validation (and
     test) loaders (exact)
  4. resume from the run folder's latest checkpoint (TRAIN.AUTO_RESUME),
     at the very next batch
  5. per epoch: train_epoch -> the hooks' after_epoch (metrics,
     evaluation, checkpoint, ...)
  6. the test of the chosen checkpoint (TRAIN.VAL_SPLIT), a one-line
     summary
What happens around the loop (checkpoints, evaluation, early stopping,
metrics files) are hooks (hooks.py: the events, their order and their
arguments). Only this module writes the Trainer and its TrainState:
hooks read them, and act through ``stop``, ``update_best``, ``settle``,
``save`` and ``remember`` (a hook's own state, kept in every
checkpoint).

A checkpoint is a plain dict (the file format: weights.py; the folder's
checkpoints: run_folder):
  model / optimizer (or ``sharded``: the .dcp folder of an FSDP run;
  the strategy's entries), scaler / ema (the stepper's), the
  TrainState.SAVED counters (epoch, samples_in_epoch, global_step, the
  best and the progress: update_best), cfg (YAML text), rng (every
  rank's streams: engine/rng.py), world_size, train_sums (metrics of the
  part-done epoch) with its counters so far (unreadable: the training
  samples found unreadable, epoch_skips: the steps the guard skipped),
  facts (what the run trained on, checked on resume), seed, card
  (model_card: the config, class names and preprocessing, for using the
  model from the file alone), shard_plan, hooks (each hook's own state
  by name, from ``Trainer.remember``: e.g. the tracker run ids).
Saving is collective (every rank calls ``Trainer.save``); only rank 0
writes the .pth file.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from yacs.config import CfgNode

from distribuuuu import data, model_card, models, nonfinite, optim, strategies
from distribuuuu.data import split_files
from distribuuuu.data.loading import balance
from distribuuuu.engine import evaluation, rng
from distribuuuu.engine import hooks as hooks_
from distribuuuu.engine.evaluation import Counter
from distribuuuu.engine.hooks import HookBase
from distribuuuu.errors import UserError
from distribuuuu.inferred.data import training_data_is_test_data
from distribuuuu.launch import comm
from distribuuuu.launch.comm import DistContext
from distribuuuu.logger import LOGGER_NAME, Progress, accuracies, format_seconds
from distribuuuu.optim import Stepper
from distribuuuu.run_folder import RunFolder

log = logging.getLogger(LOGGER_NAME)

PROGRESS = 0.01  # a val loss this much (relative) below the lowest so far is progress (PATIENCE)


@dataclass
class TrainState:
    """Counters of the run (the model, optimizer, scaler and EMA hold
    the rest)."""

    epoch: int = 0  # epochs completed
    samples_in_epoch: int = 0  # samples of the epoch in progress consumed by all ranks together
    global_step: int = 0  # optimizer steps of the schedule (a step the guard skipped counts)
    best_metric: float = float("-inf")  # balanced top-1 of best.pth (TRAIN.BEST_METRIC's weights)
    best_loss: float = float("inf")  # its val loss, which breaks ties
    best_epoch: int = 0
    lowest_loss: float = float("inf")  # the lowest val loss so far
    evals_without_progress: int = 0  # for TRAIN.PATIENCE (update_best)
    resumed_sums: list[float] | None = None  # train sums of a resumed, part-done epoch (all ranks)
    data_identity: dict[str, Any] = field(
        default_factory=dict
    )  # what the run trains on, checked on resume
    hooks: dict[str, Any] = field(
        default_factory=dict
    )  # hooks' own state by name (Trainer.remember)
    unreadable: list[int] = field(
        default_factory=list
    )  # the epoch's unreadable samples so far (data.unreadable_so_far)

    SAVED = (
        "epoch",
        "samples_in_epoch",
        "global_step",
        "best_metric",
        "best_loss",
        "best_epoch",
        "lowest_loss",
        "evals_without_progress",
        "hooks",
        "unreadable",
    )


class Trainer:
    """The run and its loop. Hooks read its attributes (hooks.Trainer
    names them); only this class writes them."""

    def __init__(self, cfg: CfgNode, ctx: DistContext, hooks: Iterable[HookBase] = ()) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.strategy = strategies.build(cfg, ctx)
        self.folder = RunFolder(cfg)  # OUT_DIR: the loop reads and writes it only through this
        self.state = TrainState()
        # The built-in hooks first (hooks.default_hooks says why in that order), then
        # TRAIN.HOOKS, then these.
        built_in, configured = hooks_.default_hooks(cfg, ctx.world_size), hooks_.from_config(cfg)
        self.hooks: list[HookBase] = [*built_in, *configured, *hooks]
        self._callers = {
            e: [getattr(h, e) for h in self.hooks if hooks_.overrides(h, e)] for e in hooks_.EVENTS
        }
        self.stop_reason = ""  # set by stop(): the run ends after this epoch
        self.wall_start = time.perf_counter()
        self.resumed, self.seed, self.first_step_s = False, 0, 0.0
        self.test_loader = None

    def call(self, event: str, *args: Any) -> None:
        """Run every hook's ``event`` method, in the hooks' order."""
        for method in self._callers[event]:
            method(self, *args)

    # -- what hooks may ask --------------------------------------------------------------
    def stop(self, reason: str) -> None:
        """End the run after the current epoch. Call it on every rank
        with a reason decided from values that are the same everywhere
        (reduced metrics, a vote), or ranks would part."""
        self.stop_reason = reason

    def update_best(self, balanced_top1: float, loss: float) -> bool:
        """An evaluation of TRAIN.BEST_METRIC's weights: whether it is
        the best so far (then best.pth follows). Balanced top-1 decides
        (a small class counts as much as a large one), the lower val
        loss breaks a tie (common on a few images per class), the later
        epoch a tie of both. Counts the evaluations without progress
        for TRAIN.PATIENCE: in the first half of the run none count (the
        LR is high, and the schedule has the rest to go)."""
        state = self.state
        better = balanced_top1 > state.best_metric
        best = better or (balanced_top1 == state.best_metric and loss <= state.best_loss)
        progress = better or loss < (1 - PROGRESS) * state.lowest_loss
        state.lowest_loss = min(state.lowest_loss, loss)
        if best:
            state.best_metric, state.best_loss, state.best_epoch = balanced_top1, loss, state.epoch
        if progress or state.epoch <= self.cfg.OPTIM.MAX_EPOCH / 2:
            state.evals_without_progress = 0
        else:
            state.evals_without_progress += 1
        return best

    def remember(self, hook: str, state: Any) -> None:
        """A hook's own state (plain Python values), written into every
        checkpoint from now on and back in ``state.hooks[hook]`` after a
        resume (before before_fit): e.g. a tracker's run id."""
        self.state.hooks[hook] = state

    def settle(self) -> None:
        """The exact count of skipped steps, and NonFiniteLoss past
        TRAIN.NONFINITE's limits (one host sync: print steps,
        checkpoints, an epoch's end)."""
        self.stepper.settle(self.state.global_step)

    # -- building --------------------------------------------------------------------------
    def build_model(self, bare: torch.nn.Module | None = None) -> None:
        """The model (``bare``: a given CPU model) wrapped by the
        strategy, its optimizer and the stepper."""
        cfg, ctx = self.cfg, self.ctx
        bare = bare if bare is not None else models.build_model(cfg, new_head=True)
        self.model = self.strategy.wrap_model(bare)
        self.optimizer = self.strategy.build_optimizer(self.model)
        self.global_batch = cfg.TRAIN.BATCH_SIZE * ctx.world_size * cfg.TRAIN.ACCUM_STEPS
        self.schedule = optim.Schedule(cfg, optim.peak_lr(cfg, self.global_batch))
        if cfg.OPTIM.BACKBONE_LR_SCALE != 1:
            groups = optim.describe_groups(self.optimizer)
            log.info("OPTIM.BACKBONE_LR_SCALE %g: %s", cfg.OPTIM.BACKBONE_LR_SCALE, groups)
        self.stepper = Stepper(
            cfg, ctx.device, self.model, self.optimizer, self.global_batch, self.strategy
        )

    def build_data(self) -> None:
        cfg, ctx = rng.seeded_cfg(self.cfg, self.seed), self.ctx  # the shuffle: the run's seed
        where = ctx.rank, ctx.world_size, ctx.device
        data.check_overlap(cfg, ctx.is_main)  # val images that are train images: rank 0 looks
        self.train_loader = data.build_train_loader(cfg, *where)
        self.val_loader = data.build_val_loader(cfg, *where)  # TRAIN.VAL_SPLIT: the held-out part
        if cfg.TRAIN.VAL_SPLIT and not training_data_is_test_data(cfg):
            self.test_loader = data.build_test_loader(cfg, *where)
        if cfg.TRAIN.CLASS_BALANCE == "loss":  # weights from the labels trained on: known now
            weight = balance.loss_weights(self.train_loader.dataset, cfg.MODEL.NUM_CLASSES)
            self.stepper.weigh_classes(cfg, weight)
        # What every checkpoint says of the model: the classes trained on, the preprocessing.
        self.card = model_card.describe(self.cfg, self.train_loader.dataset)

    def log_setup(self) -> None:
        """The run's sizes, computed and logged once."""
        cfg, ctx, train, val = self.cfg, self.ctx, self.train_loader, self.val_loader
        t, steps = cfg.TRAIN, len(train) // cfg.TRAIN.ACCUM_STEPS
        log.info(
            f"world size {ctx.world_size} | batch {t.BATCH_SIZE} per process x {t.ACCUM_STEPS} "
            f"accumulation = {self.global_batch} global | peak LR {self.schedule.peak:g} "
            f"(BASE_LR {cfg.OPTIM.BASE_LR:g}, LR_SCALING {cfg.OPTIM.LR_SCALING}) | "
            f"{len(train.dataset)} train / {len(val.dataset)} val samples | {steps} optimizer "
            "steps per epoch"
        )
        if ctx.device.type == "cuda":
            on = "on" if cfg.CUDNN.TF32 else "off"
            log.info(
                f"TF32 {on} for float32 matmuls and convolutions (CUDNN.TF32 {cfg.CUDNN.TF32})"
            )
        held_out = f"val: {len(val.dataset)}"
        if self.test_loader is not None:  # the val set is held out of the training data: "valid"
            held_out = f"valid: {len(val.dataset)} - test: {len(self.test_loader.dataset)}"
        log.info(f"train: {len(train.dataset)} - {held_out}")

    # -- the run ---------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train for OPTIM.MAX_EPOCH epochs (resuming if asked); return
        the run's summary."""
        cfg, state, folder = self.cfg, self.state, self.folder
        self.wall_start = time.perf_counter()
        previous = folder.previous_seed() if self.ctx.is_main else None
        self.seed = rng.seed_everything(cfg, self.ctx.rank, previous)
        # MODEL.WEIGHTS / PRETRAINED start a new run (a head of another class count is
        # re-initialised); a run about to resume takes its weights from its checkpoint.
        bare = models.build_model(cfg, new_head=True, with_weights=not folder.has_checkpoint())
        record = folder.prepare_record(self.ctx, bare)  # model.txt before sharding; collective
        self.build_model(bare)
        self.build_data()
        self.log_setup()
        sizes = len(self.train_loader.dataset), len(self.val_loader.dataset)
        state.data_identity = folder.data_identity(*sizes, self.card.classes)
        ckpt, path = folder.latest() if cfg.TRAIN.AUTO_RESUME else (None, None)
        if ckpt is not None:
            self.resume(ckpt, path)
        # The hooks first: one may still refuse the run (a tracker that
        # cannot start). Only then the run record: a refused run leaves
        # OUT_DIR as it was.
        self.call("before_fit")
        folder.write_record(record, self.seed)
        if cfg.TRAIN.VAL_SPLIT and self.ctx.is_main:  # the held-out files, for other tools
            folder.write_heldout(split_files.heldout_files(cfg, self.val_loader.dataset))
        while state.epoch < cfg.OPTIM.MAX_EPOCH and not self.stop_reason:
            self.model.train()  # before before_epoch: a hook may put parts in eval mode
            self.call("before_epoch")
            metrics = self.train_epoch(self.train_loader)
            comm.average_buffers(self.model)  # one model on every rank for eval and the checkpoint
            state.epoch, state.samples_in_epoch = state.epoch + 1, 0
            accuracy = accuracies(metrics["top1"], cfg.TRAIN.TOPK, metrics["topk_acc"])
            log.info(
                f"[train] epoch {state.epoch}/{cfg.OPTIM.MAX_EPOCH} done | loss "
                f"{metrics['loss']:.4f} | {accuracy} | {metrics['img_per_s']:.0f} img/s | "
                f"{metrics['time_s']:.1f}s"
            )
            self.call("after_epoch", metrics)  # metrics, evaluation, checkpoint, stop signals
        wall = time.perf_counter() - self.wall_start
        summary = {"best": state.best_metric, "best_epoch": state.best_epoch, "epochs": state.epoch}
        summary.update(wall_s=wall, out_dir=os.path.abspath(cfg.OUT_DIR))
        if self.test_loader is not None:  # once, on the checkpoint the validation split chose
            summary["test"] = self.test_chosen_checkpoint()
        self.call("after_fit", summary)
        why = f" ({self.stop_reason})" if self.stop_reason else ""
        weights = "" if cfg.TRAIN.BEST_METRIC == "top1" else "EMA "
        log.info(
            f"done{why}: best val {weights}balanced top-1 {state.best_metric:.2f}% (epoch "
            f"{state.best_epoch}) | "
            f"{state.epoch} epochs | wall {format_seconds(wall)} | run folder {cfg.OUT_DIR}"
        )
        return summary

    def train_epoch(self, loader: Any) -> dict[str, float]:
        """Train on this rank's shard from state.samples_in_epoch to the
        end of the epoch; returns the epoch's metrics summed over all
        ranks. Hooks see every batch (after_step)."""
        cfg, ctx, state, stepper = self.cfg, self.ctx, self.state, self.stepper
        skip_nonfinite = cfg.TRAIN.NONFINITE != "off"
        self.counter = counter = Counter(ctx.device, cfg.TRAIN.TOPK, skip_nonfinite)
        if state.resumed_sums is not None and ctx.is_main:  # the epoch's part before a restart
            counter.add(state.resumed_sums)
        state.resumed_sums = None
        micro_batch = cfg.TRAIN.BATCH_SIZE * ctx.world_size  # samples per micro-step, all ranks
        self.epoch_samples = _epoch_samples(loader, micro_batch, cfg.TRAIN.ACCUM_STEPS)
        loader.sampler.set_epoch(state.epoch, start=state.samples_in_epoch)  # one shuffle for all
        iters = (self.epoch_samples - state.samples_in_epoch) // micro_batch
        progress = Progress(cfg, ctx.is_main, ctx.world_size, state.epoch, iters)
        lr, data_total, gpus = self.schedule.peak, 0.0, self.strategy.gpus()
        _reset_peak_memory(gpus)
        epoch_start = tick = time.perf_counter()
        try:
            for it, (images, target) in zip(range(iters), loader):
                images = images.to(ctx.device, non_blocking=True)
                target = target.to(ctx.device, non_blocking=True)
                data_s = time.perf_counter() - tick
                data_total += data_s
                epoch = state.epoch + state.samples_in_epoch / self.epoch_samples
                lr = self.schedule.apply(stepper.optimizer, epoch)
                step = stepper.micro_step(images, target)
                state.samples_in_epoch += micro_batch
                state.global_step += step.last
                counter.update(step.logits, step.target, step.loss)  # on the device: no sync
                if step.last and cfg.TRAIN.COMPILE and not self.first_step_s:
                    self.first_step_s = time.perf_counter() - tick  # compile time: not throughput
                    log.info(
                        f"torch.compile + first step: {self.first_step_s:.1f}s (left out of img/s)"
                    )
                if (it + 1) % cfg.TRAIN.PRINT_FREQ == 0:  # the same iterations on every rank
                    self.settle()
                # rank 0's running averages every PRINT_FREQ iterations: a host sync there
                printed = progress.step(it, data_s, images.size(0), lr, counter.result)
                if printed is not None:
                    self.call("after_print", printed)
                self.call("after_step", step, printed)  # step checkpoints, stop signals
                tick = time.perf_counter()
        finally:
            progress.close()  # also when a hook ends the run (Preempted): the bar left finished
        _synchronize(gpus)  # the GPU runs behind the host: the epoch ends with its last kernel
        seconds = time.perf_counter() - epoch_start - self.first_step_s
        self.settle()
        result = counter.reduce().result()
        bad = len(data.unreadable_so_far(loader, state.unreadable))  # each image once
        state.unreadable = []
        if bad and ctx.is_main:
            log.warning(
                f"{bad} unreadable training images skipped in epoch {state.epoch + 1} "
                "(TRAIN.BAD_IMAGES skip)"
            )
        result.update(lr=lr, img_per_s=result["n"] / max(seconds, 1e-9), time_s=seconds)
        result.update(bad_images=bad, skipped_steps=stepper.take_epoch_skips())
        result.update(data_frac=data_total / max(seconds, 1e-9))
        result.update(peak_mem_mb=_peak_memory_mb(ctx.device, gpus))
        return result

    def test_chosen_checkpoint(self) -> dict:
        """Evaluate best.pth (the best on the validation split; last.pth
        if none) on the test set once, then the after_eval hooks (split
        "test"). With TRAIN.BEST_METRIC ema_top1 the EMA weights of that
        checkpoint are tested."""
        cfg, ctx, folder = self.cfg, self.ctx, self.folder
        # A finished run whose start trained nothing more (a resume
        # moves records after its checkpoint away): testing the same
        # checkpoint again would only add the same row. Rank 0 reads,
        # all hear.
        done = comm.broadcast_object(
            folder.recorded_test() if self.resumed and ctx.is_main else None
        )
        if done is not None:
            log.info(
                "[test] already recorded in metrics.jsonl: epoch %s, top-1 %.2f%% (the run was "
                "finished)",
                done.get("epoch"),
                done.get("top1") or 0.0,
            )
            return done
        path = folder.best()
        if path is None:
            raise UserError(
                f"no checkpoint in {folder.checkpoints} to test (the weights were never finite)"
            )
        ckpt = folder.load(path)
        weights = "ema" if cfg.TRAIN.BEST_METRIC == "ema_top1" else "model"
        net = self.strategy.test_model(self.model, ckpt, weights, folder.checkpoints)
        result = evaluation.evaluate(net, self.test_loader, cfg, ctx, self.stepper)
        result.pop("confusion")  # the record keeps per-class top-1; confusion.csv: best val's
        record = {
            "epoch": ckpt.get("epoch"),
            "split": "test",
            **result,
            "topk": cfg.TRAIN.TOPK,
            "weights": os.path.basename(path),
        }
        log.info(
            "[test] %s (epoch %s, chosen on the validation split) | loss %.4f | %s | n %d",
            path,
            record["epoch"],
            result["loss"],
            accuracies(result["top1"], cfg.TRAIN.TOPK, result["topk_acc"], "top-", "%"),
            result["n"],
        )
        self.call("after_eval", "test", [record])
        return record

    # -- the state: save and resume
    # -------------------------------------------------------------
    def save(self, is_best: bool = False, train_sums: torch.Tensor | None = None) -> None:
        """Collective: every rank calls it. Rank 0 writes everything
        that decides the rest of the run: the counters, every rank's RNG
        streams, the stepper's state (scaler, EMA) and the strategy's
        model/optimizer entries. ``train_sums``: the part-done epoch's
        metrics (a mid-epoch checkpoint)."""
        cfg, ctx, state = self.cfg, self.ctx, self.state
        rngs = comm.all_gather_object(rng.rng_state())  # each rank's own streams
        if train_sums is not None:  # mid-epoch: the epoch's sums and counters so far
            train_sums = comm.all_reduce_sum(train_sums.clone()).tolist()
            state.unreadable = data.unreadable_so_far(self.train_loader, state.unreadable)
        saved = {k: getattr(state, k) for k in TrainState.SAVED}
        record = {
            **self.stepper.state_dict(),
            **saved,
            "cfg": cfg.dump(),
            "rng": rngs,
            "world_size": ctx.world_size,
            "train_sums": train_sums,
            "facts": state.data_identity,
            "seed": self.seed,
            model_card.CARD_KEY: self.card.to_dict(),
            "shard_plan": data.shard_plan(self.train_loader),
        }
        entries, finite = self.strategy.checkpoint_state(
            self.model, self.optimizer, self.folder.shards_path(saved)
        )
        record.update(entries)
        if ctx.is_main and finite:
            path = self.folder.save(record, is_best=is_best)
            log.info(f"saved {path}{' (best)' if is_best else ''}")
        # Every rank learns whether rank 0 refused the checkpoint (and
        # waits for its write): weights that are not finite stay so, so
        # the run ends at the first refusal rather than training on.
        if comm.max_over_ranks([not finite])[0]:
            epoch = state.epoch + 1 if state.samples_in_epoch else state.epoch
            net = models.unwrap(self.model)
            raise nonfinite.not_finite_weights(cfg, net, state.global_step, epoch)

    def resume(self, ckpt: dict[str, Any], path: str) -> None:
        """Continue from the run folder's newest intact checkpoint
        (TRAIN.AUTO_RESUME), at the very next batch. A checkpoint that
        does not fit this run (config, data, model or optimizer) is
        refused before anything is loaded."""
        cfg, state, strategy = self.cfg, self.state, self.strategy
        net, opt = models.unwrap(self.model), self.optimizer if cfg.TRAIN.LOAD_OPT else None
        plain = strategy.checkable(ckpt)  # sharded state's shapes: torch checks them on load
        self.folder.check_resume(
            ckpt, path, state.data_identity, net if plain else None, opt if plain else None
        )
        strategy.load_checkpoint(self.model, opt, ckpt, path, self.folder.checkpoints)
        for key in TrainState.SAVED:
            setattr(state, key, ckpt.get(key, getattr(state, key)))
        data.require_same_plan(self.train_loader, state.samples_in_epoch, ckpt, path)
        state.resumed_sums = ckpt.get("train_sums")
        # A checkpoint of an older version has no seed: its RNG_SEED
        # None run shuffled with seed 0
        self._keep_seed(ckpt.get("seed", 0 if cfg.RNG_SEED is None else None))
        self._restore_rng(ckpt)
        log.info(
            "resumed from %s: %d epochs done, %d samples into epoch %d, step %d, best balanced "
            "top-1 %.2f (epoch %d)",
            path,
            state.epoch,
            state.samples_in_epoch,
            state.epoch + 1,
            state.global_step,
            state.best_metric,
            state.best_epoch,
        )
        self.stepper.load_state_dict(ckpt)
        self.resumed = True

    def _restore_rng(self, ckpt: dict[str, Any]) -> None:
        """This rank's RNG streams, as saved; after a change of world
        size they cannot be carried over and keep their fresh seeds (the
        sampler position is in samples: the epoch goes on with the next
        unseen samples)."""
        ctx, saved_world = self.ctx, ckpt.get("world_size", self.ctx.world_size)
        if saved_world == ctx.world_size:
            rng.set_rng_state(ckpt["rng"][ctx.rank])
            return
        log.warning(
            "resuming %d processes from a checkpoint of %d: the global batch and the LR are "
            "recomputed (see the line above); the epoch continues at sample %d; RNG streams are "
            "re-seeded",
            ctx.world_size,
            saved_world,
            self.state.samples_in_epoch,
        )

    def _keep_seed(self, seed: int | None) -> None:
        """A resumed run shuffles with the seed it started with
        (RNG_SEED None: env.json normally hands it over before the data
        is built; this covers a run folder whose env.json is gone)."""
        if seed is None or seed == self.seed:
            return
        log.warning(
            "resume: the checkpoint's run used seed %d, not %d: its shuffle continues",
            seed,
            self.seed,
        )
        self.seed = seed
        self.train_loader.sampler.seed = seed  # env.json is written after the resume


def _epoch_samples(loader: Any, micro_batch: int, accum: int) -> int:
    """A full epoch in samples: whole optimizer steps only (a partial
    accumulation is dropped); a shard loader plans its own steps, which
    run every sample (data/shards/plan.py)."""
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
    """Peak GPU memory of this epoch (the fullest GPU's, under dp), or
    this process's peak resident set on CPU."""
    if device.type == "cuda":
        return max(torch.cuda.max_memory_allocated(g) for g in (gpus or [device])) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def fit(cfg: CfgNode, ctx: DistContext, hooks: Iterable[HookBase] = ()) -> dict[str, Any]:
    """Train for OPTIM.MAX_EPOCH epochs (resuming if asked) with the
    built-in hooks, TRAIN.HOOKS and ``hooks``; return the run's summary
    (best, best_epoch, epochs, wall_s, out_dir[, test])."""
    return Trainer(cfg, ctx, hooks).fit()

"""The training loop, readable top to bottom.

``fit(cfg, ctx)`` call order:
  1. seed every RNG (RNG_SEED, or a fresh seed chosen by rank 0 and logged)
  2. model: build_model -> SyncBN (MODEL.SYNCBN, several processes) -> device -> DDP (several processes)
  3. optimizer (SGD) and the per-iteration LR: peak_lr(global batch) x lr_factor(fractional epoch)
  4. data: training loader (resumable shuffled shards) and validation loader (exact sharding)
  5. resume from OUT_DIR/checkpoints (TRAIN.AUTO_RESUME), at the very next batch; MODEL.WEIGHTS
     was applied in build_model
  6. per epoch: train_epoch (step checkpoints, preemption) -> evaluate -> metrics.jsonl -> checkpoint
  7. a one-line summary
``evaluate`` is exact for any world size: each rank counts its own disjoint shard, and the counts
are summed with one all-reduce at the end. Checkpoints are collective (all ranks call
``save_checkpoint``: the per-rank RNG states are gathered) and written by rank 0.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from yacs.config import CfgNode

from distribuuuu import checkpoint, data, distributed, faults, models, optim
from distribuuuu.distributed import DistContext
from distribuuuu.errors import UserError
from distribuuuu.logger import LOGGER_NAME, MetricsWriter, Progress, format_seconds
from distribuuuu.metrics import Counter
from distribuuuu.summary import write_run_record

log = logging.getLogger(LOGGER_NAME)


@dataclass
class TrainState:
    """What the loop carries from step to step, and what a checkpoint restores."""

    epoch: int = 0  # epochs completed
    samples_in_epoch: int = 0  # samples of the epoch in progress consumed by all ranks together
    global_step: int = 0  # optimizer steps taken
    best_top1: float = float("-inf")
    best_epoch: int = 0
    bad_steps: int = 0  # consecutive non-finite steps
    resumed_sums: list[float] | None = None  # train sums of a resumed, part-done epoch (all ranks)


class Preempted(Exception):
    """A preemption signal arrived; a step checkpoint was written and the run must end."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum} after a checkpoint")
        self.signum = signum


class NonFiniteLoss(RuntimeError):
    """The loss or the gradients stayed non-finite (TRAIN.NONFINITE)."""


def seed_everything(cfg: CfgNode, rank: int) -> int:
    """Seed python/numpy/torch with RNG_SEED + rank (augmentations differ per rank); return the seed."""
    seed = cfg.RNG_SEED
    if seed is None:
        seed = distributed.broadcast_object(random.SystemRandom().randrange(2**31))
        log.info("RNG_SEED is None: using seed %d (pass RNG_SEED %d to repeat this run)", seed, seed)
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)
    return seed


def build_model(cfg: CfgNode, ctx: DistContext) -> torch.nn.Module:
    """The model on its device, wrapped in DDP when there are several processes."""
    model = models.build_model(cfg)
    if cfg.MODEL.SYNCBN and ctx.distributed:
        model = models.convert_syncbn(model)
    model = model.to(ctx.device)
    log.info("model %s: %.2fM parameters", cfg.MODEL.ARCH, models.count_parameters(model) / 1e6)
    if ctx.distributed:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        model = DDP(model, device_ids=device_ids)
    return model


def _grads_finite(model: torch.nn.Module) -> bool:
    """Whether every gradient is finite. DDP has already averaged the gradients, so a NaN on any
    rank is a NaN on all of them and every rank reaches the same answer without a collective."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return True
    norms = torch._foreach_norm(grads)  # one multi-tensor kernel instead of a loop
    return bool(torch.isfinite(torch.stack(norms)).all())  # the host sync this check costs


def train_epoch(model: torch.nn.Module, loader: Any, optimizer: torch.optim.Optimizer,
                criterion: torch.nn.Module, cfg: CfgNode, ctx: DistContext, state: TrainState,
                peak_lr: float, ckpt_timer: "CheckpointTimer") -> dict[str, float]:
    """Train on this rank's shard from state.samples_in_epoch to the end of the epoch.

    Returns the epoch's metrics summed over all ranks. Raises Preempted after writing a step
    checkpoint when a preemption signal arrived on any rank.
    """
    model.train()
    counter = Counter(ctx.device, cfg.TRAIN.TOPK)
    if state.resumed_sums is not None and ctx.is_main:  # the part of the epoch done before the restart
        counter.add(state.resumed_sums)
    state.resumed_sums = None
    global_batch = cfg.TRAIN.BATCH_SIZE * ctx.world_size
    epoch_samples = len(loader.dataset) // global_batch * global_batch  # a full epoch, all ranks
    loader.sampler.set_epoch(state.epoch, start=state.samples_in_epoch)  # the same shuffle on all ranks
    iters = len(loader)
    progress = Progress(cfg, ctx.is_main, ctx.world_size, state.epoch, iters)
    lr, data_total = peak_lr, 0.0
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    epoch_start = tick = time.perf_counter()
    for it, (images, target) in enumerate(loader):
        images = images.to(ctx.device, non_blocking=True)
        target = target.to(ctx.device, non_blocking=True)
        data_s = time.perf_counter() - tick
        data_total += data_s

        lr = peak_lr * optim.lr_factor(cfg, state.epoch + state.samples_in_epoch / epoch_samples)
        optim.set_lr(optimizer, lr)
        logits = model(images)
        loss = criterion(logits, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        state.samples_in_epoch += global_batch
        if cfg.TRAIN.NONFINITE != "off" and not _grads_finite(model):
            _on_nonfinite(cfg, state)  # skip this step (or raise NonFiniteLoss)
        else:
            state.bad_steps = 0
            optimizer.step()
            state.global_step += 1
            counter.update(logits, target, loss)  # on-device sums: no host sync here
        # Shows rank 0's running averages every PRINT_FREQ iterations: the loop's other host sync.
        progress.step(it, data_s, images.size(0), lr, counter.result)

        stop_signal = faults.stop_signal()
        by_steps = cfg.TRAIN.CKPT_PERIOD_STEPS and state.global_step % cfg.TRAIN.CKPT_PERIOD_STEPS == 0
        stop, by_time = distributed.any_rank([stop_signal is not None, ctx.is_main and ckpt_timer.due()])
        if (stop or by_steps or by_time) and state.samples_in_epoch < epoch_samples:
            save_checkpoint(cfg, ctx, model, optimizer, state, ckpt_timer, train_sums=counter.sums_with_n())
        if stop:
            progress.close()
            raise Preempted(stop_signal or 0)
        tick = time.perf_counter()
    progress.close()
    seconds = time.perf_counter() - epoch_start
    result = counter.reduce().result()
    bad_count = torch.tensor([data.take_bad_image_count(loader)], device=ctx.device)
    bad = int(distributed.all_reduce_sum(bad_count)[0])
    if bad:  # each file was named in the log when it was met
        log.warning("epoch %d: %d unreadable training images skipped (TRAIN.BAD_IMAGES skip)", state.epoch + 1, bad)
    result["bad_images"] = bad
    result.update(lr=lr, img_per_s=result["n"] / max(seconds, 1e-9), time_s=seconds,
                  data_frac=data_total / max(seconds, 1e-9), peak_mem_mb=_peak_memory_mb(ctx.device))
    return result


def _on_nonfinite(cfg: CfgNode, state: TrainState) -> None:
    state.bad_steps += 1
    if cfg.TRAIN.NONFINITE == "stop" or state.bad_steps > cfg.TRAIN.NONFINITE_MAX_SKIPS:
        raise NonFiniteLoss(
            f"non-finite loss or gradients at step {state.global_step + 1} ({state.bad_steps} in a row; "
            f"TRAIN.NONFINITE {cfg.TRAIN.NONFINITE}, NONFINITE_MAX_SKIPS {cfg.TRAIN.NONFINITE_MAX_SKIPS}); "
            "lower OPTIM.BASE_LR or check the data")
    log.warning("non-finite loss or gradients: step skipped on every rank (%d in a row, at most %d)",
                state.bad_steps, cfg.TRAIN.NONFINITE_MAX_SKIPS)


def _peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory of this epoch, or this process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: Any, criterion: torch.nn.Module, cfg: CfgNode,
             ctx: DistContext) -> dict[str, float]:
    """Exact loss/top-1/top-k over the whole validation set, whatever the world size."""
    # Run the bare module: DDP's forward may broadcast buffers, a collective that would hang
    # when ranks hold different numbers of validation batches.
    net = models.unwrap(model)
    net.eval()
    counter = Counter(ctx.device, cfg.TRAIN.TOPK)
    iters = len(loader)
    for it, (images, target) in enumerate(loader):
        images = images.to(ctx.device, non_blocking=True)
        target = target.to(ctx.device, non_blocking=True)
        logits = net(images)
        counter.update(logits, target, criterion(logits, target))
        if ctx.is_main and (it + 1) % cfg.TEST.PRINT_FREQ == 0:
            log.info("[val] iter %d/%d", it + 1, iters)
    return counter.reduce().result()


class CheckpointTimer:
    """Rank 0's clock for TRAIN.CKPT_PERIOD_MIN (the decision is then shared with any_rank)."""

    def __init__(self, minutes: float) -> None:
        self.period_s, self.last = minutes * 60.0, time.monotonic()

    def due(self) -> bool:
        return self.period_s > 0 and time.monotonic() - self.last >= self.period_s

    def reset(self) -> None:
        self.last = time.monotonic()


def _all_finite(state_dict: dict[str, torch.Tensor]) -> bool:
    floats = [t for t in state_dict.values() if t.is_floating_point()]
    return not floats or bool(torch.isfinite(torch.stack(torch._foreach_norm(floats))).all())


def save_checkpoint(cfg: CfgNode, ctx: DistContext, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, state: TrainState, timer: CheckpointTimer,
                    is_best: bool = False, train_sums: torch.Tensor | None = None) -> None:
    """Collective: every rank calls it. Rank 0 writes everything that decides the rest of the run."""
    rng = distributed.all_gather_object(checkpoint.rng_state())  # each rank's own streams
    if train_sums is not None:  # a mid-epoch checkpoint carries the epoch's metrics so far
        train_sums = distributed.all_reduce_sum(train_sums.clone()).tolist()
    timer.reset()
    if ctx.is_main:
        weights = models.state_dict_for_saving(model)
        if not _all_finite(weights):
            log.error("not saving a checkpoint at step %d: the weights are not finite", state.global_step)
        else:
            path = checkpoint.save(
                {"model": weights, "optimizer": optimizer.state_dict(), "epoch": state.epoch,
                 "samples_in_epoch": state.samples_in_epoch, "global_step": state.global_step,
                 "best_top1": state.best_top1, "best_epoch": state.best_epoch, "cfg": cfg.dump(),
                 "rng": rng, "world_size": ctx.world_size, "train_sums": train_sums},
                cfg.OUT_DIR, is_best=is_best, keep=cfg.TRAIN.CKPT_KEEP)
            log.info("saved %s%s", path, " (best)" if is_best else "")
    distributed.barrier()  # nobody races ahead (or exits) while rank 0 writes


def _resume(cfg: CfgNode, ctx: DistContext, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer, state: TrainState) -> None:
    """Continue from OUT_DIR/checkpoints when TRAIN.AUTO_RESUME finds a checkpoint there."""
    if not cfg.TRAIN.AUTO_RESUME:
        return
    ckpt, path = checkpoint.load_latest(cfg.OUT_DIR)
    if ckpt is None:
        return
    models.unwrap(model).load_state_dict(ckpt["model"])
    if cfg.TRAIN.LOAD_OPT and "optimizer" in ckpt:
        optimizer.load_state_dict(ckpt["optimizer"])
    state.epoch, state.global_step = ckpt["epoch"], ckpt["global_step"]
    state.samples_in_epoch = ckpt.get("samples_in_epoch", 0)
    state.best_top1, state.best_epoch = ckpt["best_top1"], ckpt["best_epoch"]
    state.resumed_sums = ckpt.get("train_sums")
    saved_world = ckpt.get("world_size", ctx.world_size)
    if saved_world == ctx.world_size:
        checkpoint.set_rng_state(ckpt["rng"][ctx.rank])
    else:
        # The sampler position is counted in samples, so the epoch goes on with the next unseen
        # samples; each rank's RNG streams cannot be carried over and keep their fresh seeds.
        log.warning("resuming %d processes from a checkpoint of %d: the global batch is now %d and the "
                    "peak LR %g; the epoch continues at sample %d; RNG streams are re-seeded",
                    ctx.world_size, saved_world, cfg.TRAIN.BATCH_SIZE * ctx.world_size,
                    optim.peak_lr(cfg, cfg.TRAIN.BATCH_SIZE * ctx.world_size), state.samples_in_epoch)
    log.info("resumed from %s: %d epochs done, %d samples into epoch %d, step %d, best top-1 %.2f",
             path, state.epoch, state.samples_in_epoch, state.epoch + 1, state.global_step, state.best_top1)


def fit(cfg: CfgNode, ctx: DistContext) -> dict[str, Any]:
    """Train for OPTIM.MAX_EPOCH epochs (resuming if asked); return the run's summary."""
    wall_start = time.perf_counter()
    seed_everything(cfg, ctx.rank)
    model = build_model(cfg, ctx)
    write_run_record(cfg, ctx, models.unwrap(model))  # env.json, model.txt; a collective
    optimizer = optim.build_optimizer(cfg, model)
    criterion = torch.nn.CrossEntropyLoss().to(ctx.device)
    train_loader = data.build_train_loader(cfg, ctx.rank, ctx.world_size, ctx.device)
    val_loader = data.build_val_loader(cfg, ctx.rank, ctx.world_size, ctx.device)
    global_batch = cfg.TRAIN.BATCH_SIZE * ctx.world_size
    peak_lr = optim.peak_lr(cfg, global_batch)
    # The facts of the run, computed and logged once.
    log.info("world size %d | batch %d per process, %d global | peak LR %g (BASE_LR %g, LR_SCALING %s) | "
             "%d train / %d val samples | %d iterations per epoch",
             ctx.world_size, cfg.TRAIN.BATCH_SIZE, global_batch, peak_lr, cfg.OPTIM.BASE_LR,
             cfg.OPTIM.LR_SCALING, len(train_loader.dataset), len(val_loader.dataset), len(train_loader))
    if len(train_loader) == 0:
        raise UserError("the training loader has no batches; lower TRAIN.BATCH_SIZE or use more data")

    state = TrainState()
    _resume(cfg, ctx, model, optimizer, state)
    metrics = MetricsWriter(cfg.OUT_DIR, ctx.is_main)
    timer = CheckpointTimer(cfg.TRAIN.CKPT_PERIOD_MIN)
    while state.epoch < cfg.OPTIM.MAX_EPOCH:
        train = train_epoch(model, train_loader, optimizer, criterion, cfg, ctx, state, peak_lr, timer)
        distributed.average_buffers(model)  # one model on every rank for eval and the checkpoint
        state.epoch, state.samples_in_epoch = state.epoch + 1, 0
        metrics.write({"epoch": state.epoch, "split": "train", **train, "step": state.global_step})
        log.info("[train] epoch %d/%d done | loss %.4f | acc@1 %.2f | acc@%d %.2f | %.0f img/s | %.1fs",
                 state.epoch, cfg.OPTIM.MAX_EPOCH, train["loss"], train["top1"], cfg.TRAIN.TOPK,
                 train["top5"], train["img_per_s"], train["time_s"])
        is_best = False
        if state.epoch % cfg.TRAIN.EVAL_PERIOD == 0 or state.epoch == cfg.OPTIM.MAX_EPOCH:
            val = evaluate(model, val_loader, criterion, cfg, ctx)
            is_best = val["top1"] > state.best_top1
            if is_best:
                state.best_top1, state.best_epoch = val["top1"], state.epoch
            metrics.write({"epoch": state.epoch, "split": "val", **val, "topk": cfg.TRAIN.TOPK})
            log.info("[val] epoch %d/%d | loss %.4f | top-1 %.2f%% | top-%d %.2f%% | n %d | best top-1 %.2f%% (epoch %d)",
                     state.epoch, cfg.OPTIM.MAX_EPOCH, val["loss"], val["top1"], cfg.TRAIN.TOPK,
                     val["top5"], val["n"], state.best_top1, state.best_epoch)
        save_checkpoint(cfg, ctx, model, optimizer, state, timer, is_best=is_best)

    metrics.close()
    summary = {"best_top1": state.best_top1, "best_epoch": state.best_epoch, "epochs": state.epoch,
               "wall_s": time.perf_counter() - wall_start, "out_dir": os.path.abspath(cfg.OUT_DIR)}
    log.info("done: best val top-1 %.2f%% (epoch %d) | %d epochs | wall %s | run folder %s",
             summary["best_top1"], summary["best_epoch"], summary["epochs"],
             format_seconds(summary["wall_s"]), cfg.OUT_DIR)
    return summary


def run_eval(cfg: CfgNode, ctx: DistContext) -> dict[str, Any]:
    """Evaluate MODEL.WEIGHTS (or the run folder's best/last checkpoint) on the val split."""
    weights = cfg.MODEL.WEIGHTS
    if not weights:
        for name in ("best.pth", "last.pth"):
            candidate = os.path.join(checkpoint.checkpoint_dir(cfg.OUT_DIR), name)
            if os.path.isfile(candidate):
                weights = candidate
                break
        else:
            raise UserError("eval needs weights: pass MODEL.WEIGHTS PATH, or an OUT_DIR whose "
                            "checkpoints/ holds best.pth or last.pth")
        cfg = cfg.clone()
        cfg.defrost()
        cfg.MODEL.WEIGHTS = weights
        cfg.freeze()
    seed_everything(cfg, ctx.rank)
    model = models.build_model(cfg).to(ctx.device)  # loads MODEL.WEIGHTS
    loader = data.build_val_loader(cfg, ctx.rank, ctx.world_size, ctx.device)
    criterion = torch.nn.CrossEntropyLoss().to(ctx.device)
    start = time.perf_counter()
    result = evaluate(model, loader, criterion, cfg, ctx)
    log.info("[eval] %s | loss %.4f | top-1 %.2f%% | top-%d %.2f%% | n %d | %.1fs", weights,
             result["loss"], result["top1"], cfg.TRAIN.TOPK, result["top5"], result["n"],
             time.perf_counter() - start)
    record = {"epoch": None, "split": "val", **result, "topk": cfg.TRAIN.TOPK, "weights": weights}
    MetricsWriter(cfg.OUT_DIR, ctx.is_main).write(record)
    return record

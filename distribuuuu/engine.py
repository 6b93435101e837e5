"""The training loop, readable top to bottom.

``fit(cfg, ctx)`` call order:
  1. seed every RNG (RNG_SEED, or a fresh seed chosen by rank 0 and logged)
  2. model: build_model -> SyncBN (MODEL.SYNCBN, several processes) -> device -> DDP (several processes)
  3. optimizer (SGD) and the per-iteration LR: peak_lr(global batch) x lr_factor(fractional epoch)
  4. data: training loader (DistributedSampler) and validation loader (exact sharding)
  5. resume from OUT_DIR/checkpoints (TRAIN.AUTO_RESUME); MODEL.WEIGHTS was applied in build_model
  6. per epoch: sampler.set_epoch -> train_epoch -> evaluate -> metrics.jsonl -> checkpoint (rank 0)
  7. a one-line summary
``evaluate`` is exact for any world size: each rank counts its own disjoint shard, and the counts
are summed with one all-reduce at the end.
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

from distribuuuu import checkpoint, data, distributed, models, optim
from distribuuuu.distributed import DistContext
from distribuuuu.errors import UserError
from distribuuuu.logger import LOGGER_NAME, MetricsWriter, Progress, format_seconds
from distribuuuu.metrics import Counter

log = logging.getLogger(LOGGER_NAME)


@dataclass
class TrainState:
    """What the loop carries from one epoch to the next (and into checkpoints)."""

    epoch: int = 0  # epochs completed
    global_step: int = 0  # optimizer steps taken
    best_top1: float = float("-inf")
    best_epoch: int = 0


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


def train_epoch(model: torch.nn.Module, loader: Any, optimizer: torch.optim.Optimizer,
                criterion: torch.nn.Module, cfg: CfgNode, ctx: DistContext, state: TrainState,
                peak_lr: float) -> dict[str, float]:
    """One pass over this rank's shard; returns the epoch's metrics summed over all ranks."""
    model.train()
    counter = Counter(ctx.device, cfg.TRAIN.TOPK)
    iters = len(loader)
    epoch = state.epoch  # 0-based index of the epoch being trained
    progress = Progress(cfg, ctx.is_main, ctx.world_size, epoch, iters)
    lr, data_total = peak_lr, 0.0
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    epoch_start = tick = time.perf_counter()
    for it, (images, target) in enumerate(loader):
        images = images.to(ctx.device, non_blocking=True)
        target = target.to(ctx.device, non_blocking=True)
        data_s = time.perf_counter() - tick
        data_total += data_s

        lr = peak_lr * optim.lr_factor(cfg, epoch + it / iters)
        optim.set_lr(optimizer, lr)
        logits = model(images)
        loss = criterion(logits, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        state.global_step += 1
        counter.update(logits, target, loss)  # on-device sums: no host sync here
        # Shows rank 0's running averages every PRINT_FREQ iterations: the loop's only host sync.
        progress.step(it, data_s, images.size(0), lr, counter.result)
        tick = time.perf_counter()
    progress.close()
    seconds = time.perf_counter() - epoch_start
    result = counter.reduce().result()
    result.update(lr=lr, img_per_s=result["n"] / max(seconds, 1e-9), time_s=seconds,
                  data_frac=data_total / max(seconds, 1e-9), peak_mem_mb=_peak_memory_mb(ctx.device))
    return result


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


def _resume(cfg: CfgNode, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            state: TrainState) -> None:
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
    state.best_top1, state.best_epoch = ckpt["best_top1"], ckpt["best_epoch"]
    if "rng" in ckpt and distributed.get_rank() == 0:
        checkpoint.set_rng_state(ckpt["rng"])
    log.info("resumed from %s: %d epochs done, step %d, best top-1 %.2f",
             path, state.epoch, state.global_step, state.best_top1)


def fit(cfg: CfgNode, ctx: DistContext) -> dict[str, Any]:
    """Train for OPTIM.MAX_EPOCH epochs (resuming if asked); return the run's summary."""
    wall_start = time.perf_counter()
    seed_everything(cfg, ctx.rank)
    model = build_model(cfg, ctx)
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
    _resume(cfg, model, optimizer, state)
    metrics = MetricsWriter(cfg.OUT_DIR, ctx.is_main)
    while state.epoch < cfg.OPTIM.MAX_EPOCH:
        train_loader.sampler.set_epoch(state.epoch)  # a new shuffle each epoch, the same on all ranks
        train = train_epoch(model, train_loader, optimizer, criterion, cfg, ctx, state, peak_lr)
        distributed.average_buffers(model)  # one model on every rank for eval and the checkpoint
        state.epoch += 1
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
        if ctx.is_main:
            path = checkpoint.save(
                {"model": models.state_dict_for_saving(model), "optimizer": optimizer.state_dict(),
                 "epoch": state.epoch, "global_step": state.global_step, "best_top1": state.best_top1,
                 "best_epoch": state.best_epoch, "cfg": cfg.dump(), "rng": checkpoint.rng_state()},
                cfg.OUT_DIR, is_best=is_best, keep=cfg.TRAIN.CKPT_KEEP)
            log.info("saved %s%s", path, " (best)" if is_best else "")
        distributed.barrier()  # nobody races ahead while rank 0 writes

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

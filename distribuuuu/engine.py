"""The training loop, readable top to bottom.

``fit(cfg, ctx)`` call order:
  1. seed every RNG (RNG_SEED, or a fresh seed chosen by rank 0 and logged)
  2. model: build_model -> SyncBN (MODEL.SYNCBN, several processes) -> device -> channels_last
     -> DDP (several processes) -> torch.compile (TRAIN.COMPILE)
  3. optimizer (OPTIM.OPTIMIZER), the per-iteration LR: peak_lr(global batch) x lr_factor(epoch),
     and the Stepper (AMP, accumulation, mixup, clipping, non-finite check, EMA)
  4. data: training loader (resumable shuffled shards) and validation loader (exact sharding)
  5. resume from OUT_DIR/checkpoints (TRAIN.AUTO_RESUME), at the very next batch; MODEL.WEIGHTS
     was applied in build_model
  6. per epoch: train_epoch (step checkpoints, preemption) -> evaluate (raw and EMA) ->
     metrics.jsonl -> checkpoint -> early stopping
  7. a one-line summary
``evaluate`` is exact for any world size: each rank counts its own disjoint shard, and the counts
are summed with one all-reduce at the end. Checkpoints are collective (checkpoint.save_run).
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import time
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from yacs.config import CfgNode

from distribuuuu import checkpoint, data, distributed, faults, models, optim, resume_check, run_folder, sharding
from distribuuuu.checkpoint import CheckpointTimer, TrainState
from distribuuuu.distributed import DistContext
from distribuuuu.errors import UserError
from distribuuuu.logger import LOGGER_NAME, MetricsWriter, Progress, format_seconds
from distribuuuu.metrics import Counter
from distribuuuu.summary import write_run_record
from distribuuuu.stepper import AMP_DTYPES, AutocastDataParallel, Stepper

log = logging.getLogger(LOGGER_NAME)


class Preempted(Exception):
    """A preemption signal arrived; a step checkpoint was written and the run must end."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum} after a checkpoint")
        self.signum = signum


class NonFiniteLoss(UserError, RuntimeError):
    """The loss or the gradients stayed non-finite (TRAIN.NONFINITE).

    A UserError: the cure is a setting (the LR, clipping) or the data, so every rank ends with one
    message and exit status 2, no traceback. The ranks agree on it (the step's vote, or the
    epoch's reduced loss), so none is left waiting; checkpoints and metrics so far stay.
    """


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
    """The model on its device, wrapped for the strategy, maybe compiled (see wrap_model)."""
    return wrap_model(cfg, ctx, models.build_model(cfg))


def wrap_model(cfg: CfgNode, ctx: DistContext, model: torch.nn.Module) -> torch.nn.Module:
    """SyncBN -> device -> channels_last -> activation checkpointing -> DDP or FSDP (several
    processes) or DataParallel (dp) -> torch.compile."""
    if cfg.MODEL.SYNCBN and ctx.distributed:
        if ctx.device.type == "cuda":
            model = models.convert_syncbn(model)
        else:  # torch's DDP accepts SyncBatchNorm on CUDA modules only
            log.warning("MODEL.SYNCBN True: SyncBatchNorm needs CUDA; this CPU run keeps per-process BatchNorm")
    log.info("model %s: %.2fM parameters", cfg.MODEL.ARCH, models.count_parameters(model) / 1e6)
    # With CPU offload FSDP moves the parameters to the CPU itself; the compute stays on the device.
    model = model.to(ctx.device)
    if cfg.TRAIN.CHANNELS_LAST:
        model = model.to(memory_format=torch.channels_last)
    units = sharding.blocks(model)
    if cfg.TRAIN.ACTIVATION_CHECKPOINTING:
        log.info("activation checkpointing: %d blocks recompute their activations in the backward pass",
                 sharding.checkpoint_activations(model, units))
    d = cfg.DIST
    if ctx.distributed and d.STRATEGY == "fsdp":
        model = sharding.shard(model, units, d.FSDP_RESHARD_AFTER_FORWARD, d.CPU_OFFLOAD)
    elif ctx.distributed:  # 'ddp' and 'zero1' (whose difference is in the optimizer)
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # None (BUCKET_CAP_MB 0) keeps torch's small first bucket, which starts communicating sooner.
        model = DDP(model, device_ids=device_ids, bucket_cap_mb=d.BUCKET_CAP_MB or None,
                    static_graph=d.STATIC_GRAPH, gradient_as_bucket_view=d.GRADIENT_AS_BUCKET_VIEW,
                    find_unused_parameters=d.FIND_UNUSED_PARAMETERS)
    elif d.STRATEGY == "fsdp":
        log.warning("DIST.STRATEGY fsdp with one process: nothing to shard, training unsharded")
    elif d.STRATEGY == "dp" and torch.cuda.device_count() > 1:
        # One process drives all GPUs (the seed's snmc_dp); its replicas keep TRAIN.AMP's dtype.
        model = AutocastDataParallel(model, AMP_DTYPES[cfg.TRAIN.AMP])
    if cfg.TRAIN.COMPILE:
        model = torch.compile(model)  # compiles lazily, at the first step (timed apart)
    return model


def train_epoch(stepper: Stepper, loader: Any, cfg: CfgNode, ctx: DistContext, state: TrainState,
                peak_lr: float, timer: CheckpointTimer) -> dict[str, float]:
    """Train on this rank's shard from state.samples_in_epoch to the end of the epoch.

    Returns the epoch's metrics summed over all ranks. Raises Preempted after writing a step
    checkpoint when a preemption signal arrived on any rank.
    """
    stepper.model.train()
    counter = Counter(ctx.device, cfg.TRAIN.TOPK)
    if state.resumed_sums is not None and ctx.is_main:  # the part of the epoch done before a restart
        counter.add(state.resumed_sums)
    state.resumed_sums = None
    micro_batch = cfg.TRAIN.BATCH_SIZE * ctx.world_size  # samples per micro-step, all ranks
    accum = cfg.TRAIN.ACCUM_STEPS
    # A full epoch in samples: whole optimizer steps only (a partial accumulation is dropped).
    epoch_samples = len(loader.dataset) // micro_batch // accum * accum * micro_batch
    loader.sampler.set_epoch(state.epoch, start=state.samples_in_epoch)  # same shuffle on all ranks
    iters = (epoch_samples - state.samples_in_epoch) // micro_batch
    progress = Progress(cfg, ctx.is_main, ctx.world_size, state.epoch, iters)
    lr, data_total, first_step_s = peak_lr, 0.0, 0.0
    gpus = _gpus(stepper.model, ctx.device)
    for gpu in gpus:
        torch.cuda.reset_peak_memory_stats(gpu)
    epoch_start = tick = time.perf_counter()
    for it, (images, target) in zip(range(iters), loader):
        images = images.to(ctx.device, non_blocking=True)
        target = target.to(ctx.device, non_blocking=True)
        data_s = time.perf_counter() - tick
        data_total += data_s

        lr = peak_lr * optim.lr_factor(cfg, state.epoch + state.samples_in_epoch / epoch_samples)
        optim.set_lr(stepper.optimizer, lr)
        out = stepper.micro_step(images, target)
        state.samples_in_epoch += micro_batch
        counter.update(out.logits, out.target, out.loss)  # on-device sums: no host sync here
        if out.stepped is False:
            _on_nonfinite(cfg, state)  # every rank skipped this step (or raises NonFiniteLoss)
        elif out.stepped:
            state.bad_steps, state.global_step = 0, state.global_step + 1
            if cfg.TRAIN.COMPILE and state.global_step == 1:  # compile time is not throughput
                first_step_s = time.perf_counter() - tick
                log.info("torch.compile + first step: %.1fs (left out of img/s)", first_step_s)
        # Shows rank 0's running averages every PRINT_FREQ iterations: a host sync on print steps.
        progress.step(it, data_s, images.size(0), lr, counter.result)
        if out.stepped is not None:
            _maybe_checkpoint_or_stop(stepper, cfg, ctx, state, timer, counter, epoch_samples, progress)
        tick = time.perf_counter()
    progress.close()
    for gpu in gpus:  # the GPU runs behind the host: the epoch ends when its last kernel does
        torch.cuda.synchronize(gpu)
    seconds = time.perf_counter() - epoch_start - first_step_s
    result = counter.reduce().result()
    bad_count = torch.tensor([data.take_bad_image_count(loader)], device=ctx.device)
    bad = int(distributed.all_reduce_sum(bad_count)[0])
    if bad:  # each file was named in the log when it was met
        log.warning("epoch %d: %d unreadable training images skipped (TRAIN.BAD_IMAGES skip)", state.epoch + 1, bad)
    result.update(lr=lr, img_per_s=result["n"] / max(seconds, 1e-9), time_s=seconds, bad_images=bad,
                  data_frac=data_total / max(seconds, 1e-9), peak_mem_mb=_peak_memory_mb(ctx.device, gpus))
    return result


def _maybe_checkpoint_or_stop(stepper: Stepper, cfg: CfgNode, ctx: DistContext, state: TrainState,
                              timer: CheckpointTimer, counter: Counter, epoch_samples: int,
                              progress: Progress) -> None:
    """At a step boundary: a step checkpoint when due, and the end of the run after a signal."""
    stop_signal = faults.stop_signal()
    by_steps = cfg.TRAIN.CKPT_PERIOD_STEPS and state.global_step % cfg.TRAIN.CKPT_PERIOD_STEPS == 0
    # One small all-reduce: all ranks must take the same decision, or a collective would hang. Its
    # latency grows with the ranks, so the ranks vote every vote_period() steps and at the epoch's
    # end: a signal or a due time-based checkpoint is acted on at the next vote.
    vote = state.global_step % vote_period(cfg, ctx.world_size) == 0 or state.samples_in_epoch >= epoch_samples
    stop, by_time = distributed.any_rank([stop_signal is not None, ctx.is_main and timer.due()]) if vote else (
        False, False)
    if (stop or by_steps or by_time) and state.samples_in_epoch < epoch_samples:
        checkpoint.save_run(cfg, ctx, stepper.model, stepper.optimizer, stepper.state_dict(), state,
                            timer, train_sums=counter.sums_with_n())
    if stop and state.samples_in_epoch >= epoch_samples:
        state.stop_signal = stop_signal or signal.SIGTERM  # the epoch is complete: end it, then stop
    elif stop:
        progress.close()
        raise Preempted(stop_signal or signal.SIGTERM)


def vote_period(cfg: CfgNode, world_size: int) -> int:
    """Optimizer steps between two stop/checkpoint votes: DIST.VOTE_PERIOD_STEPS, or with 0 (auto)
    every step up to 8 processes and every 10 beyond (a vote's latency grows with the processes)."""
    if cfg.DIST.VOTE_PERIOD_STEPS:
        return cfg.DIST.VOTE_PERIOD_STEPS
    return 1 if world_size <= 8 else 10


def _nonfinite_advice(cfg: CfgNode) -> str:
    """What to change after non-finite numbers, and what is kept (the end of NonFiniteLoss's message)."""
    clip = ("lower TRAIN.CLIP_GRAD_NORM" if cfg.TRAIN.CLIP_GRAD_NORM > 0
            else "clip the gradients (e.g. TRAIN.CLIP_GRAD_NORM 1.0)")
    return (f"lower OPTIM.BASE_LR (now {cfg.OPTIM.BASE_LR:g}), {clip}, or check the data for bad values; "
            f"the checkpoints and metrics so far are kept in {cfg.OUT_DIR}")


def _on_nonfinite(cfg: CfgNode, state: TrainState) -> None:
    state.bad_steps += 1
    if cfg.TRAIN.NONFINITE == "stop" or state.bad_steps > cfg.TRAIN.NONFINITE_MAX_SKIPS:
        setting = ("TRAIN.NONFINITE stop ends the run at the first one" if cfg.TRAIN.NONFINITE == "stop" else
                   f"TRAIN.NONFINITE skip allows NONFINITE_MAX_SKIPS {cfg.TRAIN.NONFINITE_MAX_SKIPS} in a row")
        raise NonFiniteLoss(f"non-finite loss or gradients at step {state.global_step + 1} "
                            f"({state.bad_steps} in a row; {setting}); {_nonfinite_advice(cfg)}")
    log.warning("non-finite loss or gradients: step skipped on every rank (%d in a row, at most %d)",
                state.bad_steps, cfg.TRAIN.NONFINITE_MAX_SKIPS)


def _gpus(model: torch.nn.Module, device: torch.device) -> list[torch.device]:
    """The GPUs this process computes on: DataParallel's every device, else the device (none on CPU)."""
    if device.type != "cuda":
        return []
    dp = getattr(model, "_orig_mod", model)
    if isinstance(dp, torch.nn.DataParallel):
        return [torch.device("cuda", i) for i in dp.device_ids]
    return [device]


def _peak_memory_mb(device: torch.device, gpus: list[torch.device] | None = None) -> float:
    """Peak GPU memory of this epoch (the fullest GPU's, under dp), or this process's peak resident set on CPU."""
    if device.type == "cuda":
        return max(torch.cuda.max_memory_allocated(g) for g in (gpus or [device])) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: Any, cfg: CfgNode, ctx: DistContext,
             stepper: Stepper | None = None) -> dict[str, float]:
    """Exact loss/top-1/top-k over the whole validation set, whatever the world size."""
    # Run the bare module: DDP's forward may broadcast buffers, a collective that would hang
    # when ranks hold different numbers of validation batches.
    net = models.unwrap(model)
    net.eval()
    criterion = torch.nn.CrossEntropyLoss()  # plain: val loss is comparable across recipes
    counter = Counter(ctx.device, cfg.TRAIN.TOPK)
    iters = len(loader)
    for it, (images, target) in enumerate(loader):
        images = images.to(ctx.device, non_blocking=True)
        target = target.to(ctx.device, non_blocking=True)
        if stepper is not None:
            with stepper.autocast():
                logits = net(stepper.prepare(images))
        else:
            logits = net(images)
        counter.update(logits, target, criterion(logits.float(), target))
        if ctx.is_main and (it + 1) % cfg.TEST.PRINT_FREQ == 0:
            log.info("[val] iter %d/%d", it + 1, iters)
    result = counter.reduce().result()
    # Unreadable images are left out, not replaced (data.collate_readable): n counts the readable ones.
    bad = int(distributed.all_reduce_sum(torch.tensor([data.take_bad_image_count(loader)], device=ctx.device))[0])
    if bad and ctx.is_main:  # each file was named in the log when it was met
        log.warning("evaluation: %d unreadable images left out; n counts the %d readable ones", bad, result["n"])
    return {**result, "bad_images": bad}


def fit(cfg: CfgNode, ctx: DistContext) -> dict[str, Any]:
    """Train for OPTIM.MAX_EPOCH epochs (resuming if asked); return the run's summary."""
    wall_start = time.perf_counter()
    seed_everything(cfg, ctx.rank)
    bare = models.build_model(cfg)
    write_run_record(cfg, ctx, bare)  # env.json, model.txt (before sharding); a collective
    model = wrap_model(cfg, ctx, bare)
    optimizer = optim.build_optimizer(cfg, model)
    train_loader = data.build_train_loader(cfg, ctx.rank, ctx.world_size, ctx.device)
    val_loader = data.build_val_loader(cfg, ctx.rank, ctx.world_size, ctx.device)  # TRAIN.VAL_SPLIT: held out
    test_loader = data.build_test_loader(cfg, ctx.rank, ctx.world_size, ctx.device) if cfg.TRAIN.VAL_SPLIT else None
    # FSDP's forward is a collective: evaluate a whole replica instead (sharding.EvalReplica).
    replica = sharding.EvalReplica(lambda: models.build_model(cfg), ctx.device) if sharding.is_sharded(
        models.unwrap(model)) else None
    global_batch = cfg.TRAIN.BATCH_SIZE * ctx.world_size * cfg.TRAIN.ACCUM_STEPS
    peak_lr = optim.peak_lr(cfg, global_batch)
    stepper = Stepper(cfg, ctx.device, model, optimizer, global_batch)
    # The facts of the run, computed and logged once.
    log.info("world size %d | batch %d per process x %d accumulation = %d global | peak LR %g (BASE_LR %g, "
             "LR_SCALING %s) | %d train / %d val samples | %d optimizer steps per epoch",
             ctx.world_size, cfg.TRAIN.BATCH_SIZE, cfg.TRAIN.ACCUM_STEPS, global_batch, peak_lr,
             cfg.OPTIM.BASE_LR, cfg.OPTIM.LR_SCALING, len(train_loader.dataset), len(val_loader.dataset),
             len(train_loader) // cfg.TRAIN.ACCUM_STEPS)
    if ctx.device.type == "cuda":
        log.info("TF32 %s for float32 matmuls and convolutions (CUDNN.TF32 %s)",
                 "on" if cfg.CUDNN.TF32 else "off", cfg.CUDNN.TF32)
    sizes = {"train": len(train_loader.dataset), "valid" if test_loader is not None else "val": len(val_loader.dataset)}
    if test_loader is not None:
        sizes["test"] = len(test_loader.dataset)
    log.info(" - ".join(f"{k}: {v}" for k, v in sizes.items()))  # e.g. train: 45000 - valid: 5000 - test: 10000
    if len(train_loader) < cfg.TRAIN.ACCUM_STEPS:
        raise UserError("an epoch has no complete optimizer step; lower TRAIN.BATCH_SIZE or "
                        "TRAIN.ACCUM_STEPS, or use more data")

    state = TrainState(facts=resume_check.run_facts(len(train_loader.dataset), len(val_loader.dataset)))
    ckpt = checkpoint.resume_run(cfg, ctx, model, optimizer, state)
    if ckpt is not None:
        stepper.load_state_dict(ckpt)
    elif ctx.is_main and (moved := run_folder.set_aside_records(cfg.OUT_DIR)):
        log.warning(moved)  # a fresh start: records of an earlier run are kept, not appended to
    metrics = MetricsWriter(cfg.OUT_DIR, ctx.is_main)
    if ckpt is not None:  # a torn last line, and records of epochs the checkpoint does not hold: moved
        metrics.repair(state.epoch)
    timer = CheckpointTimer(cfg.TRAIN.CKPT_PERIOD_MIN)
    stop_reason = ""
    while state.epoch < cfg.OPTIM.MAX_EPOCH and not stop_reason:
        train = train_epoch(stepper, train_loader, cfg, ctx, state, peak_lr, timer)
        distributed.average_buffers(model)  # one model on every rank for eval and the checkpoint
        state.epoch, state.samples_in_epoch = state.epoch + 1, 0
        metrics.write({"epoch": state.epoch, "split": "train", **train, "step": state.global_step})
        log.info("[train] epoch %d/%d done | loss %.4f | acc@1 %.2f | acc@%d %.2f | %.0f img/s | %.1fs",
                 state.epoch, cfg.OPTIM.MAX_EPOCH, train["loss"], train["top1"], cfg.TRAIN.TOPK,
                 train["top5"], train["img_per_s"], train["time_s"])
        if cfg.TRAIN.NONFINITE == "off" and train["n"] and not math.isfinite(train["loss"]):
            # Steps are not checked then; the epoch's loss (reduced: the same on every rank) is,
            # before a checkpoint of the broken weights could replace the last good one.
            raise NonFiniteLoss(f"the training loss of epoch {state.epoch} (step {state.global_step}) is not "
                                "finite (TRAIN.NONFINITE off checks only each epoch's loss; skip or stop "
                                f"checks every step); {_nonfinite_advice(cfg)}")
        is_best = False
        if state.epoch % cfg.TRAIN.EVAL_PERIOD == 0 or state.epoch == cfg.OPTIM.MAX_EPOCH:
            net = replica.refresh(model) if replica is not None else model
            is_best, stop_reason = _evaluate_epoch(net, stepper, val_loader, cfg, ctx, state, metrics, wall_start)
            if replica is not None:
                replica.release()  # its GPU memory goes back to the sharded training
        checkpoint.save_run(cfg, ctx, model, optimizer, stepper.state_dict(), state, timer, is_best=is_best)
        if state.stop_signal:  # a preemption signal came at the epoch's last step
            raise Preempted(state.stop_signal)

    summary = {"best": state.best_metric, "best_epoch": state.best_epoch, "epochs": state.epoch,
               "wall_s": time.perf_counter() - wall_start, "out_dir": os.path.abspath(cfg.OUT_DIR)}
    if test_loader is not None:  # once, on the checkpoint that the validation split chose
        summary["test"] = test_chosen_checkpoint(model, replica, test_loader, cfg, ctx, stepper, metrics)
    metrics.close()
    log.info("done%s: best val %s %.2f%% (epoch %d) | %d epochs | wall %s | run folder %s",
             f" ({stop_reason})" if stop_reason else "", "top-1" if cfg.TRAIN.BEST_METRIC == "top1" else
             "EMA top-1", summary["best"], summary["best_epoch"], summary["epochs"],
             format_seconds(summary["wall_s"]), cfg.OUT_DIR)
    return summary


def _evaluate_epoch(model: torch.nn.Module, stepper: Stepper, loader: Any, cfg: CfgNode,
                    ctx: DistContext, state: TrainState, metrics: MetricsWriter,
                    wall_start: float) -> tuple[bool, str]:
    """Evaluate the raw model (and the EMA), update the best, and decide on early stopping."""
    results = {"top1": evaluate(model, loader, cfg, ctx, stepper)}
    if stepper.ema is not None:
        results["ema_top1"] = evaluate(stepper.ema.module, loader, cfg, ctx, stepper)
    value = results[cfg.TRAIN.BEST_METRIC]["top1"]
    is_best = value > state.best_metric
    if is_best:
        state.best_metric, state.best_epoch, state.evals_since_best = value, state.epoch, 0
    else:
        state.evals_since_best += 1
    stop_reason = ""
    for name, val in results.items():
        record = {"epoch": state.epoch, "split": "val" if name == "top1" else "val_ema", **val,
                  "topk": cfg.TRAIN.TOPK}
        if name == cfg.TRAIN.BEST_METRIC and cfg.TRAIN.TARGET_TOP1 and val["top1"] >= cfg.TRAIN.TARGET_TOP1:
            record["time_to_target_s"] = time.perf_counter() - wall_start
            stop_reason = (f"target top-1 {cfg.TRAIN.TARGET_TOP1:g}% reached after "
                           f"{format_seconds(record['time_to_target_s'])}")
        metrics.write(record)
        log.info("[%s] epoch %d/%d | loss %.4f | top-1 %.2f%% | top-%d %.2f%% | n %d", record["split"],
                 state.epoch, cfg.OPTIM.MAX_EPOCH, val["loss"], val["top1"], cfg.TRAIN.TOPK, val["top5"], val["n"])
    log.info("best %s %.2f%% (epoch %d)", cfg.TRAIN.BEST_METRIC, state.best_metric, state.best_epoch)
    if not stop_reason and cfg.TRAIN.PATIENCE and state.evals_since_best >= cfg.TRAIN.PATIENCE:
        stop_reason = f"early stop: no better {cfg.TRAIN.BEST_METRIC} in {cfg.TRAIN.PATIENCE} evaluations"
    return is_best, stop_reason


def test_chosen_checkpoint(model: torch.nn.Module, replica: sharding.EvalReplica | None, loader: Any,
                           cfg: CfgNode, ctx: DistContext, stepper: Stepper, metrics: MetricsWriter) -> dict:
    """Evaluate best.pth (the best on the validation split; last.pth if none) on the test set once.

    With TRAIN.BEST_METRIC ema_top1 the EMA weights of that checkpoint are tested.
    """
    folder = checkpoint.checkpoint_dir(cfg.OUT_DIR)
    path = next((p for p in (os.path.join(folder, n) for n in ("best.pth", "last.pth")) if os.path.isfile(p)), None)
    if path is None:
        raise UserError(f"no checkpoint in {folder} to test (the weights were never finite)")
    ckpt = checkpoint.load(path)
    net = models.unwrap(model)
    if ckpt.get("sharded"):  # training is over: the sharded model may take the chosen weights
        sharding.load_sharded(net, None, os.path.join(folder, ckpt["sharded"]))
        net = replica.refresh(net)
    else:
        weights = ckpt["ema"] if cfg.TRAIN.BEST_METRIC == "ema_top1" else ckpt["model"]
        net = replica.on_device() if replica is not None else models.build_model(cfg).to(ctx.device)
        net.load_state_dict(models.strip_wrapper_prefixes(weights))
    result = evaluate(net, loader, cfg, ctx, stepper)
    record = {"epoch": ckpt.get("epoch"), "split": "test", **result, "topk": cfg.TRAIN.TOPK,
              "weights": os.path.basename(path)}
    metrics.write(record)
    log.info("[test] %s (epoch %s, chosen on the validation split) | loss %.4f | top-1 %.2f%% | top-%d %.2f%% | n %d",
             path, record["epoch"], result["loss"], result["top1"], cfg.TRAIN.TOPK, result["top5"], result["n"])
    return record


def run_eval(cfg: CfgNode, ctx: DistContext) -> dict[str, Any]:
    """Evaluate MODEL.WEIGHTS (or the run folder's best/last checkpoint) on TEST.DATASET / TEST.SPLIT."""
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
    loader = data.build_test_loader(cfg, ctx.rank, ctx.world_size, ctx.device)  # never the held-out split
    start = time.perf_counter()
    result = evaluate(model, loader, cfg, ctx)
    log.info("[eval] %s | loss %.4f | top-1 %.2f%% | top-%d %.2f%% | n %d | %.1fs", weights,
             result["loss"], result["top1"], cfg.TRAIN.TOPK, result["top5"], result["n"],
             time.perf_counter() - start)
    record = {"epoch": None, "split": "val", **result, "topk": cfg.TRAIN.TOPK, "weights": weights}
    MetricsWriter(cfg.OUT_DIR, ctx.is_main).write(record)
    return record

"""Evaluation: exact metrics over a whole split, the epoch's validation, the test of the chosen
checkpoint, and ``run_eval`` (the ``eval`` command).

``evaluate`` is exact for any world size: each rank counts its own disjoint shard, and the counts
are summed with one all-reduce at the end. It runs the bare module: DDP's forward may broadcast
buffers, and FSDP's forward all-gathers, collectives that would hang when ranks hold different
numbers of batches (the strategy gives a whole replica for evaluation: Strategy.eval_model).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch
from yacs.config import CfgNode

from distribuuuu import checkpoint, data, inference, inferred, models
from distribuuuu.engine.state import seed_everything
from distribuuuu.engine.stepper import Stepper
from distribuuuu.errors import UserError
from distribuuuu.launch import comm
from distribuuuu.launch.group import DistContext
from distribuuuu.logger import write_eval_record
from distribuuuu.metrics import Counter

if TYPE_CHECKING:
    from distribuuuu.engine.trainer import Trainer

log = logging.getLogger("distribuuuu")


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: Any, cfg: CfgNode, ctx: DistContext,
             stepper: Stepper | None = None) -> dict[str, float]:
    """Exact loss/top-1/top-k over the whole validation set, whatever the world size."""
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
    # Unreadable images are left out, not replaced (data.batches.collate_readable): n counts the readable ones.
    bad = int(comm.all_reduce_sum(torch.tensor([data.take_bad_image_count(loader)], device=ctx.device))[0])
    if bad and ctx.is_main:  # each file was named in the log when it was met
        log.warning("evaluation: %d unreadable images left out; n counts the %d readable ones", bad, result["n"])
    return {**result, "bad_images": bad}


def validate(trainer: Trainer) -> None:
    """The epoch's evaluation: the raw model (and the EMA) on the validation split; updates the
    best (trainer.is_best, state.best_*) and sets trainer.eval_records for the after_eval hooks."""
    cfg, ctx, state, stepper = trainer.cfg, trainer.ctx, trainer.state, trainer.stepper
    net = trainer.strategy.eval_model(trainer.model)
    results = {"top1": evaluate(net, trainer.val_loader, cfg, ctx, stepper)}
    if stepper.ema is not None:
        results["ema_top1"] = evaluate(stepper.ema.module, trainer.val_loader, cfg, ctx, stepper)
    value = results[cfg.TRAIN.BEST_METRIC]["top1"]
    trainer.is_best = value > state.best_metric
    if trainer.is_best:
        state.best_metric, state.best_epoch, state.evals_since_best = value, state.epoch, 0
    else:
        state.evals_since_best += 1
    trainer.eval_split, trainer.eval_records = "val", []
    for name, val in results.items():
        record = {"epoch": state.epoch, "split": "val" if name == "top1" else "val_ema", **val, "topk": cfg.TRAIN.TOPK}
        trainer.eval_records.append(record)
        log.info("[%s] epoch %d/%d | loss %.4f | top-1 %.2f%% | top-%d %.2f%% | n %d", record["split"],
                 state.epoch, cfg.OPTIM.MAX_EPOCH, val["loss"], val["top1"], cfg.TRAIN.TOPK, val["top5"], val["n"])
    log.info("best %s %.2f%% (epoch %d)", cfg.TRAIN.BEST_METRIC, state.best_metric, state.best_epoch)


def test_chosen_checkpoint(trainer: Trainer) -> dict:
    """Evaluate best.pth (the best on the validation split; last.pth if none) on the test set once,
    then the after_eval hooks (split "test"). With TRAIN.BEST_METRIC ema_top1 the EMA weights of
    that checkpoint are tested."""
    cfg, ctx = trainer.cfg, trainer.ctx
    if trainer.resumed and (done := _recorded_test(cfg.OUT_DIR, ctx)) is not None:
        log.info("[test] already recorded in metrics.jsonl: epoch %s, top-1 %.2f%% (the run was finished)",
                 done.get("epoch"), done.get("top1") or 0.0)
        return done
    folder = checkpoint.checkpoint_dir(cfg.OUT_DIR)
    path = checkpoint.best_or_last(cfg.OUT_DIR)
    if path is None:
        raise UserError(f"no checkpoint in {folder} to test (the weights were never finite)")
    ckpt = checkpoint.load(path)
    weights = "ema" if cfg.TRAIN.BEST_METRIC == "ema_top1" else "model"
    net = trainer.strategy.test_model(trainer.model, ckpt, weights, folder)
    result = evaluate(net, trainer.test_loader, cfg, ctx, trainer.stepper)
    record = {"epoch": ckpt.get("epoch"), "split": "test", **result, "topk": cfg.TRAIN.TOPK,
              "weights": os.path.basename(path)}
    log.info("[test] %s (epoch %s, chosen on the validation split) | loss %.4f | top-1 %.2f%% | top-%d %.2f%% | n %d",
             path, record["epoch"], result["loss"], result["top1"], cfg.TRAIN.TOPK, result["top5"], result["n"])
    trainer.eval_split, trainer.eval_records = "test", [record]
    trainer.call("after_eval")
    return record


def _recorded_test(out_dir: str, ctx: DistContext) -> dict[str, Any] | None:
    """The test record that ends metrics.jsonl, if it does: the run was finished and this start
    trained nothing more (a resume moves records after its checkpoint away), so testing the same
    checkpoint again would only add the same row. Rank 0 reads, every rank gets it."""
    found = None
    if ctx.is_main:
        try:
            with open(os.path.join(out_dir, "metrics.jsonl"), "rb") as f:
                lines = [line for line in f.read().splitlines() if line.strip()]
            last = json.loads(lines[-1]) if lines else None
            found = last if isinstance(last, dict) and last.get("split") == "test" else None
        except (OSError, ValueError):
            found = None
    return comm.broadcast_object(found)


def run_eval(cfg: CfgNode, ctx: DistContext) -> dict[str, Any]:
    """Evaluate MODEL.WEIGHTS (or the run folder's best/last checkpoint) on TEST.DATASET / TEST.SPLIT."""
    cfg = inference.chosen_weights(cfg, "eval")  # the one resolution of eval, predict and export
    weights = cfg.MODEL.WEIGHTS
    seed_everything(cfg, ctx.rank)
    model = models.build_model(cfg).to(ctx.device)  # loads MODEL.WEIGHTS
    if cfg.TRAIN.VAL_SPLIT and inferred.test_is_training_data(cfg):  # a folder of class folders: its held-out part
        log.info("[eval] TEST.DATASET is the training data: evaluating the part TRAIN.VAL_SPLIT %g held out",
                 cfg.TRAIN.VAL_SPLIT)
        loader = data.build_val_loader(cfg, ctx.rank, ctx.world_size, ctx.device)
    else:
        loader = data.build_test_loader(cfg, ctx.rank, ctx.world_size, ctx.device)  # never the held-out split
    start = time.perf_counter()
    result = evaluate(model, loader, cfg, ctx)
    log.info("[eval] %s | loss %.4f | top-1 %.2f%% | top-%d %.2f%% | n %d | %.1fs", weights,
             result["loss"], result["top1"], cfg.TRAIN.TOPK, result["top5"], result["n"],
             time.perf_counter() - start)
    record = {"epoch": None, "split": "val", **result, "topk": cfg.TRAIN.TOPK, "weights": weights}
    write_eval_record(cfg.OUT_DIR, record, ctx.is_main)  # eval.jsonl: never the run's metrics.jsonl
    return record

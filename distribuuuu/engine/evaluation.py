"""Evaluation: exact counting of loss and top-k hits (Counter, also the training epoch's), exact metrics
over a whole split, the epoch's validation and the test of the chosen checkpoint (the ``eval``
command runs ``evaluate`` too: api.run_eval).

A Counter's sums live in one float64 tensor on the training device, so the hot loop never syncs with
the host; ``reduce()`` is its only collective and runs once, at the end of an epoch or evaluation.

``evaluate`` is exact for any world size: each rank counts its own disjoint shard, and the counts
are summed with one all-reduce at the end. It runs the bare module: DDP's forward may broadcast
buffers, and FSDP's forward all-gathers, collectives that would hang when ranks hold different
numbers of batches (the strategy gives a whole replica for evaluation: Strategy.eval_model).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from yacs.config import CfgNode

from distribuuuu import data, models
from distribuuuu.errors import UserError
from distribuuuu.launch import comm
from distribuuuu.launch.comm import DistContext

if TYPE_CHECKING:
    from distribuuuu.engine.trainer import Trainer
    from distribuuuu.optim import Stepper

log = logging.getLogger("distribuuuu")


def topk_hits(logits: torch.Tensor, target: torch.Tensor, ks: tuple[int, ...]) -> torch.Tensor:
    """Number of samples whose label is among the k best predictions, for each k in ks."""
    maxk = min(max(ks), logits.size(1))
    top = logits.topk(maxk, dim=1).indices  # [B, maxk]
    hit = top.eq(target.view(-1, 1))  # at most one True per row
    return torch.stack([hit[:, : min(k, maxk)].sum() for k in ks])


class Counter:
    """Sums of loss, top-1 hits, top-k hits and samples counted (on the device), and of samples seen
    (on the host). ``skip_nonfinite``: a batch whose loss is not finite is not counted (its step was
    skipped under TRAIN.NONFINITE skip/stop), so the epoch's loss stays a number; ``n`` then says how
    many samples the numbers cover."""

    def __init__(self, device: torch.device, topk: int, skip_nonfinite: bool = False) -> None:
        self.ks = (1, topk)
        self.skip_nonfinite = skip_nonfinite
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss_sum, hit1, hitk, counted
        self.n = 0  # samples seen, known on the host: no device round trip to count it

    @torch.no_grad()
    def update(self, logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor) -> None:
        """Add one batch; ``loss`` is the batch mean (as returned by the criterion)."""
        n = target.numel()
        hits = topk_hits(logits.detach(), target, self.ks).to(torch.float64)
        batch = torch.cat([(loss.detach().to(torch.float64) * n).reshape(1), hits, hits.new_tensor([n])])
        if self.skip_nonfinite:  # on the device: no host sync (where, not a product: NaN * 0 is NaN)
            batch = torch.where(torch.isfinite(batch[0]), batch, 0.0)
        self.sums += batch
        self.n += n

    def sums_with_n(self) -> torch.Tensor:
        """[loss_sum, hit1, hitk, n, counted] as one float64 tensor (for checkpoints of a part-done epoch)."""
        return torch.cat([self.sums[:3], self.sums.new_tensor([self.n]), self.sums[3:]])

    def add(self, sums_with_n: list[float]) -> None:
        """Add sums saved by ``sums_with_n`` (after a reduce): the part of an epoch done before a restart.
        Older checkpoints hold four numbers: every sample seen was counted."""
        counted = sums_with_n[4] if len(sums_with_n) > 4 else sums_with_n[3]
        self.sums += self.sums.new_tensor([*sums_with_n[:3], counted])
        self.n += int(sums_with_n[3])

    def reduce(self) -> Counter:
        """Sum over all ranks with one all-reduce; returns self."""
        both = comm.all_reduce_sum(self.sums_with_n())
        self.sums, self.n = both[[0, 1, 2, 4]], int(both[3].item())
        return self

    def result(self) -> dict[str, float]:
        """loss (mean), top1 and topk_acc (top-k at TRAIN.TOPK) in percent, n (samples counted). One host sync."""
        loss_sum, hit1, hitk, counted = self.sums.tolist()
        n = int(counted)
        if n == 0:
            return {"loss": float("nan"), "top1": float("nan"), "topk_acc": float("nan"), "n": 0}
        return {"loss": loss_sum / n, "top1": 100.0 * hit1 / n, "topk_acc": 100.0 * hitk / n, "n": n}


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
    return {**result, "bad_images": bad_images(loader, ctx, "unreadable images left out of the evaluation")}


def bad_images(loader: Any, ctx: DistContext, what: str) -> int:
    """Collective: the unreadable images the loader met since the last call, over all ranks, and rank
    0's warning (each file was named in the log when it was met)."""
    bad = int(comm.all_reduce_sum(torch.tensor([data.take_bad_image_count(loader)], device=ctx.device))[0])
    if bad and ctx.is_main:
        log.warning("%d %s", bad, what)
    return bad


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
                 state.epoch, cfg.OPTIM.MAX_EPOCH, val["loss"], val["top1"], cfg.TRAIN.TOPK, val["topk_acc"], val["n"])
    log.info("best %s %.2f%% (epoch %d)", cfg.TRAIN.BEST_METRIC, state.best_metric, state.best_epoch)


def test_chosen_checkpoint(trainer: Trainer) -> dict:
    """Evaluate best.pth (the best on the validation split; last.pth if none) on the test set once,
    then the after_eval hooks (split "test"). With TRAIN.BEST_METRIC ema_top1 the EMA weights of
    that checkpoint are tested."""
    cfg, ctx = trainer.cfg, trainer.ctx
    # A finished run whose start trained nothing more (a resume moves records after its checkpoint
    # away): testing the same checkpoint again would only add the same row. Rank 0 reads, all hear.
    done = comm.broadcast_object(trainer.run.recorded_test() if trainer.resumed and ctx.is_main else None)
    if done is not None:
        log.info("[test] already recorded in metrics.jsonl: epoch %s, top-1 %.2f%% (the run was finished)",
                 done.get("epoch"), done.get("top1") or 0.0)
        return done
    folder, path = trainer.run.checkpoints, trainer.run.best()
    if path is None:
        raise UserError(f"no checkpoint in {folder} to test (the weights were never finite)")
    ckpt = trainer.run.load(path)
    weights = "ema" if cfg.TRAIN.BEST_METRIC == "ema_top1" else "model"
    net = trainer.strategy.test_model(trainer.model, ckpt, weights, folder)
    result = evaluate(net, trainer.test_loader, cfg, ctx, trainer.stepper)
    record = {"epoch": ckpt.get("epoch"), "split": "test", **result, "topk": cfg.TRAIN.TOPK,
              "weights": os.path.basename(path)}
    log.info("[test] %s (epoch %s, chosen on the validation split) | loss %.4f | top-1 %.2f%% | top-%d %.2f%% | n %d",
             path, record["epoch"], result["loss"], result["top1"], cfg.TRAIN.TOPK, result["topk_acc"], result["n"])
    trainer.eval_split, trainer.eval_records = "test", [record]
    trainer.call("after_eval")
    return record

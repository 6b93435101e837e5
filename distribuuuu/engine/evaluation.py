"""Evaluation: exact counting of loss and top-k hits (Counter, also the
training epoch's; ClassCounter adds the confusion matrix,
CalibratedCounter the calibration error), exact metrics
over a whole split (``evaluate``: the epoch's validation, the test of
the chosen checkpoint and the ``eval`` command, api.run_eval), and the
epoch's validation records (``validate``).

A Counter's sums live in one float64 tensor on the training device, so
the hot loop never syncs with the host; ``reduce()`` is its only
collective and runs once, at the end of an epoch or evaluation.

``evaluate`` is exact for any world size: each rank counts its own
disjoint shard, and the counts are summed with one all-reduce at the
end. It runs the bare module: DDP's forward may broadcast buffers, and
FSDP's forward all-gathers, collectives that would hang when ranks hold
different numbers of batches (the strategy gives a whole replica for
evaluation: Strategy.eval_model).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from yacs.config import CfgNode

from distribuuuu import calibration, data, models
from distribuuuu.launch import comm
from distribuuuu.launch.comm import DistContext
from distribuuuu.logger import accuracies
from distribuuuu.optim import Stepper

log = logging.getLogger("distribuuuu")

FEW_IMAGES = 5  # a class judged on fewer: one image moves its top-1 by 20 points or more


def topk_hits(logits: torch.Tensor, target: torch.Tensor, k: int) -> torch.Tensor:
    """[B, min(k, classes)] bool: whether the j-th best prediction is the
    label (at most one True per row)."""
    return logits.topk(min(k, logits.size(1)), 1).indices == target[:, None]


class Counter:
    """Sums of loss, top-1 hits, top-k hits and samples counted (on the
    device), and of samples seen (on the host). ``skip_nonfinite``: a
    batch whose loss is not finite is not counted (its step was skipped
    under TRAIN.NONFINITE skip/stop), so the epoch's loss stays a
    number; ``n`` then says how many samples the numbers cover."""

    def __init__(self, device: torch.device, topk: int, skip_nonfinite: bool = False) -> None:
        self.k, self.skip_nonfinite = topk, skip_nonfinite
        # loss_sum, hit1, hitk, counted (float64: exact counts past 2**24)
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)
        self.n = 0  # samples seen, known on the host: no device round trip to count it
        self.unreadable = 0  # images left out (evaluation), summed by reduce()

    @torch.no_grad()
    def update(self, logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor) -> None:
        """Add one batch; ``loss`` is the batch mean (as the criterion
        returns it). No host sync."""
        n, hits = len(target), topk_hits(logits, target, self.k)
        count = hits.new_full((), n, dtype=torch.float64)  # a fill, not a host copy
        batch = torch.stack([loss * n, hits[:, 0].sum(), hits.any(1).sum(), count])
        if self.skip_nonfinite:  # where, not a product: NaN * 0 is NaN
            batch = torch.where(torch.isfinite(batch[0]), batch, 0.0)
        self.sums += batch
        self.n += n

    def sums_with_n(self) -> torch.Tensor:
        """[loss_sum, hit1, hitk, n, counted] as one float64 tensor (for
        checkpoints of a part-done epoch)."""
        return torch.cat([self.sums[:3], self.sums.new_tensor([self.n]), self.sums[3:]])

    def add(self, sums_with_n: list[float]) -> None:
        """Add sums saved by ``sums_with_n`` (after a reduce): the part
        of an epoch done before a restart. Older checkpoints hold four
        numbers: every sample seen was counted."""
        counted = sums_with_n[4] if len(sums_with_n) > 4 else sums_with_n[3]
        self.sums += self.sums.new_tensor([*sums_with_n[:3], counted])
        self.n += int(sums_with_n[3])

    def reduce(self, extra: torch.Tensor | None = None) -> Counter:
        """Sum over all ranks with one all-reduce (with this rank's
        unreadable count, and ``extra`` sums); returns self."""
        mine = [self.sums_with_n(), self.sums.new_tensor([self.unreadable])]
        both = comm.all_reduce_sum(torch.cat(mine if extra is None else [*mine, extra]))
        self.sums, self.n, self.unreadable = both[[0, 1, 2, 4]], int(both[3]), int(both[5])
        self.reduced_extra = both[6:]
        return self

    def result(self) -> dict[str, Any]:
        """loss (mean), top1 and topk_acc (top-k at TRAIN.TOPK) in
        percent, n (samples counted). One host sync."""
        loss_sum, hit1, hitk, counted = self.sums.tolist()
        n = int(counted)
        if n == 0:
            return {"loss": float("nan"), "top1": float("nan"), "topk_acc": float("nan"), "n": 0}
        return {"loss": loss_sum / n, "top1": 100 * hit1 / n, "topk_acc": 100 * hitk / n, "n": n}


class ClassCounter(Counter):
    """A Counter that also counts, for each true class, the samples
    predicted as each class (the confusion matrix: rows true, columns
    predicted), summed on the device and reduced with the same one
    all-reduce: exact under DDP. The prediction is topk's first, as
    for the top-1 hits, so the per-class accuracies weighted by their
    samples give top1 exactly."""

    def __init__(self, device: torch.device, topk: int, num_classes: int) -> None:
        super().__init__(device, topk)
        self.classes = num_classes
        self.confusion = torch.zeros(num_classes**2, dtype=torch.float64, device=device)

    @torch.no_grad()
    def update(self, logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor) -> None:
        super().update(logits, target, loss)
        pred = logits.detach().topk(min(self.k, self.classes), 1).indices[:, 0]  # as topk_hits's
        cells = torch.bincount(target * self.classes + pred, minlength=self.classes**2)
        self.confusion += cells.to(torch.float64)

    def reduce(self, extra: torch.Tensor | None = None) -> ClassCounter:
        cells = self.confusion.numel()
        super().reduce(self.confusion if extra is None else torch.cat([self.confusion, extra]))
        self.confusion, self.reduced_extra = self.reduced_extra[:cells], self.reduced_extra[cells:]
        return self

    def result(self) -> dict[str, Any]:
        """Counter's, with per_class_top1 (percent, class order; None
        for a class without samples), balanced_top1 (their mean: top-1
        as if every class had as many samples) and confusion (K x K
        counts, rows true)."""
        rows = self.confusion.view(self.classes, self.classes)
        counts, hits = rows.sum(1).tolist(), rows.diagonal().tolist()
        per_class = [100.0 * h / c if c else None for h, c in zip(hits, counts)]
        judged = [acc for acc in per_class if acc is not None]
        balanced = sum(judged) / len(judged) if judged else float("nan")
        return {
            **super().result(),
            "balanced_top1": balanced,
            "per_class_top1": per_class,
            "confusion": rows.to(torch.int64).tolist(),
        }


class CalibratedCounter(ClassCounter):
    """A ClassCounter that also sums the calibration bins of the logits
    as they are and divided by the checkpoint's temperature
    (calibration.py), in the same one all-reduce: the eval command's
    ECE before and after."""

    def __init__(self, device: torch.device, topk: int, num_classes: int, temperature: float):
        super().__init__(device, topk, num_classes)
        self.temperature = temperature
        self.bins = torch.zeros(2, 3, calibration.ECE_BINS, dtype=torch.float64, device=device)

    @torch.no_grad()
    def update(self, logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor) -> None:
        super().update(logits, target, loss)
        for row, temperature in enumerate((1.0, self.temperature)):
            self.bins[row] += calibration.bins(logits.double(), target, temperature)

    def reduce(self, extra: torch.Tensor | None = None) -> CalibratedCounter:
        super().reduce(self.bins.flatten())
        self.bins = self.reduced_extra.view_as(self.bins)
        return self

    def result(self) -> dict[str, Any]:
        """ClassCounter's, with ece and ece_calibrated (fractions, 15
        bins) and the temperature."""
        before, after = calibration.ece(self.bins)
        return {
            **super().result(),
            "ece": before,
            "ece_calibrated": after,
            "temperature": self.temperature,
        }


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    loader: Any,
    cfg: CfgNode,
    ctx: DistContext,
    stepper: Stepper | None = None,
    temperature: float | None = None,
) -> dict[str, Any]:
    """Exact loss/top-1/top-k and per-class top-1 (with the confusion
    matrix) over the whole split, whatever the world size; with a
    ``temperature``, the ECE before and after it too."""
    net = models.unwrap(model)
    net.eval()
    criterion = torch.nn.CrossEntropyLoss()  # plain: val loss is comparable across recipes
    classes = cfg.MODEL.NUM_CLASSES
    counter = (
        ClassCounter(ctx.device, cfg.TRAIN.TOPK, classes)
        if temperature is None
        else CalibratedCounter(ctx.device, cfg.TRAIN.TOPK, classes, temperature)
    )
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
    # Unreadable images are left out, not replaced (loading.batches.collate_readable): n
    # counts the readable ones.
    counter.unreadable = len(data.take_unreadable(loader.dataset))
    result = counter.reduce().result()
    if counter.unreadable and ctx.is_main:
        log.warning("%d unreadable images left out of the evaluation", counter.unreadable)
    return {**result, "bad_images": counter.unreadable}


def validate(
    nets: dict[str, torch.nn.Module],
    loader: Any,
    cfg: CfgNode,
    ctx: DistContext,
    stepper: Stepper,
    epoch: int,
    classes: list[str],
) -> tuple[list[dict[str, Any]], list[list[list[int]]]]:
    """The epoch's evaluation of each model (``nets``: split name ->
    module; "val", and "val_ema" for the EMA) on the validation split:
    their records, each logged, and each one's confusion matrix."""
    records, confusions = [], []
    for split, net in nets.items():
        result = evaluate(net, loader, cfg, ctx, stepper)
        confusion = result.pop("confusion")
        confusions.append(confusion)
        records.append({"epoch": epoch, "split": split, **result, "topk": cfg.TRAIN.TOPK})
        log.info(
            "[%s] epoch %d/%d | loss %.4f | %s | balanced top-1 %.2f%% | n %d%s",
            split,
            epoch,
            cfg.OPTIM.MAX_EPOCH,
            result["loss"],
            accuracies(result["top1"], cfg.TRAIN.TOPK, result["topk_acc"], "top-", "%"),
            result["balanced_top1"],
            result["n"],
            thinly_judged(classes, confusion),
        )
    return records, confusions


def thinly_judged(classes: list[str], matrix: list[list[int]]) -> str:
    """' | judged on < 5 images: cat 2, dog 1': the classes whose top-1
    moves by 20 points or more with one image ('' if none)."""
    few = [(name, sum(row)) for name, row in zip(classes, matrix) if 0 < sum(row) < FEW_IMAGES]
    if not few:
        return ""
    named = ", ".join(f"{name} {n}" for name, n in few[:10])
    more = f" and {len(few) - 10} more" if len(few) > 10 else ""
    return f" | judged on < {FEW_IMAGES} images: {named}{more}"


def confusion_csv(classes: list[str], matrix: list[list[int]]) -> str:
    """confusion.csv's text: a row per true class, a column per
    predicted class, class names as headers."""
    rows = [
        ["true \\ predicted", *classes],
        *([name, *map(str, counts)] for name, counts in zip(classes, matrix)),
    ]
    return "".join(",".join(_csv_cell(cell) for cell in row) + "\n" for row in rows)


def _csv_cell(text: str) -> str:
    return f'"{text.replace(chr(34), chr(34) * 2)}"' if any(c in text for c in ',"\n') else text


def worst_classes(
    classes: list[str], per_class: list[float | None], matrix: list[list[int]], n: int = 5
) -> str:
    """'cat 61.2% (49/80; 21 taken for dog), ...': the n classes with
    the lowest top-1, for the log."""
    scored = sorted((acc, i) for i, acc in enumerate(per_class) if acc is not None)[:n]
    parts = []
    for acc, i in scored:
        row = matrix[i]
        wrong = max((c for c in range(len(row)) if c != i), key=row.__getitem__, default=None)
        as_what = (
            f"; {row[wrong]} taken for {classes[wrong]}" if wrong is not None and row[wrong] else ""
        )
        parts.append(f"{classes[i]} {acc:.1f}% ({row[i]}/{sum(row)}{as_what})")
    return ", ".join(parts)

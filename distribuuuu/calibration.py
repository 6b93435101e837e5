"""Calibrated confidence: one temperature T that divides a model's
logits, so that softmax(logits / T) is as sure as the model is right.

T is fitted on the validation split by minimising its negative
log-likelihood (temperature scaling: Guo et al. 2017, "On Calibration
of Modern Neural Networks"), with a golden-section search over log T:
the NLL is convex in 1/T, so the search finds its one minimum. The
expected calibration error (ECE: 15 equal-width bins of the top-1
probability; the gap between confidence and accuracy in each, weighted
by its share of the images) is measured before and after. A positive T
keeps the order of the logits: top-1 is unchanged.

Exact under any world size: each rank keeps the logits of its own
disjoint shard of the split, and every number the search compares is a
sum over all ranks (one all-reduce), so every rank takes the same steps
and ends with the same T. The fit is written into the checkpoint's model
card (``store``): predict divides the logits by it, and the exported
files carry it in their card.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from distribuuuu import files, weights
from distribuuuu.errors import UserError
from distribuuuu.launch import comm

ECE_BINS = 15
LOG_T_BOUNDS = (math.log(0.05), math.log(20.0))  # where the search looks
# golden-section steps: the bracket shrinks to 0.618^40 of its width,
# about 1e-8 in log T
SEARCH_STEPS = 40
GOLDEN = (math.sqrt(5) - 1) / 2


def line(fit: dict[str, Any]) -> str:
    """A fit's numbers (calibrate's record), for the log."""
    same = fit["top1"] == fit["top1_calibrated"]
    after = "unchanged" if same else f"{fit['top1_calibrated']:.2f}% after"
    return (
        f"temperature {fit['temperature']:.4f} | ECE {100 * fit['ece']:.2f}% -> "
        f"{100 * fit['ece_calibrated']:.2f}% | NLL {fit['nll']:.4f} -> "
        f"{fit['nll_calibrated']:.4f} | top-1 {fit['top1']:.2f}% ({after}) | n {fit['n']}"
    )


def ece_text(result: dict[str, Any]) -> str:
    """'ECE 2.55% -> 2.26% at temperature 1.086' (an evaluation's
    record), or 'ECE 2.55% (uncalibrated)' for a temperature of 1."""
    before, after, temperature = result["ece"], result["ece_calibrated"], result["temperature"]
    if temperature == 1.0:
        return f"ECE {100 * before:.2f}% (uncalibrated)"
    return f"ECE {100 * before:.2f}% -> {100 * after:.2f}% at temperature {temperature:.4g}"


@torch.no_grad()
def shard_logits(
    net: torch.nn.Module, loader: Any, device: torch.device, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's logits (float32 forward, as predict runs; float64
    for the sums) and labels over the loader, in eval mode."""
    net.eval()
    logits = [torch.zeros(0, num_classes, dtype=torch.float64, device=device)]
    labels = [torch.zeros(0, dtype=torch.long, device=device)]
    for images, target in loader:
        logits.append(net(images.to(device, non_blocking=True)).double())
        labels.append(target.to(device, non_blocking=True))
    return torch.cat(logits), torch.cat(labels)


def _summed(values: list[torch.Tensor]) -> torch.Tensor:
    """The values, each summed over this rank's samples, summed over
    all ranks: one all-reduce."""
    return comm.all_reduce_sum(torch.stack(values))


def _nll_sum(logits: torch.Tensor, labels: torch.Tensor, log_t: float) -> torch.Tensor:
    z = logits / math.exp(log_t)
    return (z.logsumexp(1) - z.gather(1, labels[:, None])[:, 0]).sum()


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The T in exp(LOG_T_BOUNDS) with the least NLL over all ranks'
    samples (collective)."""

    def nll(log_t: float) -> float:
        return _summed([_nll_sum(logits, labels, log_t)]).item()

    lo, hi = LOG_T_BOUNDS
    a, b = hi - GOLDEN * (hi - lo), lo + GOLDEN * (hi - lo)
    nll_a, nll_b = nll(a), nll(b)
    for _ in range(SEARCH_STEPS):
        if nll_a <= nll_b:  # the minimum lies in [lo, b]
            hi, b, nll_b = b, a, nll_a
            a = hi - GOLDEN * (hi - lo)
            nll_a = nll(a)
        else:  # in [a, hi]
            lo, a, nll_a = a, b, nll_b
            b = lo + GOLDEN * (hi - lo)
            nll_b = nll(b)
    return math.exp((lo + hi) / 2)


def bins(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """[3, ECE_BINS]: the samples, the sum of their confidence (top-1
    probability) and of their hits, per bin (i/15, (i+1)/15]."""
    confidence, predicted = (logits / temperature).softmax(1).max(1)
    index = (confidence * ECE_BINS).ceil().long().clamp(1, ECE_BINS) - 1
    sums = torch.zeros(3, ECE_BINS, dtype=torch.float64, device=logits.device)
    for row, values in enumerate([torch.ones_like(confidence), confidence, predicted == labels]):
        sums[row].index_add_(0, index, values.double())
    return sums


def ece(summed: torch.Tensor) -> list[float]:
    """The ECE of each [3, ECE_BINS] in ``summed`` ([..., 3, ECE_BINS],
    summed over all ranks): the gap between hits and confidence in each
    bin, added up, over the samples."""
    n = summed[..., 0, :].sum(-1).clamp(min=1)
    return ((summed[..., 2, :] - summed[..., 1, :]).abs().sum(-1) / n).tolist()


def calibrate(
    net: torch.nn.Module, loader: Any, device: torch.device, num_classes: int
) -> dict[str, Any]:
    """Collective: the temperature of net on the loader's split (every
    rank holding its shard), with the split's size and its NLL, ECE
    and top-1 (percent) before and after (the *_calibrated keys)."""
    logits, labels = shard_logits(net, loader, device, num_classes)
    temperature = fit_temperature(logits, labels)
    nll = _summed([_nll_sum(logits, labels, 0.0), _nll_sum(logits, labels, math.log(temperature))])
    both = _summed([bins(logits, labels, 1.0), bins(logits, labels, temperature)])
    n = int(both[0, 0].sum().item())
    if n == 0:
        raise UserError("the validation split holds no images to fit a temperature on")
    nll, errors = (nll / n).tolist(), ece(both)
    top1 = (100.0 * both[:, 2].sum(1) / n).tolist()
    return {
        "temperature": temperature,
        "n": n,
        "nll": nll[0],
        "nll_calibrated": nll[1],
        "ece": errors[0],
        "ece_calibrated": errors[1],
        "top1": top1[0],
        "top1_calibrated": top1[1],
    }


def store(path: str, ckpt: dict[str, Any], fit: dict[str, Any]) -> bool:
    """Write the checkpoint file again with the fit in its model card,
    atomically, its digest renewed; the hard links to it in its folder
    (best.pth, last.pth, epoch_NNNN.pth) are made again to the new file.
    False, and nothing written, when the card holds this fit already."""
    card = ckpt[weights.CARD_KEY]
    if card.get("calibration") == fit:
        return False
    folder = os.path.dirname(path) or "."
    links = [
        os.path.join(folder, name)
        for name in os.listdir(folder)
        if name.endswith(".pth") and os.path.samefile(os.path.join(folder, name), path)
    ]
    state = {k: v for k, v in ckpt.items() if k != weights.INTEGRITY_KEY}
    state[weights.CARD_KEY] = {**card, "temperature": fit["temperature"], "calibration": fit}
    weights.save_checkpoint(state, path)
    for link in links:
        if not os.path.samefile(link, path):
            files.atomic_link(path, link)
    return True

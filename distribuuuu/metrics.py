"""Exact counting of loss and top-k hits, reduced across ranks once per epoch or evaluation.

Counts live in one float64 tensor on the training device, so the hot loop never syncs with the
host; ``reduce()`` is the only collective and runs once, at the end.
"""

from __future__ import annotations

import torch

from distribuuuu import distributed


def topk_hits(logits: torch.Tensor, target: torch.Tensor, ks: tuple[int, ...]) -> torch.Tensor:
    """Number of samples whose label is among the k best predictions, for each k in ks."""
    maxk = min(max(ks), logits.size(1))
    top = logits.topk(maxk, dim=1).indices  # [B, maxk]
    hit = top.eq(target.view(-1, 1))  # at most one True per row
    return torch.stack([hit[:, : min(k, maxk)].sum() for k in ks])


class Counter:
    """Sums of loss, top-1 hits, top-k hits and samples: [loss_sum, hit1, hitk, n]."""

    def __init__(self, device: torch.device, topk: int) -> None:
        self.ks = (1, topk)
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)

    @torch.no_grad()
    def update(self, logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor) -> None:
        """Add one batch; ``loss`` is the batch mean (as returned by the criterion)."""
        n = target.numel()
        hits = topk_hits(logits.detach(), target, self.ks).to(torch.float64)
        batch = torch.stack([loss.detach().to(torch.float64) * n, hits[0], hits[1],
                             torch.tensor(n, dtype=torch.float64, device=hits.device)])
        self.sums += batch

    def reduce(self) -> "Counter":
        """Sum over all ranks (one all-reduce); returns self."""
        distributed.all_reduce_sum(self.sums)
        return self

    def result(self) -> dict[str, float]:
        """loss (mean), top1/top5 in percent, n (samples counted). One host sync."""
        loss_sum, hit1, hitk, n = self.sums.tolist()
        if n == 0:
            return {"loss": float("nan"), "top1": float("nan"), "top5": float("nan"), "n": 0}
        return {"loss": loss_sum / n, "top1": 100.0 * hit1 / n, "top5": 100.0 * hitk / n, "n": int(n)}

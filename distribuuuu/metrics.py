"""Exact counting of loss and top-k hits, reduced across ranks once per epoch or evaluation.

Counts live in one float64 tensor on the training device, so the hot loop never syncs with the
host; ``reduce()`` is the only collective and runs once, at the end.
"""

from __future__ import annotations

import torch

from distribuuuu.launch import comm


def topk_hits(logits: torch.Tensor, target: torch.Tensor, ks: tuple[int, ...]) -> torch.Tensor:
    """Number of samples whose label is among the k best predictions, for each k in ks."""
    maxk = min(max(ks), logits.size(1))
    top = logits.topk(maxk, dim=1).indices  # [B, maxk]
    hit = top.eq(target.view(-1, 1))  # at most one True per row
    return torch.stack([hit[:, : min(k, maxk)].sum() for k in ks])


class Counter:
    """Sums of loss, top-1 hits and top-k hits (on the device) and of samples (on the host)."""

    def __init__(self, device: torch.device, topk: int) -> None:
        self.ks = (1, topk)
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss_sum, hit1, hitk
        self.n = 0  # known on the host: no device round trip to count it

    @torch.no_grad()
    def update(self, logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor) -> None:
        """Add one batch; ``loss`` is the batch mean (as returned by the criterion)."""
        n = target.numel()
        hits = topk_hits(logits.detach(), target, self.ks).to(torch.float64)
        self.sums[0] += loss.detach().to(torch.float64) * n
        self.sums[1:] += hits
        self.n += n

    def sums_with_n(self) -> torch.Tensor:
        """[loss_sum, hit1, hitk, n] as one float64 tensor (for checkpoints of a part-done epoch)."""
        return torch.cat([self.sums, self.sums.new_tensor([self.n])])

    def add(self, sums_with_n: list[float]) -> None:
        """Add sums saved by ``sums_with_n`` (after a reduce): the part of an epoch done before a restart."""
        self.sums += self.sums.new_tensor(sums_with_n[:3])
        self.n += int(sums_with_n[3])

    def reduce(self) -> Counter:
        """Sum over all ranks with one all-reduce; returns self."""
        both = comm.all_reduce_sum(self.sums_with_n())
        self.sums, self.n = both[:3], int(both[3].item())
        return self

    def result(self) -> dict[str, float]:
        """loss (mean), top1/top5 in percent, n (samples counted). One host sync."""
        if self.n == 0:
            return {"loss": float("nan"), "top1": float("nan"), "top5": float("nan"), "n": 0}
        loss_sum, hit1, hitk = self.sums.tolist()
        n = self.n
        return {"loss": loss_sum / n, "top1": 100.0 * hit1 / n, "top5": 100.0 * hitk / n, "n": n}

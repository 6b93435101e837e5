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
        """loss (mean), top1/top5 in percent, n (samples counted). One host sync."""
        loss_sum, hit1, hitk, counted = self.sums.tolist()
        n = int(counted)
        if n == 0:
            return {"loss": float("nan"), "top1": float("nan"), "top5": float("nan"), "n": 0}
        return {"loss": loss_sum / n, "top1": 100.0 * hit1 / n, "top5": 100.0 * hitk / n, "n": n}

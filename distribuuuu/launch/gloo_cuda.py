"""gloo on CUDA tensors (several ranks sharing a GPU): refuse, before
any work, what gloo cannot serve.

NCCL refuses two ranks on one GPU; gloo does not, because it runs a
collective on CUDA tensors by copying them through pinned host memory.
That makes ``DEVICE cuda DIST.BACKEND gloo`` with several ranks on one
GPU the way to exercise the multi-rank GPU code on a one-GPU machine
(docs/launching.md). torch 2.14's ProcessGroupGloo has CUDA paths for
broadcast, all-reduce, reduce, all-gather, gather, scatter and
all-to-all, and builds reduce-scatter and all-gather-into-one-tensor on
top of them; its coalesced all-reduce / all-gather and send/recv take
CPU tensors only. distribuuuu needs:

  every run       all-reduce (DDP buckets, exact eval counters, clipping), broadcast (DDP's and
                  ZeRO's)
  MODEL.SYNCBN    all-gather into a list (SyncBatchNorm's gloo branch)
  DIST.STRATEGY   fsdp: all-gather into one tensor (parameters), reduce-scatter with AVG (gradients)

Which collectives a torch build serves on CUDA tensors is that build's
business, so rather than a table a new torch could make wrong, ``check``
tries each needed one once on a tiny tensor right after the process
group is made. Every rank runs the same calls on the same shapes, so a
refusal is raised on every rank at the same point, as one UserError line
(exit 2), before any model or data exists.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from distribuuuu.errors import UserError

__all__ = ["check", "PROBES"]


def _all_reduce(device: torch.device, world: int) -> bool:
    t = torch.ones(3, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return bool((t == world).all())


def _broadcast(device: torch.device, world: int) -> bool:
    t = torch.full((3,), float(dist.get_rank()), device=device)
    dist.broadcast(t, src=0)
    return bool((t == 0).all())


def _all_gather(device: torch.device, world: int) -> bool:
    out = [torch.empty(2, device=device) for _ in range(world)]
    dist.all_gather(out, torch.full((2,), float(dist.get_rank()), device=device))
    return all(bool((o == r).all()) for r, o in enumerate(out))


def _all_gather_single(device: torch.device, world: int) -> bool:
    out = torch.empty(2 * world, device=device)
    _gather_into = (
        getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    )  # torch < 2.14's name
    _gather_into(out, torch.full((2,), float(dist.get_rank()), device=device))
    return bool((out == torch.arange(world, device=device).repeat_interleave(2)).all())


def _reduce_scatter_avg(device: torch.device, world: int) -> bool:
    out = torch.empty(2, device=device)
    _reduce_scatter = (
        getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    )  # torch < 2.14's
    _reduce_scatter(out, torch.ones(2 * world, device=device), op=dist.ReduceOp.AVG)
    return bool((out == 1).all())


# name -> (the probe: True when the result is right, what in the config
# needs it)
PROBES: dict[str, tuple[Callable[[torch.device, int], bool], str]] = {
    "all_reduce": (_all_reduce, "every multi-rank run"),
    "broadcast": (_broadcast, "every multi-rank run"),
    "all_gather": (_all_gather, "MODEL.SYNCBN True"),
    "all_gather_single": (_all_gather_single, "DIST.STRATEGY fsdp"),
    "reduce_scatter_single (AVG)": (_reduce_scatter_avg, "DIST.STRATEGY fsdp"),
}


def check(
    device: torch.device,
    collectives: list[str],
    probes: dict[str, tuple[Callable, str]] | None = None,
) -> None:
    """Collective: run the probe of each collective the run needs (names
    of PROBES: the strategy's ``collectives``) on ``device``; a refused
    or wrong one is a UserError naming the collective, the config key
    that needs it and the way out. ``probes``: PROBES (tests pass
    others)."""
    table = PROBES if probes is None else probes
    world = dist.get_world_size()
    for name in collectives if probes is None else list(table):
        probe, why = table[name]
        try:
            right = probe(device, world)
        except (RuntimeError, ValueError, NotImplementedError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise UserError(
                f"DIST.BACKEND gloo cannot run {name} on {device.type} tensors with torch "
                f"{torch.__version__} ({first}), which {why} needs; use DIST.BACKEND nccl with one "
                "process per GPU, or DEVICE cpu"
            ) from None
        if not right:
            raise UserError(
                f"DIST.BACKEND gloo returned wrong values for {name} on {device.type} tensors with "
                f"torch {torch.__version__}, which {why} needs; use DIST.BACKEND nccl with one "
                "process per GPU, or DEVICE cpu"
            )

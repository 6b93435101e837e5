"""Rank helpers and small collectives: they all work without a process group (rank 0 of 1).

Every collective must be called by every rank, in the same order; with nccl, tensors must be on
this rank's GPU. ``any_rank`` runs on a gloo side group under nccl (set by launch.group.setup), so
a per-step vote costs no host-device sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["get_world_size", "barrier", "all_reduce_sum", "average_buffers",
           "broadcast_object", "all_gather_object", "any_rank", "set_control_group"]

# A gloo group beside an nccl one, for any_rank(): its CPU all-reduce does not wait for the GPU
# queue, so a per-step decision costs no host-device sync. None: the default group (gloo).
_control_group: Any = None


def set_control_group(group: Any) -> None:
    """The group any_rank() votes on (None: the default group). Set by launch.group.setup/teardown."""
    global _control_group
    _control_group = group


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    """Processes in the default group (1 without one)."""
    return dist.get_world_size() if _initialized() else 1


def barrier() -> None:
    """Wait until every rank gets here (nothing to wait for without a group)."""
    if _initialized():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum t over all processes, in place, and return it. With nccl, t must be on the GPU."""
    if _initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def average_buffers(module: torch.nn.Module) -> None:
    """Average floating-point buffers (BatchNorm running statistics) over all processes.

    DDP keeps parameters identical but each rank's running statistics follow its own batches
    (DDP only copies rank 0's at the start of the next forward). Averaging them once per epoch
    makes every rank evaluate, and rank 0 save, the same model. One coalesced all-reduce.
    """
    buffers = [b for b in module.buffers() if b.is_floating_point()]
    if not _initialized() or not buffers:
        return
    flat = torch.cat([b.detach().reshape(-1) for b in buffers])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= get_world_size()
    offset = 0
    with torch.no_grad():
        for b in buffers:
            b.copy_(flat[offset: offset + b.numel()].view_as(b))
            offset += b.numel()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """The picklable obj of rank src, on every rank."""
    if not _initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable obj, in rank order, on every rank ([obj] for one process)."""
    if not _initialized():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def any_rank(flags: Sequence[bool]) -> list[bool]:
    """For each flag, whether it is set on ANY rank: one small all-reduce, so all ranks agree.

    Used at step boundaries for decisions that must be collective (stop after a signal, a
    time-based checkpoint): a rank acting alone would leave the others waiting in a collective.
    Under nccl it runs on a gloo side group with a CPU tensor: no GPU sync per step.
    """
    if not _initialized():
        return [bool(f) for f in flags]
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_control_group)  # None: the default (gloo) group
    return [bool(v) for v in t.tolist()]


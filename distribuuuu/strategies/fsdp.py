"""FSDP2 (``fully_shard``), with optional CPU offload: each rank holds
1/world of every parameter.

Order (Strategy.wrap_model): bare model on its device -> activation
checkpointing -> ``shard`` (every block, then the root) -> optimizer
over the sharded parameters. Each rank holds 1/world of every parameter,
its gradient and its optimizer state (ZeRO-3, Rajbhandari et al., 2020);
whole parameters exist only while a block runs. Four things differ from
DDP and live here:
  * state dicts are collectives (``full_state`` gathers them;
    ``save_sharded``/``load_sharded`` write and read each rank's shards
    with torch.distributed.checkpoint);
  * FSDP does not broadcast buffers: ``broadcast_buffers`` gives every
    rank rank 0's BatchNorm statistics before each forward and before a
    checkpoint, as DDP does, so a step checkpoint holds what every rank
    goes on from, and a resumed run is the straight one bit for bit;
  * the forward pass is a collective, so exact evaluation with uneven
    shards runs on a plain replica (``EvalReplica``) instead of the
    sharded model;
  * gradient checks must combine the ranks' shards (local shards + an
    all-reduce).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_map

from distribuuuu import models, optim
from distribuuuu.errors import UserError
from distribuuuu.launch import comm, signals
from distribuuuu.nonfinite import all_finite, local_tensor
from distribuuuu.strategies import Strategy, blocks

log = logging.getLogger("distribuuuu")

# The eager all-gather into one tensor: what launch/gloo_cuda.py probes
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def shard(
    model: nn.Module, units: list[nn.Module], reshard_after_forward: bool, cpu_offload: bool
) -> nn.Module:
    """FSDP2: shard every unit (``blocks(model)``), then the root (which
    takes the stem and the head). Parameters become DTensors sharded on
    dim 0 over the default process group."""
    kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if cpu_offload:  # parameters, gradients and the optimizer step live on the CPU
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for unit in units:
        # A checkpoint wrapper may hold the unit: shard the wrapper, so
        # both act on the same unit.
        holder = next(
            (w for w in model.modules() if getattr(w, "_checkpoint_wrapped_module", None) is unit),
            unit,
        )
        fully_shard(holder, **kwargs)
    fully_shard(model, **kwargs)
    log.info(
        "FSDP: %d blocks sharded over the process group (reshard after forward %s, CPU offload %s)",
        len(units),
        reshard_after_forward,
        cpu_offload,
    )
    return model


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
    """Collective: the whole model and optimizer state dicts, on rank
    0's CPU only (other ranks get empty dicts). The optimizer state is
    keyed by parameter name. torch's full_state_dict option gathers with
    DTensor.full_tensor(), which crashed under gloo on CUDA: each
    sharded tensor is gathered here by ``gathered``, one at a time, in
    the dicts' order (the same on every rank)."""
    options = StateDictOptions(full_state_dict=False)  # this rank's shards, clean names
    if optimizer is None:
        model_state, optim_state = get_model_state_dict(model, options=options), {}
    else:
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
    keep = dist.get_rank() == 0

    def whole(value: Any) -> Any:
        if isinstance(value, DTensor):
            value = gathered(value)
        if isinstance(value, torch.Tensor):
            return value.detach().to("cpu", copy=True) if keep else None
        return value

    model_state, optim_state = tree_map(whole, (model_state, optim_state))
    return (model_state, optim_state) if keep else ({}, {})


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    model_state: dict,
    optim_state: dict | None,
) -> None:
    """Collective: load whole state dicts (as ``full_state`` returns
    them, read on every rank) into the sharded model and optimizer."""
    options = StateDictOptions(full_state_dict=True)
    if optimizer is None or not optim_state:
        set_state_dict(
            model, (), model_state_dict=model_state, optim_state_dict={}, options=options
        )
    else:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=model_state,
            optim_state_dict=optim_state,
            options=options,
        )


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, folder: str) -> None:
    """Collective: each rank writes its own shards into folder
    (torch.distributed.checkpoint); nothing is gathered, so no rank ever
    holds the whole state."""
    model_state, optim_state = get_state_dict(model, optimizer)
    existed = os.path.exists(folder)
    try:
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=folder)
    except dcp.CheckpointException as e:  # a BaseException holding each failed rank's error
        if not existed:  # no .pth names a half-written folder, so nothing would ever prune it
            shutil.rmtree(folder, ignore_errors=True)
        interrupt = signals.interruption(e)
        if interrupt is not None:  # Ctrl-C / SIGTERM mid-write: a stop (130 / 143), not a crash
            raise interrupt from None
        rank, (error, _) = next(iter(e.failures.items()))
        raise OSError(
            f"writing the sharded checkpoint {folder} failed (rank {rank}: {type(error).__name__}: "
            f"{error}); the previous checkpoint is intact"
        ) from e


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer | None, folder: str) -> None:
    """Collective: read this rank's shards from a ``save_sharded``
    folder (any world size)."""
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, (), model_state_dict=state["model"], optim_state_dict={})
        return
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


@torch.compiler.disable  # a graph break under TRAIN.COMPILE: the broadcast stays eager
def broadcast_buffers(module: nn.Module, *_: Any) -> None:
    """Collective: rank 0's floating-point buffers (BatchNorm running
    statistics) on every rank, in one broadcast. DDP does this before
    each forward; FSDP does not, and each rank's statistics would follow
    its own batches. A forward pre-hook (so it takes the hook's
    arguments)."""
    buffers = [b for b in module.buffers() if b.is_floating_point()]
    if not buffers:
        return
    flat = torch.cat([b.detach().reshape(-1) for b in buffers])
    dist.broadcast(flat, src=0)
    offset = 0
    with torch.no_grad():
        for b in buffers:
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()


def gathered(value: DTensor) -> torch.Tensor:
    """Collective: the whole tensor of a DTensor that FSDP2 shards on
    dim 0, by the eager all-gather into one tensor (launch/gloo_cuda.py
    probes it). DTensor.full_tensor() runs the functional one, which
    crashed under gloo on CUDA (docs/performance.md, 6a). FSDP2 shards
    as torch.chunk does: ceil(rows / world) rows each, the last shards
    fewer or none; each is padded to that size, the padding cut from the
    whole."""
    if tuple(value.placements) != (Shard(0),):
        return value.full_tensor()
    group = value.device_mesh.get_group()
    local = value.to_local()
    rows = value.shape[0]
    per_rank = -(-rows // dist.get_world_size(group))
    padded = local.new_zeros((per_rank, *local.shape[1:]))
    padded[: local.shape[0]] = local
    whole = local.new_empty((per_rank * dist.get_world_size(group), *local.shape[1:]))
    _all_gather_into(whole, padded, group=group)
    return whole[:rows]


def host_full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the whole model state dict in host memory, on every
    rank, gathered one tensor at a time (peak device memory: the largest
    tensor, not the model)."""
    out = {}
    for name, value in get_model_state_dict(model).items():  # this rank's shards, clean names
        full = value
        if isinstance(value, DTensor):
            full = gathered(value)  # one all-gather per tensor
        out[name] = full.detach().to("cpu", copy=True)
        del full
    return out


class EvalReplica:
    """A plain (unsharded) copy of an FSDP model, refreshed before each
    evaluation.

    FSDP's forward all-gathers parameters, so every rank would have to
    run the same number of batches; exact evaluation gives ranks shards
    that differ by one sample or more. Evaluating a whole copy keeps
    evaluation free of collectives. GPU memory: the weights are gathered
    one tensor at a time into host memory (``host_full_state``), so no
    whole state dict ever sits on the device; the copy moves to the
    device for the evaluation only and back to host memory after it
    (``release``), so between evaluations the GPU holds the shards
    alone, as FSDP promises.
    """

    def __init__(self, build: Callable[[], nn.Module], device: torch.device) -> None:
        self.build, self.device, self.module = build, device, None

    def on_device(self) -> nn.Module:
        """The copy (built on first use) on the evaluation device."""
        if self.module is None:
            self.module = self.build().to("cpu")
        return self.module.to(self.device)

    def refresh(self, model: nn.Module) -> nn.Module:
        """Collective: gather the whole weights (via host memory) into
        the copy; returns it on the device."""
        state = host_full_state(model)
        if self.module is None:
            self.module = self.build().to("cpu")
        self.module.load_state_dict(state)  # into the host copy: the device gets only the weights
        del state
        return self.on_device()

    def release(self) -> None:
        """After an evaluation: back to host memory, and the freed
        blocks back to the GPU."""
        if self.module is not None and self.device.type == "cuda":
            self.module.to("cpu")
            torch.cuda.empty_cache()


class FSDP(Strategy):
    name = "fsdp"

    def __init__(self, cfg: Any, ctx: Any) -> None:
        super().__init__(cfg, ctx)
        # The architecture only: the replica takes the trained weights.
        self.replica = EvalReplica(lambda: models.build_model(cfg, with_weights=False), ctx.device)
        self.sharded: nn.Module | None = None

    @classmethod
    def check_config(cls, cfg: Any, world_size: int) -> None:
        if cfg.TRAIN.EMA_DECAY != 0:
            raise UserError(
                "TRAIN.EMA_DECAY needs whole parameters on every rank, which DIST.STRATEGY fsdp "
                "does not keep; use DIST.STRATEGY ddp or zero1 with EMA, or TRAIN.EMA_DECAY 0"
            )
        if cfg.TRAIN.AMP == "fp16":
            raise UserError(
                "DIST.STRATEGY fsdp supports TRAIN.AMP off or bf16 (fp16 needs a sharded gradient "
                "scaler); use TRAIN.AMP bf16"
            )
        if cfg.TRAIN.FREEZE_BACKBONE_EPOCHS:
            raise UserError(
                "TRAIN.FREEZE_BACKBONE_EPOCHS works with DIST.STRATEGY ddp, zero1 or dp, not fsdp "
                "(its shards are made for the parameters that train at the start)"
            )

    @classmethod
    def group_backend(cls, cfg: Any, backend: str) -> str:
        """Under nccl with CPU offload the gradients, their norm
        (clipping) and the non-finite vote are CPU tensors, which nccl
        cannot reduce ("No backend type associated with device type
        cpu"): gloo takes the CPU tensors then."""
        return "cpu:gloo,cuda:nccl" if backend == "nccl" and cfg.DIST.CPU_OFFLOAD else backend

    @classmethod
    def collectives(cls, cfg: Any) -> list[str]:
        # with CPU offload too: FSDP copies the shards to the GPU to
        # gather them
        return [*super().collectives(cfg), "all_gather_single", "reduce_scatter_single (AVG)"]

    def wrap(self, model: nn.Module) -> nn.Module:
        d = self.cfg.DIST
        self.sharded = shard(model, blocks(model), d.FSDP_RESHARD_AFTER_FORWARD, d.CPU_OFFLOAD)
        self.sharded.register_forward_pre_hook(broadcast_buffers)
        return self.sharded

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        # torch has no DTensor rule for aten._fused_sgd_: SGD runs its
        # multi-tensor kernels and keeps the synced non-finite check;
        # fused Adam/AdamW have one and skip on the device.
        return optim.build_optimizer(self.cfg, model, fused_sgd=False)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        # FSDP's counterpart of DDP's no_sync: no reduce-scatter on an
        # accumulation micro-step.
        self.sharded.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.sharded.set_requires_gradient_sync(True)

    def grads_finite(self, params: list[nn.Parameter]) -> torch.Tensor:
        """Each rank checks its shards; the answers are combined with
        one all-reduce."""
        finite = all_finite([local_tensor(p.grad) for p in params if p.grad is not None])
        bad = (~finite).to(torch.int32).reshape(1)
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        return bad[0] == 0

    def checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, shards: str
    ) -> tuple[dict[str, Any], bool]:
        # The statistics every rank goes on from (the next forward would
        # broadcast them): the sharded writer takes any rank's copy
        broadcast_buffers(self.sharded)
        if self.cfg.DIST.FSDP_STATE_DICT == "sharded":
            # Every rank writes its shards; rank 0's .pth holds the rest
            # and names the folder.
            local = [local_tensor(v) for v in self.sharded.state_dict().values()]
            if comm.max_over_ranks([not bool(all_finite(local))])[0]:
                return {}, False
            save_sharded(self.sharded, optimizer, shards)
            return {"sharded": os.path.basename(shards)}, True
        model_state, optim_state = full_state(self.sharded, optimizer)  # gathered whole on rank 0
        entries = {"model": model_state, "optimizer": optim_state}
        return entries, not self.ctx.is_main or bool(all_finite(list(model_state.values())))

    def checkable(self, ckpt: dict[str, Any]) -> bool:
        return False  # shapes of sharded state: torch checks them while loading

    def load_checkpoint(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        ckpt: dict[str, Any],
        path: str,
        folder: str,
    ) -> None:
        if ckpt.get("sharded"):
            load_sharded(self.sharded, optimizer, os.path.join(folder, ckpt["sharded"]))
        else:
            load_full_state(self.sharded, optimizer, ckpt["model"], ckpt.get("optimizer"))

    def eval_model(self, model: nn.Module) -> nn.Module:
        """FSDP's forward is a collective: evaluate a whole replica
        instead (EvalReplica)."""
        return self.replica.refresh(self.sharded)

    def release_eval(self) -> None:
        self.replica.release()  # its GPU memory goes back to the sharded training

    def test_model(
        self, model: nn.Module, ckpt: dict[str, Any], weights: str, folder: str
    ) -> nn.Module:
        if ckpt.get("sharded"):  # training is over: the sharded model may take the chosen weights
            load_sharded(self.sharded, None, os.path.join(folder, ckpt["sharded"]))
            return self.replica.refresh(self.sharded)
        net = self.replica.on_device()
        net.load_state_dict(models.strip_wrapper_prefixes(ckpt[weights]))
        return net


STRATEGY = FSDP

"""Memory-saving strategies: FSDP2 (``fully_shard``), CPU offload and activation checkpointing.

Call order (engine.wrap_model): bare model on its device -> ``checkpoint_activations`` (TRAIN.
ACTIVATION_CHECKPOINTING) -> ``shard`` (DIST.STRATEGY fsdp: every block, then the root) ->
optimizer over the sharded parameters. Under FSDP each rank holds 1/world of every parameter, its
gradient and its optimizer state (ZeRO-3, Rajbhandari et al., 2020); whole parameters exist only
while a block runs. Three things differ from DDP and live here:
  * state dicts are collectives (``full_state`` gathers them; ``save_sharded``/``load_sharded``
    write and read each rank's shards with torch.distributed.checkpoint);
  * the forward pass is a collective, so exact evaluation with uneven shards runs on a plain
    replica (``EvalReplica``) instead of the sharded model;
  * gradient checks must combine the ranks' shards (stepper.grads_finite: local shards + an all-reduce).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

log = logging.getLogger("distribuuuu")


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated units: the children of its top-level Sequential / ModuleList stages
    (ResNet's BasicBlocks and Bottlenecks, ViT's blocks, EfficientNet's stages), with parameters.

    These are the units FSDP gathers one at a time and activation checkpointing recomputes.
    """
    found = []
    for child in model.children():
        if isinstance(child, (nn.Sequential, nn.ModuleList)):
            found += [m for m in child.children() if any(True for _ in m.parameters())]
    return found


def checkpoint_activations(model: nn.Module, units: list[nn.Module]) -> int:
    """Wrap every unit (``blocks(model)``) so that its activations are recomputed in the backward pass instead of
    kept (non-reentrant torch.utils.checkpoint). State-dict keys stay the same. Returns the count.

    BatchNorm's running statistics are updated again by the recomputation: with momentum 0.1
    they move as with momentum 0.19 per step, which only shifts the evaluation statistics.
    """
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if any(child is u for u in units):
                setattr(parent, name, checkpoint_wrapper(child))
                count += 1
    return count


def shard(model: nn.Module, units: list[nn.Module], reshard_after_forward: bool, cpu_offload: bool) -> nn.Module:
    """FSDP2: shard every unit (``blocks(model)``), then the root (which takes the stem and the head). Parameters
    become DTensors sharded on dim 0 over the default process group."""
    kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if cpu_offload:  # parameters, gradients and the optimizer step live on the CPU
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for unit in units:
        # A checkpoint wrapper may hold the unit: shard the wrapper, so both act on the same unit.
        holder = next((w for w in model.modules() if getattr(w, "_checkpoint_wrapped_module", None) is unit), unit)
        fully_shard(holder, **kwargs)
    fully_shard(model, **kwargs)
    log.info("FSDP: %d blocks sharded over the process group (reshard after forward %s, CPU offload %s)",
             len(units), reshard_after_forward, cpu_offload)
    return model


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """FSDP's counterpart of DDP's no_sync: skip the reduce-scatter on accumulation micro-steps."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
    """Collective: the whole model and optimizer state dicts, on rank 0's CPU only (other ranks get
    empty dicts). The optimizer state is keyed by parameter name."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if optimizer is None:
        return get_model_state_dict(model, options=options), {}
    return get_state_dict(model, optimizer, options=options)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_state: dict,
                    optim_state: dict | None) -> None:
    """Collective: load whole state dicts (as ``full_state`` returns them, read on every rank)
    into the sharded model and optimizer."""
    options = StateDictOptions(full_state_dict=True)
    if optimizer is None or not optim_state:
        set_state_dict(model, (), model_state_dict=model_state, optim_state_dict={}, options=options)
    else:
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                       options=options)


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, folder: str) -> None:
    """Collective: each rank writes its own shards into folder (torch.distributed.checkpoint);
    nothing is gathered, so no rank ever holds the whole state."""
    import torch.distributed.checkpoint as dcp

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=folder)


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer | None, folder: str) -> None:
    """Collective: read this rank's shards from a ``save_sharded`` folder (any world size)."""
    import torch.distributed.checkpoint as dcp

    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, (), model_state_dict=state["model"], optim_state_dict={})
        return
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


class EvalReplica:
    """A plain (unsharded) copy of an FSDP model, refreshed before each evaluation.

    FSDP's forward all-gathers parameters, so every rank would have to run the same number of
    batches; exact evaluation gives ranks shards that differ by one sample or more. Evaluating a
    whole copy keeps evaluation free of collectives. GPU memory: the weights are gathered one
    tensor at a time into host memory (``host_full_state``), so no whole state dict ever sits on
    the device; the copy moves to the device for the evaluation only and back to host memory after
    it (``release``), so between evaluations the GPU holds the shards alone, as FSDP promises.
    """

    def __init__(self, build: Callable[[], nn.Module], device: torch.device) -> None:
        self.build, self.device, self.module = build, device, None

    def on_device(self) -> nn.Module:
        """The copy (built on first use) on the evaluation device."""
        if self.module is None:
            self.module = self.build().to("cpu")
        return self.module.to(self.device)

    def refresh(self, model: nn.Module) -> nn.Module:
        """Collective: gather the whole weights (via host memory) into the copy; returns it on the device."""
        state = host_full_state(model)
        if self.module is None:
            self.module = self.build().to("cpu")
        self.module.load_state_dict(state)  # into the host copy: the device gets only the weights
        del state
        return self.on_device()

    def release(self) -> None:
        """After an evaluation: back to host memory, and the freed blocks back to the GPU."""
        if self.module is not None and self.device.type == "cuda":
            self.module.to("cpu")
            torch.cuda.empty_cache()


def host_full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the whole model state dict in host memory, on every rank, gathered one tensor at
    a time (peak device memory: the largest tensor, not the model)."""
    out = {}
    for name, value in get_model_state_dict(model).items():  # this rank's shards, clean names
        full = value.full_tensor() if isinstance(value, DTensor) else value  # one all-gather per tensor
        out[name] = full.detach().to("cpu", copy=True)
        del full
    return out


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state held by THIS rank (shards only, under FSDP or ZeRO)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer wraps the local one
    return sum(local_tensor(t).numel() * t.element_size() for s in inner.state.values()
               for t in s.values() if torch.is_tensor(t) and t.dim() > 0)

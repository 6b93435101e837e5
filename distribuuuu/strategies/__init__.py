"""The ways of training (DIST.STRATEGY): the Strategy interface here, one module per way, named as it.

``build(cfg, ctx)`` picks the Strategy for this run. With one process there is nothing to
distribute: ddp / zero1 / fsdp train as ``single`` (fsdp says so), and dp drives all the GPUs
of its one process; dp with several processes is refused before any starts (DP.check_config).
``strategy_class(name)`` is the class that DIST.STRATEGY names, asked before the run for its
config rules, process-group backend and collectives. Adding a strategy: a module here, named as
the strategy, with a ``STRATEGY`` class (a subclass of Strategy), and that name among the config's
DIST.STRATEGY choices (config/validate.py STRATEGIES, which load_config checks).

The Strategy interface is everything that differs between the ways of training. The engine, the
stepper and the run-state code call these methods and never test the strategy's name. The defaults
here are those of one plain process; a subclass (single.py, ddp.py, zero1.py, fsdp.py, dp.py)
overrides what differs:
  wrap_model       SyncBN -> device -> channels_last -> activation checkpointing -> ``wrap``
                   (DDP, FSDP, DataParallel) -> torch.compile
  build_optimizer  the optimizer over the wrapped model's parameters (ZeRO differs)
  no_sync          the context of a micro-step whose gradients are not synchronised yet
  grads_finite     whether every gradient is finite (FSDP: combine the ranks' shards)
  checkpoint_state / load_checkpoint   the model and optimizer entries of a checkpoint
  eval_model / release_eval / test_model   the module that evaluation runs

and, asked of the class before any process group or model exists (api.preflight, launch.group):

  check_config     the settings this strategy cannot train: a UserError naming the way out
  group_backend    the default process group's backend string for this strategy
  collectives      the collectives it runs on device tensors (checked under gloo on CUDA)
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor
from yacs.config import CfgNode

from distribuuuu import models, optim
from distribuuuu.errors import UserError

log = logging.getLogger("distribuuuu")

# TRAIN.AMP's autocast dtypes: the stepper's autocast and dp's replicas use the same ones.
AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """0-d bool tensor: every value of the floating-point tensors is finite (no host sync yet).

    The 2-norm over all of them is non-finite iff some value is; torch computes it with its
    multi-tensor kernels (one launch for all the tensors of a device).
    """
    floats = [t for t in tensors if t.is_floating_point()]
    if not floats:
        return torch.tensor(True)
    return torch.isfinite(torch.nn.utils.get_total_norm(floats, foreach=True))


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


class Strategy:
    """One process, one device, no wrapper: the defaults every strategy starts from."""

    name = "single"

    def __init__(self, cfg: CfgNode, ctx: Any) -> None:
        self.cfg, self.ctx = cfg, ctx

    # -- asked before the run: config, process group ---------------------------------------------
    @classmethod
    def check_config(cls, cfg: CfgNode, world_size: int) -> None:
        """Raise a UserError for a setting this strategy cannot train with ``world_size`` processes."""
        if cfg.DIST.CPU_OFFLOAD:
            raise UserError(f"DIST.CPU_OFFLOAD True needs DIST.STRATEGY fsdp (got {cfg.DIST.STRATEGY!r}); "
                            "ddp and zero1 keep everything on the device")

    @classmethod
    def group_backend(cls, cfg: CfgNode, backend: str) -> str:
        """The default group's backend string, given the run's ("nccl" or "gloo")."""
        return backend

    @classmethod
    def collectives(cls, cfg: CfgNode) -> list[str]:
        """What the run calls on device tensors (names of launch.gloo_cuda.PROBES): DDP's buckets,
        exact eval counters and clipping all-reduce; DDP and ZeRO broadcast; SyncBN all-gathers."""
        return ["all_reduce", "broadcast"] + (["all_gather"] if cfg.MODEL.SYNCBN else [])

    # -- the model and the optimizer ------------------------------------------------------------
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """SyncBN -> device -> channels_last -> activation checkpointing -> ``wrap`` -> torch.compile."""
        cfg, ctx = self.cfg, self.ctx
        if cfg.MODEL.SYNCBN and ctx.distributed:
            if ctx.device.type == "cuda":
                model = models.convert_syncbn(model)
            else:  # torch's DDP accepts SyncBatchNorm on CUDA modules only
                log.warning("MODEL.SYNCBN True: SyncBatchNorm needs CUDA; this CPU run keeps per-process BatchNorm")
        log.info("model %s: %.2fM parameters", cfg.MODEL.ARCH, models.count_parameters(model) / 1e6)
        # With CPU offload FSDP moves the parameters to the CPU itself; the compute stays on the device.
        model = model.to(ctx.device)
        if cfg.TRAIN.CHANNELS_LAST:
            model = model.to(memory_format=torch.channels_last)
        units = blocks(model)
        if cfg.TRAIN.ACTIVATION_CHECKPOINTING:
            log.info("activation checkpointing: %d blocks recompute their activations in the backward pass",
                     checkpoint_activations(model, units))
        model = self.wrap(model, units)
        if cfg.TRAIN.COMPILE:
            model = torch.compile(model, backend=cfg.TRAIN.COMPILE_BACKEND)  # compiles lazily, at the first step (timed apart)
        return model

    def wrap(self, model: nn.Module, units: list[nn.Module]) -> nn.Module:
        """The strategy's wrapper around the prepared model (none here)."""
        return model

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return optim.build_optimizer(self.cfg, model)

    def gpus(self) -> list[torch.device]:
        """The GPUs this process computes on (none on CPU)."""
        return [self.ctx.device] if self.ctx.device.type == "cuda" else []

    # -- one step ---------------------------------------------------------------------------------
    def no_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """The context of a micro-step's forward and backward; ``sync`` False: accumulate locally."""
        return contextlib.nullcontext()

    def grads_finite(self, params: list[nn.Parameter]) -> torch.Tensor:
        """Whether every gradient is finite, as a 0-d bool tensor (no host sync yet).

        DDP has already averaged the gradients, so a NaN on any rank is a NaN on all of them and
        every rank reaches the same answer without a collective.
        """
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        return all_finite(grads) if grads else torch.tensor(True)

    # -- checkpoints --------------------------------------------------------------------------------
    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                         shards: str) -> tuple[dict[str, Any], bool]:
        """Collective: the model/optimizer entries of rank 0's checkpoint file, and whether the
        weights are finite (decided on rank 0; other ranks answer True). ``shards``: the folder a
        sharded strategy may write into."""
        if not self.ctx.is_main:
            return {}, True
        weights = models.state_dict_for_saving(model)
        return {"model": weights, "optimizer": optimizer.state_dict()}, bool(all_finite(list(weights.values())))

    def checkable(self, ckpt: dict[str, Any]) -> bool:
        """Whether resume_check can compare the checkpoint's shapes with this model's (plain state)."""
        return not ckpt.get("sharded")

    def load_checkpoint(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ckpt: dict[str, Any],
                        path: str, folder: str) -> None:
        """Collective: load a checkpoint's model (and, given an optimizer, optimizer) state."""
        if ckpt.get("sharded"):
            raise UserError(f"{path} keeps its weights in FSDP shards ({ckpt['sharded']}); resume it with "
                            "DIST.STRATEGY fsdp and more than one process")
        models.unwrap(model).load_state_dict(ckpt["model"])
        if optimizer is not None and "optimizer" in ckpt:
            optimizer.load_state_dict(ckpt["optimizer"])

    # -- evaluation ---------------------------------------------------------------------------------
    def eval_model(self, model: nn.Module) -> nn.Module:
        """Collective: the module an evaluation runs (evaluate unwraps it)."""
        return model

    def release_eval(self) -> None:
        """After an evaluation: give back what ``eval_model`` held."""

    def test_model(self, model: nn.Module, ckpt: dict[str, Any], weights: str, folder: str) -> nn.Module:
        """Collective: a module holding a chosen checkpoint's weights (``weights``: 'model' or 'ema')."""
        net = models.build_model(self.cfg, with_weights=False).to(self.ctx.device)
        net.load_state_dict(models.strip_wrapper_prefixes(ckpt[weights]))
        return net


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------
def resolve(name: str, distributed: bool) -> str:
    """The strategy that trains DIST.STRATEGY ``name`` with one process or several."""
    return name if distributed or name == "dp" else "single"


def strategy_class(name: str) -> type[Strategy]:
    """The Strategy subclass of DIST.STRATEGY ``name`` (the validated config's choices, or "single"):
    the ``STRATEGY`` of the module of that name, imported on first use."""
    return importlib.import_module(f"distribuuuu.strategies.{name}").STRATEGY


def build(cfg: CfgNode, ctx: Any) -> Strategy:
    """The Strategy of this run (see the module docstring for the one-process cases)."""
    return strategy_class(resolve(cfg.DIST.STRATEGY, ctx.distributed))(cfg, ctx)

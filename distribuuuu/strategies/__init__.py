"""The ways of training (DIST.STRATEGY): the Strategy interface and the
default, DDPStrategy, here; one module per other way, named as it.

``build(cfg, ctx)`` picks the Strategy for this run. With one process
there is nothing to distribute: ddp / zero1 / fsdp train as ``single``
(fsdp says so), and dp drives all the GPUs of its one process; dp with
several processes is refused before any starts (DP.check_config).
``strategy_class(name)`` is the class that DIST.STRATEGY names, asked
before the run for its config rules, process-group backend and
collectives: ``BUILT_IN`` (single and ddp, defined here), else the ``STRATEGY`` of
the module of that name, imported on first use. Adding a strategy: a
module here, named as the strategy, with a ``STRATEGY`` class (a
subclass of Strategy), and that name among the config's DIST.STRATEGY
choices (config/validate.py STRATEGIES, which load_config checks).

The strategy builds the optimizer (optim.build_optimizer) over the
parameters it trains: ZeRO shards its state (zero1.py), FSDP builds it
over the sharded parameters without fused SGD (fsdp.py).

The Strategy interface is everything that differs between the ways of
training. The engine, the stepper and the run-state code call these
methods and never test the strategy's name. The defaults here are those
of one plain process (the base class is ``single``); a subclass
(DDPStrategy below, zero1.py, fsdp.py, dp.py) overrides what differs:
  wrap_model       SyncBN -> device -> channels_last -> activation checkpointing -> ``wrap``
                   (DDP, FSDP, DataParallel) -> torch.compile
  build_optimizer  the optimizer over the wrapped model's parameters (ZeRO differs)
  no_sync          the context of a micro-step whose gradients are not synchronised yet
  grads_finite     whether every gradient is finite (FSDP: combine the ranks' shards)
  checkpoint_state / load_checkpoint   the model and optimizer entries of a checkpoint
  eval_model / release_eval / test_model   the module that evaluation runs

and, asked of the class before any process group or model exists
(api.preflight, launch.comm):

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
from torch.nn.parallel import DistributedDataParallel as DDP
from yacs.config import CfgNode

from distribuuuu import models, optim
from distribuuuu.errors import UserError
from distribuuuu.nonfinite import all_finite, grads_finite

log = logging.getLogger("distribuuuu")


# -- the strategies
# --------------------------------------------------------------------------------
def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated units: the children of its top-level
    Sequential / ModuleList stages (ResNet's BasicBlocks and
    Bottlenecks, ViT's blocks, EfficientNet's stages), with parameters.

    These are the units FSDP gathers one at a time and activation
    checkpointing recomputes.
    """
    found = []
    for child in model.children():
        if isinstance(child, (nn.Sequential, nn.ModuleList)):
            found += [m for m in child.children() if any(True for _ in m.parameters())]
    return found


def checkpoint_activations(model: nn.Module, units: list[nn.Module]) -> int:
    """Wrap every unit (``blocks(model)``) so that its activations are
    recomputed in the backward pass instead of kept (non-reentrant
    torch.utils.checkpoint). State-dict keys stay the same. Returns the
    count.

    BatchNorm's running statistics are updated again by the
    recomputation: with momentum 0.1 they move as with momentum 0.19 per
    step, which only shifts the evaluation statistics.
    """
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if any(child is u for u in units):
                setattr(parent, name, checkpoint_wrapper(child))
                count += 1
    return count


def sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """MODEL.SYNCBN with several processes: BatchNorm -> SyncBatchNorm,
    on CUDA (torch's DDP accepts SyncBatchNorm on CUDA modules only)."""
    if device.type == "cuda":
        return models.convert_syncbn(model)
    log.warning(
        "MODEL.SYNCBN True: SyncBatchNorm needs CUDA; this CPU run keeps per-process BatchNorm"
    )
    return model


class Strategy:
    """One process, one device, no wrapper: the defaults every strategy
    starts from."""

    name = "single"

    def __init__(self, cfg: CfgNode, ctx: Any) -> None:
        self.cfg, self.ctx = cfg, ctx

    # -- asked before the run: config, process group
    # ---------------------------------------------
    @classmethod
    def check_config(cls, cfg: CfgNode, world_size: int) -> None:
        """Raise a UserError for a setting this strategy cannot train
        with ``world_size`` processes."""
        if cfg.DIST.CPU_OFFLOAD:
            raise UserError(
                f"DIST.CPU_OFFLOAD True needs DIST.STRATEGY fsdp (got {cfg.DIST.STRATEGY!r}); ddp "
                "and zero1 keep everything on the device"
            )

    @classmethod
    def group_backend(cls, cfg: CfgNode, backend: str) -> str:
        """The default group's backend string, given the run's ("nccl"
        or "gloo")."""
        return backend

    @classmethod
    def collectives(cls, cfg: CfgNode) -> list[str]:
        """What the run calls on device tensors (names of
        launch.gloo_cuda.PROBES): DDP's buckets, exact eval counters and
        clipping all-reduce; DDP and ZeRO broadcast; SyncBN all-gathers."""
        return ["all_reduce", "broadcast"] + (["all_gather"] if cfg.MODEL.SYNCBN else [])

    # -- the model and the optimizer
    # ------------------------------------------------------------
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """SyncBN -> device -> channels_last -> activation checkpointing
        -> ``wrap`` -> torch.compile."""
        cfg = self.cfg
        if cfg.MODEL.SYNCBN and self.ctx.distributed:
            model = sync_batchnorm(model, self.ctx.device)
        log.info("model %s: %.2fM parameters", cfg.MODEL.ARCH, models.count_parameters(model) / 1e6)
        model = model.to(
            self.ctx.device
        )  # under CPU offload too: FSDP moves the parameters to the CPU itself
        if cfg.TRAIN.CHANNELS_LAST:
            model = model.to(memory_format=torch.channels_last)
        if cfg.TRAIN.ACTIVATION_CHECKPOINTING:
            log.info(
                "activation checkpointing: %d blocks recompute their activations in the backward "
                "pass",
                checkpoint_activations(model, blocks(model)),
            )
        model = self.wrap(model)
        if cfg.TRAIN.COMPILE:  # compiles lazily, at the first step (timed apart)
            model = torch.compile(model, backend=cfg.TRAIN.COMPILE_BACKEND)
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        """The strategy's wrapper around the prepared model (none here)."""
        return model

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return optim.build_optimizer(self.cfg, model)

    def gpus(self) -> list[torch.device]:
        """The GPUs this process computes on (none on CPU)."""
        return [self.ctx.device] if self.ctx.device.type == "cuda" else []

    # -- one step
    # ---------------------------------------------------------------------------------
    def no_sync(self) -> contextlib.AbstractContextManager:
        """The context of an accumulation micro-step's forward and
        backward: gradients add up locally."""
        return contextlib.nullcontext()

    # Whether every gradient is finite, as a 0-d bool tensor (no host
    # sync yet). Under DDP the gradients are already averaged: every
    # rank gets the same answer without a collective.
    grads_finite = staticmethod(grads_finite)

    # -- checkpoints
    # --------------------------------------------------------------------------------
    def checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, shards: str
    ) -> tuple[dict[str, Any], bool]:
        """Collective: rank 0's model/optimizer entries and whether its
        weights are finite (other ranks: {}, True). ``shards``: a folder
        a sharded strategy may write into."""
        if not self.ctx.is_main:
            return {}, True
        weights = models.state_dict_for_saving(model)
        return {"model": weights, "optimizer": optimizer.state_dict()}, bool(
            all_finite(list(weights.values()))
        )

    def checkable(self, ckpt: dict[str, Any]) -> bool:
        """Whether resume_check can compare the checkpoint's shapes with
        this model's (plain state)."""
        return not ckpt.get("sharded")

    def load_checkpoint(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        ckpt: dict[str, Any],
        path: str,
        folder: str,
    ) -> None:
        """Collective: load a checkpoint's model (and, given an
        optimizer, optimizer) state."""
        if ckpt.get("sharded"):
            raise UserError(
                f"{path} keeps its weights in FSDP shards ({ckpt['sharded']}); resume it with "
                "DIST.STRATEGY fsdp and more than one process"
            )
        models.unwrap(model).load_state_dict(ckpt["model"])
        if optimizer is not None and "optimizer" in ckpt:
            optimizer.load_state_dict(ckpt["optimizer"])

    # -- evaluation
    # ---------------------------------------------------------------------------------
    def eval_model(self, model: nn.Module) -> nn.Module:
        """Collective: the module an evaluation runs (evaluate unwraps
        it)."""
        return model

    def release_eval(self) -> None:
        """After an evaluation: give back what ``eval_model`` held."""

    def test_model(
        self, model: nn.Module, ckpt: dict[str, Any], weights: str, folder: str
    ) -> nn.Module:
        """Collective: a module holding a chosen checkpoint's weights
        (``weights``: 'model' or 'ema')."""
        net = models.build_model(self.cfg, with_weights=False).to(self.ctx.device)
        net.load_state_dict(models.strip_wrapper_prefixes(ckpt[weights]))
        return net


def frozen_backbone(cfg: CfgNode) -> bool:
    """TRAIN.FREEZE_BACKBONE_EPOCHS leaves the backbone without
    gradients, which DDP would wait for: find_unused_parameters on
    (docs/recipes.md, Fine-tuning)."""
    if cfg.TRAIN.FREEZE_BACKBONE_EPOCHS != 0:
        log.info(
            "DDP find_unused_parameters on: TRAIN.FREEZE_BACKBONE_EPOCHS leaves the backbone "
            "without gradients"
        )
    return cfg.TRAIN.FREEZE_BACKBONE_EPOCHS != 0


class DDPStrategy(Strategy):
    """The default: DistributedDataParallel, a whole replica per
    process, gradients all-reduced in buckets."""

    name = "ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        d, device = self.cfg.DIST, self.ctx.device
        # BUCKET_CAP_MB 0 -> None: torch's small first bucket, which
        # starts communicating sooner.
        self.ddp = DDP(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=d.BUCKET_CAP_MB or None,
            static_graph=d.STATIC_GRAPH,
            gradient_as_bucket_view=d.GRADIENT_AS_BUCKET_VIEW,
            find_unused_parameters=d.FIND_UNUSED_PARAMETERS or frozen_backbone(self.cfg),
        )
        return self.ddp

    def no_sync(self) -> contextlib.AbstractContextManager:
        # All-reduce on the last micro-batch only; self.ddp is the DDP
        # module even under torch.compile.
        return self.ddp.no_sync()


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------
# the others: a module each, imported on first use
BUILT_IN: dict[str, type[Strategy]] = {"single": Strategy, "ddp": DDPStrategy}


def resolve(name: str, distributed: bool) -> str:
    """The strategy that trains DIST.STRATEGY ``name`` with one process
    or several."""
    return name if distributed or name == "dp" else "single"


def strategy_class(name: str) -> type[Strategy]:
    """The Strategy subclass of DIST.STRATEGY ``name`` (the validated
    config's choices, or "single")."""
    return BUILT_IN.get(name) or importlib.import_module(f"distribuuuu.strategies.{name}").STRATEGY


def build(cfg: CfgNode, ctx: Any) -> Strategy:
    """The Strategy of this run (see the module docstring for the
    one-process cases)."""
    name = resolve(cfg.DIST.STRATEGY, ctx.distributed)
    if name == "single" and cfg.DIST.STRATEGY == "fsdp":
        log.warning("DIST.STRATEGY fsdp with one process: nothing to shard, training unsharded")
    return strategy_class(name)(cfg, ctx)

"""The public Python API: train, evaluate, and load a trained model without the CLI.

    from distribuuuu import api, config

    cfg = config.load_config("config/synthetic_tiny.yaml", ["OUT_DIR", "runs/api"])
    summary = api.train(cfg)            # what `distribuuuu train` runs, in this process
    record = api.evaluate(cfg)          # what `distribuuuu eval` runs (OUT_DIR's best.pth)
    model = api.load_model("runs/api/checkpoints/best.pth")   # an nn.Module in eval mode

``cfg`` is a yacs CfgNode from ``config.load_config(cfg_file, opts)`` (validated, frozen, the
IMPORTS modules imported); a path to a YAML file is accepted as a shorthand for
``config.load_config(path)``. ``train`` and ``evaluate`` run in the calling process under any
launcher: plain python (one process), or a process that torchrun / srun / the spawner started
(each rank calls them; dist.launch.detect tells them apart). They take the same run-folder lock
and make the same checks as the CLI, which calls the same ``run_command``. A user error raises
``distribuuuu.errors.UserError`` instead of exiting with status 2; a preemption signal raises
``distribuuuu.dist.signals.Preempted`` after the step checkpoint (and the Slurm requeue).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence, Union

import torch
from yacs.config import CfgNode

from distribuuuu import checkpoint, config, engine, models, preflight, run_folder
from distribuuuu.dist import group, launch, signals
from distribuuuu.engine import HookBase
from distribuuuu.errors import UserError
from distribuuuu.logger import LOGGER_NAME, setup_logging

__all__ = ["train", "evaluate", "load_model", "run_command"]

ConfigLike = Union[CfgNode, str, "os.PathLike[str]"]


def _as_cfg(cfg: ConfigLike) -> CfgNode:
    """A CfgNode as given (checked again: it may have been edited since load_config), or a YAML path loaded."""
    if isinstance(cfg, CfgNode):
        config.validate(cfg)
        return cfg
    if isinstance(cfg, (str, os.PathLike)):
        return config.load_config(os.fspath(cfg))
    raise TypeError(f"cfg must be a CfgNode from distribuuuu.config.load_config or a YAML path, "
                    f"not {type(cfg).__name__}")


def _fit(cfg: CfgNode, ctx: group.DistContext, hooks: Sequence[HookBase]) -> dict[str, Any]:
    """engine.fit with the preemption signals recorded; requeue (rank 0) before Preempted goes up."""
    try:
        with signals.preemption_signals(cfg.TRAIN.PREEMPT_SIGNALS):
            return engine.fit(cfg, ctx, hooks=tuple(hooks))
    except signals.Preempted:
        if cfg.TRAIN.REQUEUE and ctx.is_main:
            signals.slurm_requeue()
        raise  # "ended by this signal", after the checkpoint: the CLI exits with 128 + signal
    except Exception as e:  # a crash: name the rank in log.txt, where every rank's errors go
        # A UserError (e.g. engine.NonFiniteLoss) is printed once by the CLI: log.txt only here.
        logging.getLogger(LOGGER_NAME).error("rank %d failed: %s: %s", ctx.rank, type(e).__name__, e,
                                             extra={"console": not isinstance(e, UserError)})
        raise


def run_command(command: str, cfg: CfgNode, hooks: Sequence[HookBase] = ()) -> dict[str, Any]:
    """Run "train" or "eval" in this process (any launcher); return the summary / the eval record.

    Checks first (preflight, before any process group), then the process group, the run
    folder's lock (train: rank 0 holds OUT_DIR/run.lock to the end, however the run ends),
    logging, the config written to OUT_DIR (rank 0), and the run. The CLI's train and eval are
    this function plus exit statuses.
    """
    if command not in ("train", "eval"):
        raise ValueError(f"command must be 'train' or 'eval', not {command!r}")
    info = launch.detect()
    preflight.check(command, cfg, info.world_size, all_ranks_here=info.local_world_size == info.world_size)
    with group.session(cfg) as ctx, run_folder.owned(cfg, ctx, lock=command == "train") as notes:
        setup_logging(cfg.OUT_DIR, ctx.is_main, ctx.rank)
        run_folder.log_notes(notes)  # a stale lock taken over, debris removed
        if command == "eval":
            return engine.run_eval(cfg, ctx)
        if ctx.is_main:
            config.dump_to_run_folder(cfg, cfg.OUT_DIR)
        return _fit(cfg, ctx, hooks)


def train(cfg: ConfigLike, hooks: Sequence[HookBase] = ()) -> dict[str, Any]:
    """Train as ``distribuuuu train`` does, in this process; return the run's summary.

    hooks: ``distribuuuu.engine.HookBase`` instances, run after the built-in hooks and those of
    TRAIN.HOOKS (event order: distribuuuu/engine/hooks.py). Each rank runs its own.
    """
    return run_command("train", _as_cfg(cfg), hooks)


def evaluate(cfg: ConfigLike) -> dict[str, Any]:
    """Evaluate as ``distribuuuu eval`` does: MODEL.WEIGHTS, else OUT_DIR's best.pth / last.pth.

    Returns the record also appended to OUT_DIR/eval.jsonl (loss, top1, top5, n, ...).
    """
    return run_command("eval", _as_cfg(cfg))


def _stored_cfg(ckpt: dict[str, Any], path: str) -> CfgNode:
    """The run's config from a checkpoint, over today's defaults (keys added since keep their default)."""
    if not isinstance(ckpt.get("cfg"), str):
        raise UserError(f"{path} holds no run config: it is a plain state dict, not a distribuuuu checkpoint; "
                        "build the model with config.load_config(...) and models.build_model(cfg) instead")
    cfg = config.get_defaults()
    try:  # checked as a --cfg file is: yacs's own merge would refuse a MODEL.PRETRAINED path over False
        config.merge_text(cfg, ckpt["cfg"], f"the config stored in {path}")
    except UserError as e:
        raise UserError(f"the config stored in {path} does not fit this version of distribuuuu: {e}") from None
    # The weights come from the checkpoint itself, never from a file the stored config names.
    cfg.MODEL.WEIGHTS = ""
    cfg.MODEL.PRETRAINED = False
    cfg.freeze()
    config.import_user_modules(cfg.IMPORTS)  # a model registered by the user's module is found by name
    return cfg


def load_model(checkpoint_path: str, device: str | torch.device = "cpu", ema: bool = False) -> torch.nn.Module:
    """The model of a distribuuuu checkpoint, with its weights, in eval mode on device.

    The architecture comes from the config stored in the checkpoint; the file is read with
    ``checkpoint.load`` (tensors only, integrity digest verified). ema=True loads the EMA weights
    (TRAIN.EMA runs). A sharded FSDP checkpoint (DIST.FSDP_STATE_DICT sharded) is refused: its
    weights are spread over a .dcp folder; evaluate it with ``evaluate`` or the CLI.
    """
    path = os.fspath(checkpoint_path)
    ckpt = checkpoint.load(path)
    cfg = _stored_cfg(ckpt, path)
    if ckpt.get("sharded"):
        raise UserError(f"{path} is a sharded FSDP checkpoint (weights in {ckpt['sharded']}); load_model needs "
                        "a whole one: train with DIST.FSDP_STATE_DICT full, or use evaluate()")
    key = "ema" if ema else "model"
    if ckpt.get(key) is None:
        raise UserError(f"{path} holds no EMA weights (the run had TRAIN.EMA_DECAY 0)" if ema
                        else f"{path} holds no model weights")
    model = models.build_model(cfg)
    model.load_state_dict(models.strip_wrapper_prefixes(ckpt[key]))  # strict: every tensor must fit
    return model.to(device).eval()

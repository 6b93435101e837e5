"""Checks before any process group starts: a user error here ends every rank alike, at once.

Run by ``distribuuuu.api.run_command`` in each process (any launcher), and once more by the CLI
before the spawner starts its children, so that a bad config fails once instead of once per rank.
"""

from __future__ import annotations

import os
from typing import Any

from distribuuuu import data, inference, models, resume_check, run_folder, strategies
from distribuuuu.errors import UserError


def _gib(n: float) -> str:
    return f"{n / 2**40:.1f} TiB" if n >= 2**40 else f"{n / 2**30:.1f} GiB"


def _check_batch_fits(command: str, cfg: Any) -> None:
    """Refuse an input batch that alone exceeds the host's memory, before anything is allocated:
    TRAIN.IM_SIZE 200000 would otherwise end in an allocator traceback per rank. The GPU's memory is
    not asked here: that would initialise CUDA in the launching process (the spawner's parent)."""
    limits = [("this host's", os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))]
    splits = [("TEST", "evaluation")] if command == "eval" else [("TRAIN", "training"), ("TEST", "evaluation")]
    for group, what in splits:
        batch, side = cfg[group].BATCH_SIZE, cfg[group].IM_SIZE
        size = batch * cfg.MODEL.IN_CHANS * side * side * 4  # float32, as the model sees it
        for where, limit in limits:
            if size > limit:
                raise UserError(
                    f"one {what} batch ({group}.BATCH_SIZE {batch} images of {cfg.MODEL.IN_CHANS}x{side}x{side}, "
                    f"float32) is {_gib(size)}, more than {where} {_gib(limit)} of memory before any "
                    f"activation; lower {group}.IM_SIZE (e.g. 224) or {group}.BATCH_SIZE")


def _check_cfg_dest(cfg: Any) -> None:
    """CFG_DEST names a file in OUT_DIR: an existing folder there cannot become one."""
    path = os.path.join(cfg.OUT_DIR, cfg.CFG_DEST)
    if os.path.isdir(path):
        raise UserError(f"CFG_DEST {cfg.CFG_DEST!r} is an existing folder in OUT_DIR ({path}); the full config "
                        "is written to that name: use a file name such as config.yaml")


def check(command: str, cfg: Any, world_size: int, all_ranks_here: bool = True) -> None:
    """Checks that need no process group, run before any starts so no rank is left waiting.

    command: "train" or "eval". all_ranks_here: every rank runs on this host (plain, spawner,
    one-node torchrun/srun).
    """
    if command == "eval":  # the weights run_eval will use, before anything about the data: what eval misses first
        inference.chosen_weights(cfg, "eval")
    models.resolve_arch(cfg.MODEL.ARCH)  # an unknown name fails here, once, not in every rank
    _check_batch_fits(command, cfg)
    if command == "train":
        _check_cfg_dest(cfg)
    strategies.strategy_class(cfg.DIST.STRATEGY).check_config(cfg, world_size)  # its own rules (strategies/)
    if command == "train" and cfg.MODEL.WEIGHTS:  # eval's: chosen_weights, above
        inference.require_weights_file(cfg.MODEL.WEIGHTS)
    pretrained = cfg.MODEL.PRETRAINED
    if isinstance(pretrained, str) and not cfg.MODEL.WEIGHTS and not os.path.isfile(pretrained):
        raise UserError(f"MODEL.PRETRAINED {pretrained!r} does not exist; give the path of a weights file, or "
                        "True for MODEL.ARCH's file in torch hub's cache")
    data.check_datasets(cfg, world_size, train=(command == "train"))
    run_folder.preflight(cfg, command, all_ranks_here)  # OUT_DIR usable and not another run's
    if command == "train":  # an edited config must not resume a run it does not fit (before config.yaml is written)
        resume_check.preflight(cfg)

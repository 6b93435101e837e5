"""Every decision the config takes from the data or the machine: the
keys left unset get their value here, once, each with a setup line.

``resolve(cfg)`` runs before any process starts work that depends on
these values (the command line calls it, api.run_command again for a
config built by hand); every rank computes the same values from the
same config and files. The result is an ordinary frozen config: the
rest of the code never sees an unset value, and config.yaml and every
checkpoint hold the values used.

  data.py     a folder of class folders as the training split, a tenth held
              out (TRAIN.SPLIT '', TRAIN.VAL_SPLIT 0.1); TEST.DATASET '' as
              TRAIN.DATASET; MODEL.NUM_CLASSES 0 and TRAIN.TOPK from the
              classes; TEST.IM_SIZE 0; absolute paths
  images.py   MODEL.ARCH auto, MODEL.IN_CHANS 0, TRAIN.IM_SIZE 0 and the recipe
              (CROP_SCALE, FLIP_PROB, MEAN/STD): a fine-tune's card, a resumed
              run's start, else a sample of the images
  machine.py  TRAIN.WORKERS -1 and NUM_THREADS 0 from the cores
  length.py   OPTIM.MAX_EPOCH 0 and TRAIN.PATIENCE -1 from the training
              set's size
  here        OPTIM.WARMUP_EPOCHS over half of the run: said to be shortened
"""

from __future__ import annotations

import logging
import os

from yacs.config import CfgNode

from distribuuuu.inferred.decision import Decision

log = logging.getLogger("distribuuuu")

# where the decisions live on the resolved CfgNode (an attribute, not a key)
_DECISIONS = "_inferred_decisions"


def decisions(cfg: CfgNode) -> list[Decision]:
    """The decisions resolve() recorded on cfg ([] for a config it did
    not resolve)."""
    return list(cfg.__dict__.get(_DECISIONS, []))


def log_decisions(cfg: CfgNode) -> None:
    """One setup line per decided value (rank 0 calls it once)."""
    for decision in decisions(cfg):
        (log.warning if decision.warn else log.info)("setup: %s", decision.line())


def resolve(cfg: CfgNode, local_world_size: int | None = None) -> CfgNode:
    """A frozen copy of cfg with every unset key decided (module
    docstring), the decisions recorded on it. A config already resolved
    is returned as it is. Raises UserError where the data forbids a
    value."""
    if _DECISIONS in cfg.__dict__:
        return cfg
    from distribuuuu import run_folder
    from distribuuuu.inferred import data, images, length, machine
    from distribuuuu.launch.launcher import detect

    out = cfg.clone()
    out.defrost()
    local_world_size = local_world_size or detect().local_world_size
    decided = data.layout(out) + data.classes(out)
    last = run_folder.last_path(out.OUT_DIR)
    if out.MODEL.WEIGHTS and os.path.isfile(out.MODEL.WEIGHTS):  # not OUT_DIR's run: an eval
        decided += images.from_card(out)
    elif out.TRAIN.AUTO_RESUME and os.path.isfile(last):
        decided += images.as_started(out, last)
    decided += images.decide(out)
    decided.append(data.eval_size(out))
    decided.append(machine.workers(out, local_world_size))
    decided += machine.threads(out, local_world_size)
    decided += length.run_length(out)
    decided += _warmup(out)
    decided += data.absolute_imports(out)
    data.absolute_datasets(out)  # last: the lines above name the data as the user wrote it
    out.freeze()
    out.__dict__[_DECISIONS] = tuple(decided)
    return out


def _warmup(cfg: CfgNode) -> list[Decision]:
    """Only the line: the schedule shortens a warmup that does not fit
    (optim.warmup_epochs); the key keeps its value."""
    from distribuuuu.optim import warmup_epochs

    short, o = warmup_epochs(cfg), cfg.OPTIM
    if short == o.WARMUP_EPOCHS:
        return []
    why = f"shortened from {o.WARMUP_EPOCHS:g}: a warmup over half of the {o.MAX_EPOCH}-epoch "
    why += "run would leave little of it at the peak LR"
    return [Decision("OPTIM.WARMUP_EPOCHS", f"{short:g} in the schedule", why, warn=True)]

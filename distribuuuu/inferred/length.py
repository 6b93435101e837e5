"""The run's length from the data: OPTIM.MAX_EPOCH 0 and TRAIN.PATIENCE
-1.

A budget of about IMAGES_SEEN training images (EPOCHS bounds it): a
small set gets more epochs, a large one fewer, and the LR schedule is
fitted to that length. With the budget decided, the run also stops
after PATIENCE evaluations without progress in its second half
(Trainer.update_best), so a run that is done does not keep running.
docs/recipes.md has the measurements behind the numbers.
"""

from __future__ import annotations

import math

from yacs.config import CfgNode

from distribuuuu.data import holdout
from distribuuuu.data.checks import preflight
from distribuuuu.errors import UserError
from distribuuuu.inferred.decision import Decision

IMAGES_SEEN = 20_000  # the budget: training images seen in the run
EPOCHS = (10, 100)  # the fewest and the most epochs it decides
PATIENCE = 5  # evaluations without progress that end a run of decided length
UNREADABLE_EPOCHS = 100  # data not readable here (the preflight says why): the old default


def run_length(cfg: CfgNode) -> list[Decision]:
    """OPTIM.MAX_EPOCH 0: epochs from the training set's size, and then
    TRAIN.PATIENCE -1 is PATIENCE; with a given OPTIM.MAX_EPOCH,
    TRAIN.PATIENCE -1 is 0 (the run is as long as asked)."""
    o, t = cfg.OPTIM, cfg.TRAIN
    if o.MAX_EPOCH:
        t.PATIENCE = max(t.PATIENCE, 0)
        return []
    n = training_images(cfg)
    if n is None:
        o.MAX_EPOCH = UNREADABLE_EPOCHS
        return [Decision("OPTIM.MAX_EPOCH", o.MAX_EPOCH, "TRAIN.DATASET is not readable here")]
    fewest, most = EPOCHS
    o.MAX_EPOCH = min(max(math.ceil(IMAGES_SEEN / n), fewest), most)
    why = f"from the data: about {IMAGES_SEEN:,} of its {n:,} training images seen, at least "
    why += f"{fewest} and at most {most} epochs; the LR schedule follows"
    decided = [Decision("OPTIM.MAX_EPOCH", o.MAX_EPOCH, why)]
    if t.PATIENCE == -1:
        t.PATIENCE = PATIENCE
        why = "with OPTIM.MAX_EPOCH from the data: stop after that many evaluations in the second "
        why += "half of the run without a better val balanced top-1 or a 1% lower val loss"
        decided.append(Decision("TRAIN.PATIENCE", t.PATIENCE, why))
    return decided


def training_images(cfg: CfgNode) -> int | None:
    """The images a training epoch draws from (after TRAIN.VAL_SPLIT
    holds its part out), or None when the data is not readable here."""
    if cfg.MODEL.DUMMY_INPUT or cfg.TRAIN.DATASET == "synthetic":
        return cfg.TRAIN.SYNTHETIC_SAMPLES
    try:
        _, n, counts = preflight.scan(cfg, "TRAIN")
        if cfg.TRAIN.VAL_SPLIT and counts is not None:
            n -= holdout.check_holdout(counts, cfg.TRAIN.VAL_SPLIT)
    except (UserError, OSError):
        return None
    return n

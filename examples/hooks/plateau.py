"""An example hook: stop training when the validation loss stops improving.

Use it from the command line (the folder on the Python path, the class named in TRAIN.HOOKS):

    PYTHONPATH=examples/hooks distribuuuu train --cfg config/synthetic_tiny.yaml \
        TRAIN.HOOKS "['plateau:StopOnPlateau']"

or from Python: ``distribuuuu.engine.fit(cfg, ctx, hooks=[StopOnPlateau(patience=3)])``.
The validation loss is reduced over all ranks, so every rank takes the same decision and the
run ends after the same epoch everywhere (the epoch's checkpoint is already written then).
"""

from __future__ import annotations

import logging
import math

from distribuuuu.engine import HookBase

log = logging.getLogger("distribuuuu")


class StopOnPlateau(HookBase):
    """End the run after ``patience`` evaluations whose val loss is not ``min_delta`` below the best."""

    def __init__(self, patience: int = 3, min_delta: float = 1e-3) -> None:
        self.patience, self.min_delta = patience, min_delta
        self.best, self.bad = math.inf, 0

    def after_eval(self, trainer, split, records) -> None:
        if split != "val":  # the one test evaluation after the run: nothing to decide
            return
        loss = next(r["loss"] for r in records if r["split"] == "val")
        if loss < self.best - self.min_delta:
            self.best, self.bad = loss, 0
            return
        self.bad += 1
        log.info("plateau: val loss %.4f, best %.4f (%d/%d evaluations without improvement)",
                 loss, self.best, self.bad, self.patience)
        if self.bad >= self.patience:
            trainer.stop(f"val loss plateaued for {self.bad} evaluations")

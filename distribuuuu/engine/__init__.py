"""Training and evaluation: the Trainer's loop and the state it saves
and resumes (trainer.py), its hooks (hooks.py), evaluation
(evaluation.py) and seeding (rng.py). One optimizer step is optim.py's;
the eval command is api.run_eval.

``fit(cfg, ctx, hooks=())`` trains.
"""

from distribuuuu.engine.evaluation import evaluate
from distribuuuu.engine.hooks import HookBase, vote_period
from distribuuuu.engine.rng import seed_evaluation, seed_everything
from distribuuuu.engine.trainer import Trainer, TrainState, fit
from distribuuuu.launch.signals import (
    Preempted,
)  # raised by the CheckpointHook; importable here as before
from distribuuuu.nonfinite import NonFiniteLoss

__all__ = [
    "HookBase",
    "NonFiniteLoss",
    "Preempted",
    "Trainer",
    "TrainState",
    "evaluate",
    "fit",
    "seed_everything",
    "seed_evaluation",
    "vote_period",
]

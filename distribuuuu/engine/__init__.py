"""Training and evaluation: the Trainer's loop (trainer.py), its hooks (hooks.py), evaluation
(evaluation.py), the run's state and its checkpoints (state.py), and one optimizer step (stepper.py).

``fit(cfg, ctx, hooks=())`` trains; ``run_eval(cfg, ctx)`` is the ``eval`` command.
"""

from distribuuuu.engine.evaluation import evaluate, run_eval
from distribuuuu.engine.hooks import HookBase, NonFiniteLoss, vote_period
from distribuuuu.engine.state import TrainState, seed_everything
from distribuuuu.engine.trainer import Trainer, fit
from distribuuuu.launch.signals import Preempted  # raised by the CheckpointHook; importable here as before

__all__ = ["HookBase", "NonFiniteLoss", "Preempted", "Trainer", "TrainState", "evaluate", "fit", "run_eval",
           "seed_everything", "vote_period"]

"""Train like `distribuuuu train`, then save EVERY rank's final weights as OUT_DIR/rank<R>.pt.

Used by the tests to check that all DDP replicas end identical. Launch it like train_net.py
(plain python, torchrun, srun). The weights are saved by a hook (TRAIN.HOOKS), so the framework
runs unchanged: this script's folder is sys.path[0], where "train_and_dump:DumpWeights" is found.
"""

import os
import sys

import torch

from distribuuuu import cli, models
from distribuuuu.engine import HookBase


class DumpWeights(HookBase):
    """After the run: this rank's weights (wrapper prefixes stripped) as OUT_DIR/rank<R>.pt."""

    def after_fit(self, trainer, summary):
        torch.save(models.state_dict_for_saving(trainer.model),
                   os.path.join(trainer.cfg.OUT_DIR, f"rank{trainer.ctx.rank}.pt"))


if __name__ == "__main__":
    sys.exit(cli.main(["train", *sys.argv[1:], "TRAIN.HOOKS", "['train_and_dump:DumpWeights']"]))

"""Train like `distribuuuu train`, then save EVERY rank's final weights as OUT_DIR/rank<R>.pt.

Used by the tests to check that all DDP replicas end identical. Launch it like train_net.py
(plain python, torchrun, srun). The model is captured by wrapping engine.wrap_model.
"""

import os
import sys

import torch

from distribuuuu import cli, engine, models

captured = {}
_wrap = engine.wrap_model


def _capture(cfg, ctx, model):
    captured["model"], captured["rank"] = _wrap(cfg, ctx, model), ctx.rank
    return captured["model"]


engine.wrap_model = _capture
status = cli.main(["train", *sys.argv[1:]])
if status == 0:
    out_dir = sys.argv[sys.argv.index("OUT_DIR") + 1]
    torch.save(models.state_dict_for_saving(captured["model"]),
               os.path.join(out_dir, f"rank{captured['rank']}.pt"))
sys.exit(status)

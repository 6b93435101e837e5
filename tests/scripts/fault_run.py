"""`train` like train_net.py, with test-only instruments switched on by environment variables.

  LOSS_LOG=PREFIX        append every training step's loss (repr, full precision) to PREFIX.rank<R>
  SIGNAL_AT=S:R:NAME     after optimizer step S (global), rank R sends itself the real signal NAME
  RAISE_AT=S:R           rank R raises RuntimeError at step S
  HANG_AT=S:R            rank R stops answering (sleeps) at step S
  NAN_AT=S:R             rank R's loss becomes NaN at step S (S may be a comma list)

The instruments wrap the optimizer's step and the loss; the framework itself is not changed.
"""

import os
import signal
import sys
import time

import torch

from distribuuuu import cli, optim

RANK = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
step = 0


def _at(var):
    """(steps, rank, extra) for VAR=S[,S...]:R[:extra], or None."""
    spec = os.environ.get(var)
    if not spec:
        return None
    parts = spec.split(":")
    return {int(s) for s in parts[0].split(",")}, int(parts[1]), parts[2] if len(parts) > 2 else None


def _mine(var):
    at = _at(var)
    return at if at and at[1] == RANK else None


_build = optim.build_optimizer


def build_optimizer(cfg, model, **kwargs):
    opt = _build(cfg, model, **kwargs)
    plain_step = opt.step

    def step_with_faults(*args, **kwargs):
        global step
        out = plain_step(*args, **kwargs)
        step += 1
        if (at := _mine("SIGNAL_AT")) and step in at[0]:
            os.kill(os.getpid(), getattr(signal, at[2]))
        if (at := _mine("RAISE_AT")) and step in at[0]:
            raise RuntimeError(f"injected failure at step {step} on rank {RANK}")
        if (at := _mine("HANG_AT")) and step in at[0]:
            while True:
                time.sleep(1)
        return out

    opt.step = step_with_faults
    return opt


optim.build_optimizer = build_optimizer
_forward = torch.nn.CrossEntropyLoss.forward
calls = 0


def forward(self, logits, target):
    global calls
    loss = _forward(self, logits, target)
    if torch.is_grad_enabled():  # training steps only, not evaluation
        calls += 1
        if (at := _mine("NAN_AT")) and calls in at[0]:
            loss = loss * float("nan")
        if os.environ.get("LOSS_LOG"):
            with open(f"{os.environ['LOSS_LOG']}.rank{RANK}", "a") as f:
                f.write(repr(loss.item()) + "\n")
    return loss


torch.nn.CrossEntropyLoss.forward = forward
if __name__ == "__main__":
    sys.exit(cli.main(["train", *sys.argv[1:]]))

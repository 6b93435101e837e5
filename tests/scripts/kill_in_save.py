"""`train` like train_net.py, killed with a real SIGKILL in the middle of a checkpoint write.

  KILL_IN_SAVE=N   at the N-th checkpoint file written (torch.save into <name>.pth.tmp.<pid>),
                   kill -9 this process once the temporary file holds the data, before the rename
  KILL_IN_LINK=N   at the N-th update of last.pth/best.pth (os.link to <name>.pth.tmp.<pid>),
                   kill -9 this process once the temporary link exists, before the rename

The instruments wrap torch.save and os.link; the framework itself is not changed.
"""

import os
import signal
import sys

import torch

from distribuuuu import cli

counts = {"save": 0, "link": 0}


def _kill_at(kind: str, var: str) -> None:
    counts[kind] += 1
    if counts[kind] == int(os.environ.get(var) or 0):
        os.kill(os.getpid(), signal.SIGKILL)


_save = torch.save


def save(obj, f, *args, **kwargs):
    _save(obj, f, *args, **kwargs)
    if ".pth.tmp." in str(getattr(f, "name", f)):
        if hasattr(f, "flush"):
            f.flush()  # the bytes are in the file, as after a long write interrupted near its end
        _kill_at("save", "KILL_IN_SAVE")


_link = os.link


def link(src, dst, *args, **kwargs):
    _link(src, dst, *args, **kwargs)
    if ".pth.tmp." in str(dst):
        _kill_at("link", "KILL_IN_LINK")


torch.save = save
os.link = link
if __name__ == "__main__":
    sys.exit(cli.main(["train", *sys.argv[1:]]))

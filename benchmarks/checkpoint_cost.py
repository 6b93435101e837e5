"""What the checkpoint integrity digest costs: torch.save/torch.load alone against
weights.save_checkpoint/load_checkpoint (SHA-256 of every entry, verified on load), on a ResNet-18 with
its SGD momentum state (the size of a real small run's checkpoint).

    python benchmarks/checkpoint_cost.py [--arch resnet18] [--repeat 5]

Prints the best of --repeat for each, in one run, so the two are measured side by side. Both
writes are fsynced (save_checkpoint always is); the page cache stays warm for the loads.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torchvision

from distribuuuu.weights import load_checkpoint, save_checkpoint


def _state(arch: str) -> dict:
    """A checkpoint-like dict: weights and an SGD state with a momentum buffer per parameter."""
    model = getattr(torchvision.models, arch)(num_classes=1000)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1, "global_step": 10,
            "samples_in_epoch": 0, "cfg": "MODEL:\n  ARCH: resnet18\n"}


def _plain_save(state: dict, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    state = _state(args.arch)
    with tempfile.TemporaryDirectory() as out:
        plain = os.path.join(out, "plain.pth")
        rows = [("torch.save (fsync)", _best(lambda: _plain_save(state, plain), args.repeat))]
        saved = os.path.join(out, "epoch_0001.pth")
        rows.append(("save_checkpoint (+SHA-256, atomic)", _best(lambda: save_checkpoint(state, saved), args.repeat)))
        rows.append(("torch.load", _best(lambda: torch.load(plain, map_location="cpu", weights_only=True),
                                         args.repeat)))
        rows.append(("load_checkpoint (+verify)", _best(lambda: load_checkpoint(saved), args.repeat)))
        size_mb = os.path.getsize(saved) / 1e6
    print(f"checkpoint cost: {args.arch} + SGD momentum, {size_mb:.1f} MB, best of {args.repeat}, 1 thread")
    print(f"{'operation':36s} {'ms':>8s}")
    for name, seconds in rows:
        print(f"{name:36s} {seconds * 1000:8.1f}")
    print(f"save overhead x{rows[1][1] / rows[0][1]:.2f}, load overhead x{rows[3][1] / rows[2][1]:.2f}")


if __name__ == "__main__":
    main()

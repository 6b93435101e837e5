"""Photo-like JPEGs for the I/O sweep of docs/performance.md (`distribuuuu bench --io`).

    .venv/bin/python benchmarks/io_jpegs.py DIR [--n 2000] [--classes 10] [--side 128] [--procs 1]

writes DIR/train/c<k>/<i>.jpg: n images, side x 3/4 side (every 4th one portrait), quality 90:
smooth colour regions, a texture and sensor-like noise, so that they compress like small photos
(about 6 KB at 128 px) rather than like random noise (which would be 3x larger and slower to decode).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os

import numpy as np
from PIL import Image


def _write_one(root: str, i: int, classes: int, side: int, rng: np.random.Generator) -> None:
    w, h = (side, side * 3 // 4) if i % 4 else (side * 3 // 4, side)
    low = rng.random((h // 16 + 1, w // 16 + 1, 3)) * 255
    a = np.asarray(Image.fromarray(low.astype(np.uint8)).resize((w, h), Image.BICUBIC)).astype(np.float32)
    yy, xx = np.mgrid[0:h, 0:w]
    a += 30 * np.sin(xx / rng.uniform(3, 12) + yy / rng.uniform(3, 12))[..., None]
    a += rng.normal(0, 12, a.shape)
    folder = os.path.join(root, "train", f"c{i % classes}")
    os.makedirs(folder, exist_ok=True)
    Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(os.path.join(folder, f"{i:05d}.jpg"), quality=90)


def _write_part(args: tuple[str, int, int, int, int, int, int]) -> None:
    """Images part, part + procs, ...: each seeded by (seed, its index), so any split gives the same files."""
    root, n, classes, side, seed, part, procs = args
    for i in range(part, n, procs):
        _write_one(root, i, classes, side, np.random.default_rng((seed, i)))


def write_jpegs(root: str, n: int, classes: int, side: int, seed: int = 0, procs: int = 1) -> None:
    """n JPEGs under root/train; procs > 1 writes them from that many processes (seeded per image, so
    the files differ from the one-process stream, which the docs' earlier sweeps used)."""
    if procs > 1:
        with multiprocessing.get_context("spawn").Pool(procs) as pool:
            pool.map(_write_part, [(root, n, classes, side, seed, p, procs) for p in range(procs)])
        return
    rng = np.random.default_rng(seed)
    for i in range(n):
        _write_one(root, i, classes, side, rng)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root")
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--side", type=int, default=128)
    parser.add_argument("--procs", type=int, default=1, help="processes writing (0: one per usable core)")
    args = parser.parse_args()
    write_jpegs(args.root, args.n, args.classes, args.side, procs=args.procs or len(os.sched_getaffinity(0)))


if __name__ == "__main__":
    main()

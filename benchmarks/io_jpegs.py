"""Photo-like JPEGs for the I/O sweep of docs/performance.md (`distribuuuu bench --io`).

    .venv/bin/python benchmarks/io_jpegs.py DIR [--n 2000] [--classes 10] [--side 128]

writes DIR/train/c<k>/<i>.jpg: n images, side x 3/4 side (every 4th one portrait), quality 90:
smooth colour regions, a texture and sensor-like noise, so that they compress like small photos
(about 6 KB at 128 px) rather than like random noise (which would be 3x larger and slower to decode).
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from PIL import Image


def write_jpegs(root: str, n: int, classes: int, side: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for i in range(n):
        w, h = (side, side * 3 // 4) if i % 4 else (side * 3 // 4, side)
        low = rng.random((h // 16 + 1, w // 16 + 1, 3)) * 255
        a = np.asarray(Image.fromarray(low.astype(np.uint8)).resize((w, h), Image.BICUBIC)).astype(np.float32)
        yy, xx = np.mgrid[0:h, 0:w]
        a += 30 * np.sin(xx / rng.uniform(3, 12) + yy / rng.uniform(3, 12))[..., None]
        a += rng.normal(0, 12, a.shape)
        folder = os.path.join(root, "train", f"c{i % classes}")
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(os.path.join(folder, f"{i:05d}.jpg"), quality=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root")
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--side", type=int, default=128)
    args = parser.parse_args()
    write_jpegs(args.root, args.n, args.classes, args.side)


if __name__ == "__main__":
    main()

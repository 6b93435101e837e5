"""The cost of the TRAIN.OVERLAP check (data/checks/overlap.py) on an image folder with train/ and val/.

    distribuuuu data export mnist5k /tmp/mnist5k      # 4000 train + 1000 val PNGs
    python benchmarks/overlap_cost.py /tmp/mnist5k [--repeat 3]
    python benchmarks/overlap_cost.py --files 100000   # that many small files sharing a size and a header

Rank 0 lists both splits, stats every file, and reads only the files whose byte size the other split also
has, each once, grouped by a hash of the whole file. Prints a table: the files, the listing's and the
comparison's seconds (best of --repeat, warm page cache: a first run on a cold network file system pays
the stats and reads at its latency), how many files were stat'ed and read, and the pairs found.
--files N writes N files of 2,000 bytes (a common 1 KiB header, then random bytes), 80% in train/ and
20% in val/, 1% of val copied into train, into a temporary folder under /tmp: every file shares its
size and its first KiB with every other, the case a pairwise comparison makes quadratic.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from distribuuuu.data.checks import overlap
from distribuuuu.data.sources import folder


def _write_files(root: str, n: int) -> None:
    header = os.urandom(1024)
    n_val = n // 5
    for split, count in (("train", n - n_val), ("val", n_val)):
        for c in range(10):
            os.makedirs(os.path.join(root, split, str(c)))
        for i in range(count):
            with open(os.path.join(root, split, str(i % 10), f"{i:06d}.png"), "wb") as f:
                f.write(header + os.urandom(976))
    for i in range(0, n_val, 100):  # 1% of val copied into train
        shutil.copyfile(os.path.join(root, "val", str(i % 10), f"{i:06d}.png"),
                        os.path.join(root, "train", str(i % 10), f"copy{i:06d}.png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", help="an image folder holding train/ and val/")
    parser.add_argument("--files", type=int, default=0, help="write this many small files to a temporary folder")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="overlap_cost.", dir="/tmp") if args.files else None
    root = tmp or args.root
    try:
        if tmp:
            _write_files(tmp, args.files)
        best: tuple[float, float] | None = None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            paths = []
            for split in ("train", "val"):
                split_dir = os.path.join(root, split)
                listing = folder.list_split(split_dir, folder.folder_classes(split_dir))
                paths.append([p for p, _ in listing.samples()])
            t1 = time.perf_counter()
            found = overlap.find(*paths)
            t2 = time.perf_counter()
            best = (t1 - t0, t2 - t1) if best is None else (min(best[0], t1 - t0), min(best[1], t2 - t1))
    finally:
        if tmp:
            shutil.rmtree(tmp)
    print("| train files | val files | listing s | compare s | stat'ed | read | pairs |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {len(paths[0])} | {len(paths[1])} | {best[0]:.3f} | {best[1]:.3f} | {found.stated} | {found.read} "
          f"| {len(found.pairs)} |")


if __name__ == "__main__":
    main()

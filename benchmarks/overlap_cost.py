"""The cost of the TRAIN.OVERLAP check (data/overlap.py) on an image folder with train/ and val/.

    distribuuuu data export mnist5k /tmp/mnist5k      # 4000 train + 1000 val PNGs
    python benchmarks/overlap_cost.py /tmp/mnist5k [--repeat 3]

Rank 0 lists both splits, stats every file, and reads only the files whose byte size the other
split also has (4 KiB first, whole files only when those match; a file under 4 KiB is read whole).
Prints a table: the files, the listing's and the comparison's seconds (best of --repeat, warm page
cache: a first run on a cold network file system pays the stats and reads at its latency), how many
files were stat'ed and read, and the pairs found.
"""

from __future__ import annotations

import argparse
import os
import time

from distribuuuu.data import integrity, overlap, sources


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", help="an image folder holding train/ and val/")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    best: tuple[float, float] | None = None
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        paths = []
        for split in ("train", "val"):
            split_dir = os.path.join(args.root, split)
            paths.append([p for p, _ in integrity.list_split(split_dir, sources.folder_classes(split_dir)).samples()])
        t1 = time.perf_counter()
        found = overlap.find(*paths)
        t2 = time.perf_counter()
        best = (t1 - t0, t2 - t1) if best is None else (min(best[0], t1 - t0), min(best[1], t2 - t1))
    print("| train files | val files | listing s | compare s | stat'ed | read | pairs |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {len(paths[0])} | {len(paths[1])} | {best[0]:.3f} | {best[1]:.3f} | {found.stated} | {found.read} "
          f"| {len(found.pairs)} |")


if __name__ == "__main__":
    main()

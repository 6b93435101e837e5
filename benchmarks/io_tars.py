"""The JPEGs of the I/O sweep as WebDataset tars made by another tool: the webdataset package's own
ShardWriter, then `distribuuuu data index` (docs/performance.md, the tars row of section 8).

    .venv/bin/python benchmarks/io_tars.py SRC DEST [--maxcount 250] [--label cls|json]

SRC is a dataset root holding train/<class>/<image> (benchmarks/io_jpegs.py writes one); DEST gets
DEST/train/train-0000.tar, ... (each image's own bytes as .jpg, its class index as .cls, and a .json
{"label": class name, "file": name}), written in a shuffled order as such tools write them, and
their index.json, made with --label-field cls (or json:label with --label json, the label then read
from each sample's JSON). Then:

    distribuuuu bench --io --io-tars DEST TRAIN.DATASET SRC ...
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random

import webdataset

from distribuuuu.data.shards import external


def write_tars(src: str, dest: str, maxcount: int, seed: int = 0) -> int:
    """SRC/train's images as tars in DEST/train, shuffled with seed; returns how many."""
    root = pathlib.Path(src, "train")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    images = sorted(p for c in classes for p in (root / c).iterdir() if p.is_file())
    random.Random(seed).shuffle(images)
    os.makedirs(os.path.join(dest, "train"), exist_ok=True)
    pattern = os.path.join(dest, "train", "train-%04d.tar")
    with webdataset.ShardWriter(pattern, maxcount=maxcount, verbose=0) as sink:
        for path in images:
            label = classes.index(path.parent.name)
            sink.write({"__key__": f"{path.parent.name}_{path.stem}", "jpg": path.read_bytes(), "cls": label,
                        "json": {"label": path.parent.name, "file": path.name}})
    return len(images)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("src")
    parser.add_argument("dest")
    parser.add_argument("--maxcount", type=int, default=250, help="images per tar")
    parser.add_argument("--label", choices=["cls", "json"], default="cls", help="where the index reads labels")
    args = parser.parse_args()
    n = write_tars(args.src, args.dest, args.maxcount)
    field = "cls" if args.label == "cls" else "json:label"
    for path, index, _ in external.index_tars(args.dest, label_field=field, progress=False):
        print(f"wrote {n} images as {len(index['shards'])} tars; {path} (labels from {field})")


if __name__ == "__main__":
    main()

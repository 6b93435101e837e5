"""Every format of the same images against the folder they came from: images per CPU-second reading
and decoding, and the resident memory of reading every item (#43, docs/data-formats.md,
docs/performance.md section 8).

    .venv/bin/python benchmarks/io_jpegs.py /tmp/hfio/jpegs --n 5000 --procs 0
    .venv/bin/python benchmarks/io_formats.py /tmp/hfio/jpegs [--repeats 5] [--batch 64]

From DIR/train/<class>/<image> (ImageFolder's order) it writes DIR.labels (labels.csv naming the
folder's files), DIR.saved (save_to_disk) and DIR.parquet (data/train-*.parquet, 1,000 rows a file),
the encoded bytes as they are, with a ClassLabel, and DIR.tars (webdataset's ShardWriter, then `data
index`: benchmarks/io_tars.py), each kept when it exists. Then, per format, in this one process:

- memory: VmRSS, RssAnon and RssFile (/proc/self/status) after the reader is built and after every
  item has been read once. Arrow files are memory-mapped: the pages read show in RssFile (the page
  cache, shared and reclaimable), not in RssAnon (what the process holds of its own).
- decode: read + the training decode (FastTrainDecode: decode, random resized crop, flip) of every
  image in a shuffled order, CPU seconds of this process; the formats alternate, each repeated.
- loader: the train loader that training builds, 0 workers (bench_io.measure: read, decode, augment,
  collate), images per CPU-second.
Tars are read by the shard reader, a stream: the loader alone is timed for them.

Prints one table with the ratios to the folder.
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import statistics
import time

import torch
from io_tars import write_tars

from distribuuuu import config, inferred
from distribuuuu.data import sources, transforms
from distribuuuu.data.decoding import cpu
from distribuuuu.data.shards import external
from distribuuuu.launch import comm
from distribuuuu.tools import bench_io


def write_formats(root: str) -> tuple[str, str]:
    """DIR.saved and DIR.parquet holding DIR/train's images and classes."""
    import datasets

    datasets.disable_progress_bars()
    saved, parquet = root.rstrip("/") + ".saved", root.rstrip("/") + ".parquet"
    if os.path.isdir(saved) and glob.glob(os.path.join(parquet, "data", "*.parquet")):
        return saved, parquet
    cfg = config.load_config(None, ["TRAIN.DATASET", root, "TRAIN.SPLIT", "train"])
    files = sources.image_files(cfg, "TRAIN")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=files.classes)})
    rows = {"image": [{"bytes": files.read(i), "path": os.path.basename(files.paths[i])} for i in range(len(files))],
            "label": list(files.targets)}
    train = datasets.Dataset.from_dict(rows, features=features)
    datasets.DatasetDict(train=train).save_to_disk(saved)
    os.makedirs(os.path.join(parquet, "data"), exist_ok=True)
    parts = range(0, len(train), 1000)
    for k, start in enumerate(parts):
        part = train.select(range(start, min(start + 1000, len(train))))
        part.to_parquet(os.path.join(parquet, "data", f"train-{k:05d}-of-{len(parts):05d}.parquet"))
    return saved, parquet


def write_labels(root: str) -> str:
    """DIR.labels/labels.csv: DIR/train's files (absolute paths) and their class names."""
    dest = root.rstrip("/") + ".labels"
    path = os.path.join(dest, "labels.csv")
    if not os.path.isfile(path):
        cfg = config.load_config(None, ["TRAIN.DATASET", root, "TRAIN.SPLIT", "train"])
        files = sources.image_files(cfg, "TRAIN")
        os.makedirs(dest, exist_ok=True)
        with open(path, "w") as f:
            f.write("path,label\n")
            f.writelines(f"{p},{files.classes[t]}\n" for p, t in zip(files.paths, files.targets))
    return dest


def write_webdataset(root: str) -> str:
    """DIR.tars: DIR/train's images as webdataset tars, indexed by `data index`."""
    dest = root.rstrip("/") + ".tars"
    if not os.path.isfile(os.path.join(dest, "train", "index.json")):
        write_tars(root, dest, maxcount=250)
        list(external.index_tars(dest, label_field="cls", progress=False))
    return dest


def memory() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile in MB."""
    with open("/proc/self/status") as f:
        found = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "RssAnon", "RssFile")))
    return {k: int(v.split()[0]) // 1024 for k, v in found.items()}


def decode_rate(files, decode, order: list[int]) -> float:
    """Images per CPU-second of reading and decoding files' items in order."""
    start = time.process_time()
    for i in order:
        decode(files.read(i))
    return len(order) / (time.process_time() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", help="a folder holding train/<class>/<image> (benchmarks/io_jpegs.py)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    saved, parquet = write_formats(args.root)
    paths = {"folder": args.root, "labels": write_labels(args.root), "saved": saved, "parquet": parquet,
             "tars": write_webdataset(args.root)}
    cfgs = {}
    for fmt, path in paths.items():
        opts = ["TRAIN.DATASET", path, "TEST.DATASET", path, "TRAIN.BATCH_SIZE", str(args.batch), "TRAIN.WORKERS", "0"]
        cfg = inferred.resolve(config.load_config(None, opts), 1)
        cfg.defrost()
        cfg.TRAIN.VAL_SPLIT = 0.0  # every format reads its whole split
        cfgs[fmt] = cfg
    readers, rss = {}, {}
    for fmt, cfg in cfgs.items():
        if fmt == "tars":
            continue  # a stream: its loader alone
        before = memory()
        readers[fmt] = sources.image_files(cfg, "TRAIN")
        built = memory()
        for i in range(len(readers[fmt])):
            readers[fmt].read(i)
        rss[fmt] = (before, built, memory())
    n = len(readers["folder"])
    assert all(len(r) == n and sorted(r.targets) == sorted(readers["folder"].targets) for r in readers.values())
    cfg = cfgs["folder"]
    decode = cpu.FastTrainDecode(cfg.TRAIN.IM_SIZE, "RGB", transforms.recipe_of(cfg))
    order = list(range(n))
    random.Random(0).shuffle(order)  # the order a shuffled epoch reads them in
    decoded = {fmt: [] for fmt in paths}
    loaded = {fmt: [] for fmt in paths}
    timing = (max(1, n // args.batch // 2), 2, 1)  # half an epoch, after 2 batches
    with comm.session(cfg) as ctx:
        for _ in range(args.repeats):  # the formats alternate: a slow spell hits each alike
            for fmt in paths:
                if fmt in readers:
                    decoded[fmt].append(decode_rate(readers[fmt], decode, order))
                loaded[fmt].append(bench_io.measure(cfgs[fmt], fmt, 0, ctx.device, timing).img_per_cpu_s)
    print(f"\n{n} images ({args.root}), {cfg.TRAIN.IM_SIZE} px crops, batch {args.batch}, 1 process, 0 workers, "
          f"median of {args.repeats}; MB before the reader / after building it / after reading every item")
    print(f"{'format':<8}{'decode img/CPU-s':>18}{'ratio':>7}{'loader img/CPU-s':>18}{'ratio':>7}"
          f"{'VmRSS MB':>16}{'RssAnon MB':>16}{'RssFile MB':>16}")
    base = statistics.median(decoded["folder"]), statistics.median(loaded["folder"])
    for fmt in paths:
        ld = statistics.median(loaded[fmt])
        if fmt not in readers:
            print(f"{fmt:<8}{'-':>18}{'-':>7}{ld:>18.0f}{ld / base[1]:>7.2f}{'-':>16}{'-':>16}{'-':>16}")
            continue
        d = statistics.median(decoded[fmt])
        mb = ["/".join(str(m[key]) for m in rss[fmt]) for key in ("VmRSS", "RssAnon", "RssFile")]
        print(f"{fmt:<8}{d:>18.0f}{d / base[0]:>7.2f}{ld:>18.0f}{ld / base[1]:>7.2f}{mb[0]:>16}{mb[1]:>16}{mb[2]:>16}")


if __name__ == "__main__":
    main()

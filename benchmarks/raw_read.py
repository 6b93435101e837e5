"""Raw read cost per image, no decoding: a folder's files vs tar shards of the same images.

    .venv/bin/python benchmarks/raw_read.py folder  SPLIT_DIR          # open + read each file, shuffled
    .venv/bin/python benchmarks/raw_read.py tarfile 'SHARDS/*.tar'     # the stdlib's tarfile, streamed
    .venv/bin/python benchmarks/raw_read.py minimal 'SHARDS/*.tar'     # 512-byte ustar headers parsed by hand

Prints images per wall second and per CPU-second of this one process. Drop the page cache before
a run (`sync; echo 3 > /proc/sys/vm/drop_caches`, as root) to time cold reads. What a shard
reader costs per sample on top of the bytes is its header parsing: compare tarfile with minimal.
"""

from __future__ import annotations

import glob
import os
import random
import sys
import tarfile
import time
from collections.abc import Iterator

IMAGE_EXTS = (b".jpg", b".jpeg", b".png")


def folder_files(split_dir: str) -> Iterator[bytes]:
    files = sorted(glob.glob(os.path.join(split_dir, "*", "*")))
    random.Random(0).shuffle(files)  # the order a shuffled epoch reads them in
    for path in files:
        with open(path, "rb") as f:
            yield f.read()


def tarfile_members(pattern: str) -> Iterator[bytes]:
    for path in sorted(glob.glob(pattern)):
        with tarfile.open(path, "r|") as tar:
            for member in tar:
                data = tar.extractfile(member).read()
                if member.name.encode().lower().endswith(IMAGE_EXTS):
                    yield data


def minimal_members(pattern: str) -> Iterator[bytes]:
    for path in sorted(glob.glob(pattern)):
        with open(path, "rb", buffering=1 << 20) as f:
            while len(header := f.read(512)) == 512 and header[0] != 0:
                name = header[:100].split(b"\0", 1)[0]
                size = int(header[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
                data = f.read(size)
                f.read(-size % 512)  # the data is padded to whole 512-byte blocks
                if name.lower().endswith(IMAGE_EXTS):
                    yield data


def main() -> None:
    mode, where = sys.argv[1], sys.argv[2]
    read = {"folder": folder_files, "tarfile": tarfile_members, "minimal": minimal_members}[mode]
    wall, cpu = time.perf_counter(), time.process_time()
    n = size = 0
    for data in read(where):
        n, size = n + 1, size + len(data)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{mode:<8} {n} images, {size / 1e6:.1f} MB: {n / wall:8.0f} img/s, {n / max(cpu, 1e-9):8.0f} img/CPU-s")


if __name__ == "__main__":
    main()

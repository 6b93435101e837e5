"""`distribuuuu bench --io`: images/s of the training data loader
against the number of loader workers.

    distribuuuu bench --io [--workers 0,1,2,4] [--iters N] [--warmup N] [--repeats R]
                           [--io-shards DIR] [--io-tars DIR] [--cfg FILE] [--out DIR]
                           [KEY VALUE ...]

What is timed is the train loader that training builds
(data.build_train_loader: read, decode, augment, collate, and the
per-batch normalization of the fast JPEG path), no model: one process,
TRAIN.WORKERS set to each count in turn. Per count, --warmup batches
untimed (worker start-up, first reads), then --repeats stretches of
--iters batches each, one img/s per stretch: the table gives their
median and their min..max spread. The loader cycles through epochs when
a stretch needs more batches than one epoch has.

TRAIN.DATASET must hold image files: an image folder
(<DATASET>/<SPLIT>/<class>/<image>), label files, a Hugging Face
dataset on disk or a shard set (`distribuuuu data shard`). Label files
and Hugging Face datasets are timed alone. For a folder the same images are also written as shards
(data.shards.write_shards, the encoded bytes as they are) and both
formats are timed side by side; --io-shards DIR keeps those shards and
reuses them next time (without it they go to a temporary folder under
--out, removed at the end). --io-tars DIR adds tars of the same images
that another tool wrote (`distribuuuu data index DIR` made their index;
benchmarks/io_tars.py writes them with the webdataset package). A shard
set is timed alone: its index does not name the folder it came from.
Each format reads its training split as a run would: a folder or label
file without a val split keeps its held-out tenth out. Results go to
--out (default OUT_DIR/bench): io.csv and io.png.
"""

from __future__ import annotations

import csv
import json
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from distribuuuu import config, data, inferred
from distribuuuu.data import shards, sources
from distribuuuu.data.shards.index import is_shard_set, load_shard_set
from distribuuuu.data.sources import folder, registry
from distribuuuu.errors import UserError
from distribuuuu.launch import comm, launcher
from distribuuuu.logger import setup_logging
from distribuuuu.tools.bench import _clock
from distribuuuu.tools.plot import pyplot

COLUMNS = [
    "format",
    "workers",
    "img_per_s",
    "img_per_s_min",
    "img_per_s_max",
    "img_per_s_per_worker",
    "img_per_cpu_s",
    "first_batch_s",
    "images_timed",
    "dataset_images",
]
FORMAT_COLOURS = {
    "folder": "tab:blue",
    "shards": "tab:orange",
    "tars": "tab:green",
    "labels": "tab:purple",
    "hf": "tab:red",
}


@dataclass
class IoRow:
    """One (format, worker count) measurement; img/s is the median over
    the timed stretches."""

    format: str
    workers: int
    img_per_s: float
    img_per_s_min: float
    img_per_s_max: float
    img_per_s_per_worker: float
    img_per_cpu_s: float | None
    first_batch_s: float
    images_timed: int
    dataset_images: int


def cores() -> int:
    """The CPU cores this process may run on (the affinity mask, which
    Slurm and containers narrow)."""
    return (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )


def default_workers(n_cores: int) -> list[int]:
    """0 (loading in the main process), then 1, 2, 4, ... up to the
    number of cores."""
    counts, w = [0], 1
    while w <= max(n_cores, 1):
        counts.append(w)
        w *= 2
    return counts


def parse_workers(text: str | None, n_cores: int) -> list[int]:
    """ "0,1,2" -> [0, 1, 2] (sorted); None -> default_workers; anything
    else is a UserError."""
    if text is None:
        return default_workers(n_cores)
    hint = "--workers takes a comma-separated list of loader worker counts such as 0,1,2,4"
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        raise UserError(f"{hint}, got {text!r}") from None
    if any(n < 0 for n in counts) or len(set(counts)) != len(counts):
        raise UserError(f"{hint} (each at least 0, none twice), got {text!r}")
    return sorted(counts)


# ---------------------------------------------------------------------------------------------
# what is read: the configured folder, its shard copy, or a shard set
# ---------------------------------------------------------------------------------------------
def dataset_format(cfg: Any) -> str:
    """'folder', 'labels', 'hf' or 'shards' for TRAIN.DATASET; a
    UserError for data that is not image files."""
    path = cfg.TRAIN.DATASET
    if cfg.MODEL.DUMMY_INPUT:
        raise UserError(
            "bench --io times reading image files, but MODEL.DUMMY_INPUT makes random tensors; "
            "drop MODEL.DUMMY_INPUT and point TRAIN.DATASET at an image folder or a shard set"
        )
    if is_shard_set(path) or is_shard_set(os.path.join(path, cfg.TRAIN.SPLIT)):
        return "shards"
    kind = sources.source_kind(path)
    if kind in ("labels", "hf"):
        return kind
    if kind != "folder":
        what = (
            "a CIFAR pickle folder"
            if kind == "cifar"
            else f"the {path} source (tensors, no image files)"
        )
        raise UserError(
            f"bench --io times reading image files, but TRAIN.DATASET {path!r} is {what}; point "
            "TRAIN.DATASET at an image folder (<DATASET>/<SPLIT>/<class>/<image>; `distribuuuu "
            "data export mnist5k DIR` writes one) or at a shard set (`distribuuuu data shard SRC "
            "DEST`)"
        )
    folder.folder_split_dir(
        path, cfg.TRAIN.SPLIT, "TRAIN", registry.note()
    )  # a UserError naming what is missing
    return "folder"


def find_index(folder: str, split: str) -> str | None:
    """The index.json of split's shards in folder: folder/<split>/
    (where write_shards puts a split, also in the DEST of `distribuuuu
    data shard`) or folder itself; None if neither holds one."""
    for path in (
        os.path.join(folder, os.path.basename(os.path.normpath(split)), "index.json"),
        os.path.join(folder, "index.json"),
    ):
        if os.path.isfile(path):
            return path
    return None


def shard_copy(split_dir: str, dest: str, n_images: int) -> str:
    """The split folder holding index.json of the shards of split_dir in
    dest: written there now, or reused when dest already holds shards of
    as many images."""
    index = find_index(dest, os.path.basename(os.path.normpath(split_dir)))
    if index is None:
        print(f"[bench] writing shards of {split_dir} into {dest}", flush=True)
        written = shards.write_shards(split_dir, dest, progress=True)
        index = str(written[0])
    else:
        print(f"[bench] reusing the shards in {os.path.dirname(index)}", flush=True)
    with open(index) as f:
        count = json.load(f)["num_samples"]
    if count != n_images:
        raise UserError(
            f"--io-shards {dest!r} holds shards of {count} images, but {split_dir!r} has "
            f"{n_images}; remove that folder (it is written again) or give another --io-shards "
            "folder"
        )
    return os.path.dirname(index)


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
def cpu_seconds() -> float | None:
    """CPU seconds (user + system) of this process and its children, the
    loader workers; None where /proc cannot tell (not Linux). Per core,
    what other jobs on the machine do shows in the wall clock, hardly in
    the CPU time: it is the fairer per-core figure on a shared machine."""
    # Children that have ended and been reaped (loader workers of an
    # earlier epoch) are in RUSAGE_CHILDREN.
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = time.process_time() + children.ru_utime + children.ru_stime
    try:
        tick = os.sysconf("SC_CLK_TCK")
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = (
                        f.read().rsplit(")", 1)[1].split()
                    )  # after "(command name)", which may hold spaces
            except OSError:  # the process has just ended
                continue
            if int(fields[1]) == os.getpid():  # the parent's pid; then utime, stime in clock ticks
                total += (int(fields[11]) + int(fields[12])) / tick
    except (OSError, ValueError, AttributeError):
        return None
    return total


def _batches(loader: Any) -> Iterator[Any]:
    """The loader's batches, epoch after epoch (each epoch reshuffled,
    as in training)."""
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def time_loader(
    loader: Any, device: torch.device, iters: int, warmup: int, repeats: int
) -> tuple[list[float], float, int, float | None]:
    """(img/s of each of `repeats` stretches of `iters` batches, seconds
    to the first batch, images timed, images per CPU-second over the
    stretches). A loop over a loader, not a callable: timed by hand with
    a clock that waits for the device (the fast path normalizes its
    batches there)."""
    now = _clock(device)
    start = time.perf_counter()
    batches = _batches(loader)
    next(batches)
    first_s = now() - start
    for _ in range(warmup):
        next(batches)
    rates, total, cpu_s = [], 0, 0.0
    for _ in range(repeats):
        cpu0 = cpu_seconds()
        images, t0 = 0, now()
        for _ in range(iters):
            images += next(batches)[0].size(0)
        rates.append(images / max(now() - t0, 1e-9))
        cpu1 = cpu_seconds()
        cpu_s = None if cpu0 is None or cpu1 is None or cpu_s is None else cpu_s + cpu1 - cpu0
        total += images
    batches.close()
    return rates, first_s, total, (total / cpu_s if cpu_s else None)


def measure(
    cfg: Any, fmt: str, workers: int, device: torch.device, timing: tuple[int, int, int]
) -> IoRow:
    """One row: the train loader of cfg with TRAIN.WORKERS workers,
    built, timed, stopped."""
    cfg = cfg.clone()
    cfg.defrost()
    cfg.TRAIN.WORKERS = workers
    loader = data.build_train_loader(cfg, 0, 1, device)
    if len(loader) == 0:
        raise UserError(
            f"the {fmt} training loader has no batches; lower TRAIN.BATCH_SIZE or use more images"
        )
    rates, first_s, images, per_cpu_s = time_loader(loader, device, *timing)
    n = len(loader.dataset)
    del loader  # stops its worker processes before the next count starts its own
    median = statistics.median(rates)
    return IoRow(
        fmt,
        workers,
        median,
        min(rates),
        max(rates),
        median / max(workers, 1),
        per_cpu_s,
        first_s,
        images,
        n,
    )


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------
def print_table(rows: Sequence[IoRow], header: str) -> None:
    """The rows, and per worker count each other format's ratio to the
    folder when both were timed."""
    print(f"\n{header}")
    print(
        f"{'format':<8}{'workers':>8}{'img/s':>10}{'min..max':>17}{'img/s/worker':>14}{'img/CPU-s':>11}"
        f"{'1st batch s':>12}"
    )
    for r in rows:
        spread = f"{r.img_per_s_min:.0f}..{r.img_per_s_max:.0f}"
        per_cpu = "-" if r.img_per_cpu_s is None else f"{r.img_per_cpu_s:.0f}"
        print(
            f"{r.format:<8}{r.workers:>8}{r.img_per_s:>10.0f}{spread:>17}{r.img_per_s_per_worker:>14.0f}"
            f"{per_cpu:>11}{r.first_batch_s:>12.2f}"
        )
    by = {(r.format, r.workers): r for r in rows}
    for fmt in dict.fromkeys(r.format for r in rows if r.format != "folder"):
        counts = [w for f, w in by if f == "folder" and (fmt, w) in by]
        _print_ratios(fmt, [(w, by[fmt, w], by["folder", w]) for w in counts])


def _print_ratios(fmt: str, pairs: list[tuple[int, IoRow, IoRow]]) -> None:
    """fmt / folder per worker count, in img/s and in img/CPU-s."""
    if pairs:
        print(
            f"{fmt} / folder, img/s: "
            + ", ".join(f"{w} workers {s.img_per_s / d.img_per_s:.2f}x" for w, s, d in pairs)
        )
    if pairs and all(s.img_per_cpu_s and d.img_per_cpu_s for _, s, d in pairs):
        print(
            f"{fmt} / folder, img/CPU-s: "
            + ", ".join(
                f"{w} workers {s.img_per_cpu_s / d.img_per_cpu_s:.2f}x" for w, s, d in pairs
            )
        )


def write_csv(rows: Sequence[IoRow], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(asdict(r) for r in rows)


def _per_core(row: IoRow, per_cpu: bool) -> float:
    return row.img_per_cpu_s if per_cpu and row.img_per_cpu_s else row.img_per_s_per_worker


def plot_io(rows: Sequence[IoRow], path: str, title: str) -> None:
    """img/s against the worker count (one line per format, bars =
    min..max of the stretches), and per core: images per CPU-second of
    the main process and its workers (where /proc told), else img/s per
    worker (the main process counts as one at 0 workers)."""
    plt = pyplot()
    per_cpu = all(r.img_per_cpu_s for r in rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), dpi=90)
    for fmt in dict.fromkeys(r.format for r in rows):
        mine = [r for r in rows if r.format == fmt]
        x = [r.workers for r in mine]
        y = [r.img_per_s for r in mine]
        err = [
            [v - r.img_per_s_min for v, r in zip(y, mine)],
            [r.img_per_s_max - v for v, r in zip(y, mine)],
        ]
        colour = FORMAT_COLOURS.get(fmt)
        ax1.errorbar(x, y, yerr=err, marker="o", capsize=3, color=colour, label=fmt)
        ax2.plot(x, [_per_core(r, per_cpu) for r in mine], marker="o", color=colour, label=fmt)
    ax1.set(
        title="data throughput (bars: min..max of the repeats)",
        xlabel="loader workers",
        ylabel="images / s",
    )
    ax2.set(
        title="per core: images per CPU-second (main + workers)"
        if per_cpu
        else "images / s per worker (0 workers: the main process)",
        xlabel="loader workers",
        ylabel="images / CPU-second" if per_cpu else "images / s per worker",
    )
    for ax in (ax1, ax2):
        ax.set_xticks(sorted({r.workers for r in rows}))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------
def _formats(
    cfg: Any, io_shards: str | None, out_dir: str, io_tars: str | None = None
) -> tuple[list[tuple[str, Any]], str | None]:
    """[(format, cfg reading it)], and a temporary folder to remove
    afterwards (or None)."""
    fmt = dataset_format(cfg)
    if fmt != "folder":
        if io_tars:
            raise UserError(f"--io-tars compares tars with an image folder: TRAIN.DATASET is {fmt}")
        return [(fmt, cfg)], None
    n_images = len(data.build_dataset(cfg, train=True))
    tars = [("tars", _reading(cfg, io_tars))] if io_tars else []
    if io_tars:  # checked before the shards are written
        count = load_shard_set(io_tars, cfg.TRAIN.SPLIT, "--io-tars").num_samples
        if count != n_images:
            raise UserError(
                f"--io-tars {io_tars!r} holds {count} images in split {cfg.TRAIN.SPLIT!r}, but the "
                f"folder has {n_images}; give tars of the same images"
            )
    tmp = None if io_shards else tempfile.mkdtemp(prefix="io_shards.", dir=out_dir)
    shard_dir = shard_copy(
        os.path.join(cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT), io_shards or tmp, n_images
    )
    return [("folder", cfg), ("shards", _reading(cfg, shard_dir)), *tars], tmp


def _reading(cfg: Any, dataset: str) -> Any:
    """cfg with TRAIN.DATASET dataset."""
    other = cfg.clone()
    other.defrost()
    other.TRAIN.DATASET = dataset
    return other


def run_io(
    cfg: Any,
    workers: list[int],
    timing: tuple[int, int, int],
    io_shards: str | None,
    out_dir: str,
    io_tars: str | None = None,
) -> list[IoRow]:
    """Time each format at each worker count; print the table, write
    io.csv and io.png."""
    if launcher.detect().launcher != "plain":
        raise UserError(
            "`distribuuuu bench --io` measures one process; start it without a launcher"
        )
    os.makedirs(out_dir, exist_ok=True)
    formats, tmp = _formats(cfg, io_shards, out_dir, io_tars)
    rows = []
    try:
        with comm.session(cfg) as ctx:
            setup_logging(None, True)
            # Formats alternate at each worker count, so that a slow
            # spell of the machine hits both alike.
            for w in workers:
                for fmt, fmt_cfg in formats:
                    print(f"[bench] {fmt}, {w} worker(s)", flush=True)
                    rows.append(measure(fmt_cfg, fmt, w, ctx.device, timing))
            rows.sort(
                key=lambda r: [f for f, _ in formats].index(r.format)
            )  # the table: one format, then the other
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    iters, warmup, repeats = timing
    what = (
        f"{cfg.TRAIN.DATASET} ({rows[0].dataset_images} images) | batch {cfg.TRAIN.BATCH_SIZE} at "
        f"{cfg.TRAIN.IM_SIZE} px | decode {cfg.TRAIN.IMAGE_DECODE} | {cores()} core(s)"
    )
    print_table(
        rows, f"bench --io: {what} | median of {repeats} x {iters} batches after {warmup} warm-up"
    )
    csv_path, png_path = os.path.join(out_dir, "io.csv"), os.path.join(out_dir, "io.png")
    write_csv(rows, csv_path)
    plot_io(rows, png_path, f"train loader, no model: {what}")
    print(f"wrote {csv_path}, {png_path}")
    return rows


def main(
    cfg_file: str | None,
    opts: list[str],
    workers_text: str | None,
    timing: tuple[int, int, int],
    io_shards: str | None,
    out: str | None,
    io_tars: str | None = None,
) -> int:
    """`distribuuuu bench --io`: the worker list and the config are
    checked before anything is read."""
    workers = parse_workers(workers_text, cores())
    cfg = inferred.resolve(config.load_config(cfg_file, opts), 1)  # one process
    run_io(cfg, workers, timing, io_shards, out or os.path.join(cfg.OUT_DIR, "bench"), io_tars)
    return 0

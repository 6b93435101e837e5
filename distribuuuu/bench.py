"""`distribuuuu bench`: where the time of a training step goes, and how training scales.

    distribuuuu bench [--cfg FILE] [--iters N] [--warmup N] [--out DIR] [KEY VALUE ...]
        one process, three measurements with the config's model, batch, data and device:
        (a) the model alone on a random batch: the training step (the engine's Stepper: AMP,
            channels_last, ... as configured), its forward alone, and the eval forward;
        (b) the training data loader alone (img/s, per worker, time to the first batch);
        (c) whole training steps on loader batches, and the share of their time spent waiting for data.
    distribuuuu bench --scaling 1,2,4 [--epochs E] [--cfg FILE] [--out DIR] [KEY VALUE ...]
        (d) the same short training run (E epochs, default 1) with each number of processes, started
        by the built-in spawner; a table, scaling.csv and scaling.png. TRAIN.BATCH_SIZE is per process,
        so an epoch of the same data takes 1/N of the steps (weak scaling of the batch).
    distribuuuu bench --compare single,dp,ddp,ddp+amp [--epochs E] [--cfg FILE] [--out DIR] [KEY VALUE ...]
        (e) the same short job (same global batch) trained each way; see compare.py.

Results go to --out (default OUT_DIR/bench): bench.json, or scaling.csv + scaling.png + the runs
(compare.csv + compare.png + the runs with --compare).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from distribuuuu.errors import UserError

SCALING_COLUMNS = ["processes", "img_per_s", "img_per_s_per_process", "efficiency", "epoch_s", "data_frac",
                   "global_batch"]


# ---------------------------------------------------------------------------------------------
# (a) - (c): one process
# ---------------------------------------------------------------------------------------------
def _stepper(cfg: Any, ctx: Any) -> Any:
    """The model and the engine's Stepper (AMP, channels_last, accumulation, clipping, EMA as configured)."""
    from distribuuuu import engine, optim
    from distribuuuu.stepper import Stepper

    model = engine.build_model(cfg, ctx)
    optimizer = optim.build_optimizer(cfg, model)
    optim.set_lr(optimizer, optim.peak_lr(cfg, cfg.TRAIN.BATCH_SIZE * cfg.TRAIN.ACCUM_STEPS))
    return Stepper(cfg, ctx.device, model, optimizer, cfg.TRAIN.BATCH_SIZE * cfg.TRAIN.ACCUM_STEPS)


def _synchronize(device: Any) -> None:
    """Wait for the device's queued work (CUDA only; the CPU computes synchronously)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(device: Any) -> Callable[[], float]:
    """A clock read after the device's queued work is done: for the ends of a timed stretch only,
    since a synchronize inside a loop removes the CPU/GPU overlap that training has."""

    def now() -> float:
        _synchronize(device)  # GPU work is asynchronous: wait before reading the clock
        return time.perf_counter()

    return now


def bench_model(cfg: Any, ctx: Any, iters: int, warmup: int) -> dict[str, float]:
    """(a) the model on one random batch: a training step (the engine's Stepper.micro_step), its
    forward alone, and the eval-mode forward; ms per iteration and img/s."""
    import torch

    stepper = _stepper(cfg, ctx)
    model, now = stepper.model, _clock(ctx.device)
    b, c, s = cfg.TRAIN.BATCH_SIZE, cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE
    x = torch.randn(b, c, s, s, device=ctx.device)
    y = torch.randint(cfg.MODEL.NUM_CLASSES, (b,), device=ctx.device)

    def timed(fn: Callable[[], Any]) -> float:
        for _ in range(warmup):
            fn()
        start = now()
        for _ in range(iters):
            fn()
        return (now() - start) / iters

    def forward() -> None:
        with stepper.autocast():
            model(stepper.prepare(x))  # with autograd's bookkeeping, as in training; the graph is dropped

    def eval_forward() -> None:
        with torch.no_grad(), stepper.autocast():
            model(stepper.prepare(x))

    model.train()
    step_s = timed(lambda: stepper.micro_step(x, y))
    forward_s = timed(forward)
    model.eval()
    eval_s = timed(eval_forward)
    return {"train_ms": 1e3 * step_s, "train_img_per_s": b / step_s, "forward_ms": 1e3 * forward_s,
            "backward_step_ms": 1e3 * (step_s - forward_s), "eval_forward_ms": 1e3 * eval_s,
            "eval_img_per_s": b / eval_s}


def _train_loader(cfg: Any, ctx: Any) -> Any:
    from distribuuuu import data

    loader = data.build_train_loader(cfg, 0, 1, ctx.device)
    if len(loader) == 0:
        raise UserError("the training loader has no batches; lower TRAIN.BATCH_SIZE or use more data")
    return loader


def bench_data(cfg: Any, ctx: Any, iters: int) -> dict[str, float]:
    """(b) the training loader alone: img/s after the first batch, per worker, first-batch latency."""
    loader = _train_loader(cfg, ctx)
    now = _clock(ctx.device)  # the in-memory pipeline makes its batches with GPU kernels
    start = t0 = time.perf_counter()
    first_s, images, batches, epoch = None, 0, 0, 0
    while batches < iters + 1:
        loader.sampler.set_epoch(epoch)
        for x, _ in loader:
            if first_s is None:
                t0 = now()  # workers started, first batch read (and made, on a GPU)
                first_s = t0 - start
            else:
                images += x.size(0)
            batches += 1
            if batches >= iters + 1:
                break
        epoch += 1
    seconds = now() - t0  # the batches are made, not only launched
    workers = cfg.TRAIN.WORKERS
    img_s = images / max(seconds, 1e-9)
    del loader  # stops the worker processes
    return {"img_per_s": img_s, "img_per_s_per_worker": img_s / max(workers, 1), "workers": workers,
            "first_batch_s": first_s or 0.0, "batches": batches - 1}


def bench_step(cfg: Any, ctx: Any, iters: int, warmup: int) -> dict[str, float]:
    """(c) training steps on real batches of the training loader: img/s and the data-wait share.

    The loop of engine.train_epoch (batch to device, Stepper.micro_step) without its bookkeeping
    (checkpoints, progress, metrics), timed the same way: a step's data wait is the time from the
    end of the previous step (as the host sees it) until its batch is on the device. As in training,
    no step waits for the GPU (that would remove the overlap of data loading with GPU compute and
    inflate the data-wait share); the clock synchronizes at the start and the end only.
    """
    stepper = _stepper(cfg, ctx)
    loader = _train_loader(cfg, ctx)
    now = _clock(ctx.device)
    stepper.model.train()
    step, images_seen, data_s, epoch = 0, 0, 0.0, 0
    tick = start = now()
    while step < warmup + iters:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            x = x.to(ctx.device, non_blocking=True)
            y = y.to(ctx.device, non_blocking=True)
            if step == warmup:  # the timed part starts with this step's data wait
                start, data_s, images_seen = tick, 0.0, 0
            data_s += time.perf_counter() - tick
            stepper.micro_step(x, y)
            images_seen += x.size(0)
            step += 1
            # The warm-up's last step is waited for, so that the timed part starts with an idle GPU.
            tick = now() if step == warmup else time.perf_counter()
            if step >= warmup + iters:
                break
        epoch += 1
    seconds = now() - start
    del loader  # stops the worker processes
    return {"img_per_s": images_seen / seconds, "ms_per_step": 1e3 * seconds / iters,
            "data_frac": data_s / seconds, "steps": iters}


def run_local(cfg: Any, iters: int, warmup: int, out_dir: str) -> dict[str, Any]:
    """(a), (b) and (c) in this process; prints a table and writes out_dir/bench.json."""
    import torch

    from distribuuuu import distributed
    from distribuuuu.logger import setup_logging

    if distributed.detect().launcher != "plain":
        raise UserError("`distribuuuu bench` measures one process; start it without a launcher, and use "
                        "--scaling 1,2,4 to measure several processes")
    with distributed.session(cfg) as ctx:
        setup_logging(None, True)
        result = {"arch": cfg.MODEL.ARCH, "batch": cfg.TRAIN.BATCH_SIZE,
                  "input": [cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE, cfg.TRAIN.IM_SIZE],
                  "device": str(ctx.device), "threads": torch.get_num_threads(), "iters": iters, "warmup": warmup,
                  "dataset": cfg.TRAIN.DATASET}
        result["model"] = bench_model(cfg, ctx, iters, warmup)
        result["data"] = bench_data(cfg, ctx, iters)
        result["step"] = bench_step(cfg, ctx, iters, warmup)
    m, d, s = result["model"], result["data"], result["step"]
    c, h, w = result["input"]
    print(f"\nbench: {cfg.MODEL.ARCH} | batch {cfg.TRAIN.BATCH_SIZE} of {c}x{h}x{w} | {ctx.device} | "
          f"{result['threads']} thread(s) | {iters} iterations after {warmup} warm-up")
    amp = f"AMP {cfg.TRAIN.AMP}" + (", channels_last" if cfg.TRAIN.CHANNELS_LAST else "")
    rows = [("model forward (train mode)", m["forward_ms"], None, amp),
            ("model backward + optimizer", m["backward_step_ms"], None, "training step minus forward"),
            ("model training step", m["train_ms"], m["train_img_per_s"], "random batch, no data loading"),
            ("model forward (eval, no_grad)", m["eval_forward_ms"], m["eval_img_per_s"], ""),
            ("data loader alone", 1e3 * cfg.TRAIN.BATCH_SIZE / max(d["img_per_s"], 1e-9), d["img_per_s"],
             (f"{d['workers']} workers, {d['img_per_s_per_worker']:.0f} img/s per worker, " if d["workers"]
              else "TRAIN.WORKERS 0: loading in the main process, ") +
             f"first batch after {d['first_batch_s']:.2f}s; {cfg.TRAIN.DATASET}"),
            ("full training step", s["ms_per_step"], s["img_per_s"],
             f"waiting for data {100 * s['data_frac']:.1f}% of the time")]
    print(f"{'part':<31}{'ms/iter':>10}{'img/s':>10}  notes")
    for name, ms, img_s, note in rows:
        print(f"{name:<31}{ms:>10.2f}{'' if img_s is None else f'{img_s:.0f}':>10}  {note}")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bench.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
    return result


# ---------------------------------------------------------------------------------------------
# (d): the same run with 1, 2, 4 ... processes
# ---------------------------------------------------------------------------------------------
@contextmanager
def _output_to(path: str) -> Iterator[None]:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so also those of the
    processes it starts) to path, and restore them afterwards."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    env = os.environ.get("DISTRIBUUUU_PROGRESS")
    os.environ["DISTRIBUUUU_PROGRESS"] = "lines"  # a log file gets lines, not a bar
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        if env is None:
            os.environ.pop("DISTRIBUUUU_PROGRESS", None)
        else:
            os.environ["DISTRIBUUUU_PROGRESS"] = env


def parse_counts(text: str) -> list[int]:
    """ "1,2,4" -> [1, 2, 4]; anything else is a UserError."""
    hint = "--scaling takes a comma-separated list of process counts such as 1,2,4"
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        raise UserError(f"{hint}, got {text!r}") from None
    if any(n < 1 for n in counts) or len(set(counts)) != len(counts):
        raise UserError(f"{hint} (each at least 1, none twice), got {text!r}")
    return sorted(counts)


def _gpu_count(cfg: Any) -> int | None:
    """GPUs the runs will use, or None on the CPU. device_count() creates no CUDA context here,
    which would hold GPU 0 memory during the whole sweep."""
    import torch

    return torch.cuda.device_count() if cfg.DEVICE != "cpu" and torch.cuda.is_available() else None


def _device_label(gpus: int | None) -> str:
    import torch

    return torch.cuda.get_device_name(0) if gpus else f"CPU, {os.cpu_count()} cores"


def _last_train_record(run_dir: str) -> dict[str, Any]:
    from distribuuuu.plot import read_metrics

    train = [r for r in read_metrics(run_dir) if r.get("split") == "train" and isinstance(r.get("epoch"), int)]
    if not train:
        raise RuntimeError(f"{run_dir}/metrics.jsonl holds no training epoch")
    return train[-1]


def scaling_rows(records: Sequence[tuple[int, dict[str, Any]]], batch: int) -> list[dict[str, Any]]:
    """The table from (processes, last train record) pairs; efficiency is per-process img/s
    relative to the smallest process count (1.0 = linear scaling)."""
    base_n, base = records[0]
    per_base = base["img_per_s"] / base_n
    return [{"processes": n, "img_per_s": r["img_per_s"], "img_per_s_per_process": r["img_per_s"] / n,
             "efficiency": (r["img_per_s"] / n) / per_base, "epoch_s": r["time_s"],
             "data_frac": r.get("data_frac"), "global_batch": batch * n} for n, r in records]


def run_scaling(cfg_file: str | None, opts: list[str], counts: list[int], epochs: int, out_dir: str) -> int:
    """Train for `epochs` with each process count; print the table, write scaling.csv / scaling.png."""
    from distribuuuu import cli, config
    from distribuuuu.plot import plot_scaling

    if epochs < 1:
        raise UserError(f"--epochs must be at least 1, got {epochs}")
    cfg = config.load_config(cfg_file, opts + ["OPTIM.MAX_EPOCH", str(epochs)])  # bad keys fail here, once
    gpus = _gpu_count(cfg)
    if gpus is not None and counts[-1] > gpus:
        raise UserError(f"--scaling asks for {counts[-1]} processes but there are {gpus} GPU(s); "
                        f"use counts up to {gpus}, or DEVICE cpu")
    os.makedirs(out_dir, exist_ok=True)
    records = []
    for n in counts:
        run_dir = os.path.join(out_dir, f"p{n}")
        shutil.rmtree(run_dir, ignore_errors=True)  # bench's own folder: a fresh run every time
        args = ["train", *(["--cfg", cfg_file] if cfg_file else []), "--nproc-per-node", str(n), *opts,
                "OUT_DIR", run_dir, "OPTIM.MAX_EPOCH", str(epochs), "TRAIN.AUTO_RESUME", "False"]
        log_path = os.path.join(out_dir, f"p{n}.log")
        print(f"[bench] {n} process(es): distribuuuu {' '.join(args)}  (log: {log_path})", flush=True)
        # The CLI's own spawner, called from here: no extra interpreter to start per count.
        with _output_to(log_path):
            status = cli.main(args)
        if status != 0:
            with open(log_path) as f:
                tail = f.read()[-3000:]
            print(tail, file=sys.stderr)
            print(f"error: the run with {n} process(es) exited with status {status} (log: {log_path})",
                  file=sys.stderr, flush=True)
            return status
        records.append((n, _last_train_record(run_dir)))
    rows = scaling_rows(records, cfg.TRAIN.BATCH_SIZE)
    device = _device_label(gpus)  # after the runs: this may create a CUDA context
    print(f"\nscaling: {cfg.MODEL.ARCH} | batch {cfg.TRAIN.BATCH_SIZE} per process | {device} | "
          f"epoch {epochs} of {epochs} on {cfg.TRAIN.DATASET}")
    print(f"{'processes':>9} {'img/s':>10} {'img/s/proc':>11} {'efficiency':>11} {'epoch s':>9} {'data wait':>10}")
    for r in rows:
        wait = "" if r["data_frac"] is None else f"{100 * r['data_frac']:.1f}%"
        print(f"{r['processes']:>9} {r['img_per_s']:>10.1f} {r['img_per_s_per_process']:>11.1f} "
              f"{r['efficiency']:>10.0%} {r['epoch_s']:>9.2f} {wait:>10}")
    csv_path, png_path = os.path.join(out_dir, "scaling.csv"), os.path.join(out_dir, "scaling.png")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SCALING_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    plot_scaling(rows, png_path, f"{cfg.MODEL.ARCH} on {cfg.TRAIN.DATASET}, batch {cfg.TRAIN.BATCH_SIZE} per "
                 f"process, {device} (epoch {epochs} of {epochs} timed)")
    print(f"wrote {csv_path}, {png_path}")
    return 0


def main(cfg_file: str | None, opts: list[str], iters: int, warmup: int, scaling: str | None,
         epochs: int, out: str | None) -> int:
    """`distribuuuu bench`: the local measurements, or the scaling sweep with --scaling."""
    from distribuuuu import config

    if iters < 1 or warmup < 0:
        raise UserError(f"--iters must be at least 1 and --warmup at least 0, got {iters} and {warmup}")
    counts = parse_counts(scaling) if scaling is not None else None
    cfg = config.load_config(cfg_file, opts)
    out_dir = out or os.path.join(cfg.OUT_DIR, "bench")
    if counts is not None:
        return run_scaling(cfg_file, opts, counts, epochs, out_dir)
    run_local(cfg, iters, warmup, out_dir)
    return 0

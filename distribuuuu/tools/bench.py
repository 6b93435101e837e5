"""`distribuuuu bench`: where the time of a training step goes.

    distribuuuu bench [--cfg FILE] [--iters N] [--warmup N] [--out DIR] [KEY VALUE ...]
        one process, three measurements with the config's model, batch, data and device:
        (a) the model alone on a random batch: the training step (the
            engine's Stepper: AMP, channels_last, ... as configured),
            its forward alone, and the eval forward; each timed by
            torch.utils.benchmark.Timer (median and interquartile range
            over blocks of calls);
        (b) the training data loader alone (img/s, per worker, time to
            the first batch);
        (c) whole training steps on loader batches, and the share of
            their time spent waiting for data.

The sweeps that train for real are apart: `bench --scaling 1,2,4` (d) in
scaling.py and `bench --compare single,dp,ddp,ddp+amp` (e) in
compare.py. Results go to --out (default OUT_DIR/bench): bench.json.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.benchmark import Measurement, Timer

from distribuuuu import config, data, inferred, models, optim, strategies
from distribuuuu.errors import UserError
from distribuuuu.launch import comm, launcher
from distribuuuu.logger import setup_logging
from distribuuuu.optim import Stepper

MIN_RUN_S = 0.2  # torch's Timer default: enough blocks for a median and an IQR


# ---------------------------------------------------------------------------------------------
# clocks
# ---------------------------------------------------------------------------------------------
def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA only; the CPU computes
    synchronously). The one place bench waits for the GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(device: torch.device) -> Callable[[], float]:
    """A clock read after the device's queued work is done: for the ends
    of a timed stretch only, since a synchronize inside a loop removes
    the CPU/GPU overlap that training has."""

    def now() -> float:
        _synchronize(device)  # GPU work is asynchronous: wait before reading the clock
        return time.perf_counter()

    return now


def time_call(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int) -> Measurement:
    """Seconds per call of fn: `warmup` untimed calls, then torch's
    Timer.blocked_autorange for at least `iters` calls' worth of time
    (as one call after the warm-up took) and MIN_RUN_S.

    Timer is given bench's clock: its default synchronizes the *current*
    accelerator, which is not the bench's device when that is another
    GPU, and waits on a GPU when DEVICE is cpu. Timer runs its statement
    under its own thread setting (default 1): it gets this process's.
    """
    clock = _clock(device)
    for _ in range(warmup):
        fn()
    # A warm call sizes the timed stretch: the first calls carry cuDNN's
    # autotuning and compilation (seconds on a GPU), and sizing by them
    # made ResNet-50's stretch minutes long on an H100.
    start = clock()
    fn()
    per_call = clock() - start
    timer = Timer(stmt="fn()", globals={"fn": fn}, timer=clock, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=max(MIN_RUN_S, iters * per_call))


# ---------------------------------------------------------------------------------------------
# (a) - (c)
# ---------------------------------------------------------------------------------------------
def _stepper(cfg: Any, ctx: comm.DistContext) -> Stepper:
    """The model and the engine's Stepper (AMP, channels_last,
    accumulation, clipping, EMA as configured)."""
    strategy = strategies.build(cfg, ctx)
    model = strategy.wrap_model(
        models.build_model(cfg, new_head=True)
    )  # as training builds it (fine-tuning too)
    optimizer = strategy.build_optimizer(model)
    peak = optim.peak_lr(cfg, cfg.TRAIN.BATCH_SIZE * cfg.TRAIN.ACCUM_STEPS)
    optim.Schedule(cfg, peak).apply(
        optimizer, optim.warmup_epochs(cfg)
    )  # the LR at the end of the warmup
    return Stepper(
        cfg, ctx.device, model, optimizer, cfg.TRAIN.BATCH_SIZE * cfg.TRAIN.ACCUM_STEPS, strategy
    )


def bench_model(
    cfg: Any, ctx: comm.DistContext, iters: int, warmup: int, stepper: Stepper | None = None
) -> dict[str, float]:
    """(a) the model on one random batch: a training step (the engine's
        Stepper.micro_step), its
    forward alone, and the eval-mode forward; median ms per call, its
    IQR, and img/s."""
    stepper = stepper or _stepper(cfg, ctx)
    model = stepper.model
    b, c, s = cfg.TRAIN.BATCH_SIZE, cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE
    x = torch.randn(b, c, s, s, device=ctx.device)
    y = torch.randint(cfg.MODEL.NUM_CLASSES, (b,), device=ctx.device)

    def forward() -> None:
        with stepper.autocast():
            model(
                stepper.prepare(x)
            )  # with autograd's bookkeeping, as in training; the graph is dropped

    def eval_forward() -> None:
        with torch.no_grad(), stepper.autocast():
            model(stepper.prepare(x))

    model.train()
    step = time_call(lambda: stepper.micro_step(x, y), ctx.device, iters, warmup)
    fwd = time_call(forward, ctx.device, iters, warmup)
    model.eval()
    ev = time_call(eval_forward, ctx.device, iters, warmup)
    return {
        "train_ms": 1e3 * step.median,
        "train_img_per_s": b / step.median,
        "forward_ms": 1e3 * fwd.median,
        "backward_step_ms": 1e3 * (step.median - fwd.median),
        "eval_forward_ms": 1e3 * ev.median,
        "eval_img_per_s": b / ev.median,
        "train_iqr_ms": 1e3 * step.iqr,
        "forward_iqr_ms": 1e3 * fwd.iqr,
        "eval_forward_iqr_ms": 1e3 * ev.iqr,
        "calls": {
            k: m.number_per_run * len(m.raw_times)
            for k, m in (("train", step), ("forward", fwd), ("eval_forward", ev))
        },
    }


def _train_loader(cfg: Any, ctx: comm.DistContext) -> Any:
    loader = data.build_train_loader(cfg, 0, 1, ctx.device)
    if len(loader) == 0:
        raise UserError(
            "the training loader has no batches; lower TRAIN.BATCH_SIZE or use more data"
        )
    return loader


def bench_data(cfg: Any, ctx: comm.DistContext, iters: int, loader: Any = None) -> dict[str, float]:
    """(b) the training loader alone: img/s after the first batch, per
        worker, first-batch latency.
    A loop over a loader, not a callable: timed by hand, with a clock
    that waits for the device."""
    loader = loader or _train_loader(cfg, ctx)
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
    return {
        "img_per_s": img_s,
        "img_per_s_per_worker": img_s / max(workers, 1),
        "workers": workers,
        "first_batch_s": first_s or 0.0,
        "batches": batches - 1,
    }


def bench_step(
    cfg: Any,
    ctx: comm.DistContext,
    iters: int,
    warmup: int,
    stepper: Stepper | None = None,
    loader: Any = None,
) -> dict[str, float]:
    """(c) training steps on real batches of the training loader: img/s and
        the data-wait share.

    The loop of Trainer.train_epoch (batch to device,
    Stepper.micro_step) without its bookkeeping (checkpoints, progress,
    metrics), timed the same way: a step's data wait is the time from
    the end of the previous step (as the host sees it) until its batch
    is on the device. As in training, no step waits for the GPU (that
    would remove the overlap of data loading with GPU compute and
    inflate the data-wait share); the clock synchronizes at the start
    and the end only.
    """
    stepper, loader = stepper or _stepper(cfg, ctx), loader or _train_loader(cfg, ctx)
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
            # The warm-up's last step is waited for, so that the timed
            # part starts with an idle GPU.
            tick = now() if step == warmup else time.perf_counter()
            if step >= warmup + iters:
                break
        epoch += 1
    seconds = now() - start
    return {
        "img_per_s": images_seen / seconds,
        "ms_per_step": 1e3 * seconds / iters,
        "data_frac": data_s / seconds,
        "steps": iters,
    }


# ---------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------
def print_table(cfg: Any, result: dict[str, Any]) -> None:
    """The measurements as one table: median ms per iteration, its IQR
    where Timer measured one."""
    m, d, s = result["model"], result["data"], result["step"]
    c, h, w = result["input"]
    print(
        f"\nbench: {cfg.MODEL.ARCH} | batch {cfg.TRAIN.BATCH_SIZE} of {c}x{h}x{w} | "
        f"{result['device']} | {result['threads']} thread(s) | {result['iters']} iterations after "
        f"{result['warmup']} warm-up"
    )
    amp = f"AMP {cfg.TRAIN.AMP}" + (", channels_last" if cfg.TRAIN.CHANNELS_LAST else "")
    rows = [
        ("model forward (train mode)", m["forward_ms"], m["forward_iqr_ms"], None, amp),
        (
            "model backward + optimizer",
            m["backward_step_ms"],
            None,
            None,
            "training step minus forward",
        ),
        (
            "model training step",
            m["train_ms"],
            m["train_iqr_ms"],
            m["train_img_per_s"],
            "random batch, no data loading",
        ),
        (
            "model forward (eval, no_grad)",
            m["eval_forward_ms"],
            m["eval_forward_iqr_ms"],
            m["eval_img_per_s"],
            "",
        ),
        (
            "data loader alone",
            1e3 * cfg.TRAIN.BATCH_SIZE / max(d["img_per_s"], 1e-9),
            None,
            d["img_per_s"],
            (
                f"{d['workers']} workers, {d['img_per_s_per_worker']:.0f} img/s per worker, "
                if d["workers"]
                else "TRAIN.WORKERS 0: loading in the main process, "
            )
            + f"first batch after {d['first_batch_s']:.2f}s; {cfg.TRAIN.DATASET}",
        ),
        (
            "full training step",
            s["ms_per_step"],
            None,
            s["img_per_s"],
            f"waiting for data {100 * s['data_frac']:.1f}% of the time",
        ),
    ]
    print(f"{'part':<31}{'ms/iter':>10}{'IQR ms':>9}{'img/s':>10}  notes")
    for name, ms, iqr, img_s, note in rows:
        print(
            f"{name:<31}{ms:>10.2f}{'' if iqr is None else f'{iqr:.2f}':>9}"
            f"{'' if img_s is None else f'{img_s:.0f}':>10}  {note}"
        )


def run_local(cfg: Any, iters: int, warmup: int, out_dir: str) -> dict[str, Any]:
    """(a), (b) and (c) in this process; prints a table and writes
    out_dir/bench.json."""
    if launcher.detect().launcher != "plain":
        raise UserError(
            "`distribuuuu bench` measures one process; start it without a launcher, and use "
            "--scaling 1,2,4 to measure several processes"
        )
    with comm.session(cfg) as ctx:
        setup_logging(None, True)
        result = {
            "arch": cfg.MODEL.ARCH,
            "batch": cfg.TRAIN.BATCH_SIZE,
            "input": [cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE, cfg.TRAIN.IM_SIZE],
            "device": str(ctx.device),
            "threads": torch.get_num_threads(),
            "iters": iters,
            "warmup": warmup,
            "dataset": cfg.TRAIN.DATASET,
        }
        # One model and one loader for all three parts (a folder is
        # listed once, the log says each once).
        stepper, loader = _stepper(cfg, ctx), _train_loader(cfg, ctx)
        result["model"] = bench_model(cfg, ctx, iters, warmup, stepper)
        result["data"] = bench_data(cfg, ctx, iters, loader)
        result["step"] = bench_step(cfg, ctx, iters, warmup, stepper, loader)
        del loader  # stops its worker processes
    print_table(cfg, result)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bench.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
    return result


def main(cfg_file: str | None, opts: list[str], iters: int, warmup: int, out: str | None) -> int:
    """`distribuuuu bench` without --scaling / --compare: the
    one-process measurements (the CLI has checked iters >= 1 and warmup
    >= 0)."""
    cfg = inferred.resolve(
        config.load_config(cfg_file, opts), 1
    )  # the unset keys, for this one process
    run_local(cfg, iters, warmup, out or os.path.join(cfg.OUT_DIR, "bench"))
    return 0

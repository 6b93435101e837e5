"""`distribuuuu bench --compare`: the same short training job run each
way, side by side.

    distribuuuu bench --compare single,dp,ddp,ddp+amp [--epochs E] [--global-batch B] [--nproc N]
                      [--amp auto|bf16|fp16] [--cfg FILE] [--out DIR] [KEY VALUE ...]

The methods (any subset, always shown in this order):

    single    one process, intra-op threads = all usable cores
    dp        torch.nn.DataParallel: one process driving every visible GPU (DIST.STRATEGY dp);
              needs more than one GPU, else its row says "n/a (needs >1 GPU)" and nothing runs
    ddp       DistributedDataParallel, N processes from the built-in spawner (--nproc; default one
              per GPU, 2 on the CPU), threads = cores // N per process
    ddp+amp   ddp under autocast (TRAIN.AMP): bf16 on the CPU; on a GPU bf16 where it has native
              bf16 (compute capability 8.0+: A100, H100, RTX 30xx on), else fp16 with the
              GradScaler (V100, T4). bf16 keeps fp32's range, so it needs no loss scaling; --amp
              picks one. On a GPU it also runs channels_last (TRAIN.CHANNELS_LAST True, unless
              given), the layout autocast's convolutions are fast in.

Each method is one real `distribuuuu train` in its own subprocess
(runner.py; a fresh interpreter: no thread setting, CUDA context or RNG
state carries over from one method to the next), with the same config,
seed (RNG_SEED, 0 when unset) and GLOBAL batch (--global-batch, default
the config's TRAIN.BATCH_SIZE; each process gets global / processes). So
every method sees the same samples in the same number of optimizer steps
at the same learning rate: strong scaling of one job. The comparison
sets TRAIN.BATCH_SIZE, TRAIN.AMP, DIST.STRATEGY, NUM_THREADS (unless
given), RNG_SEED, OUT_DIR, OPTIM.MAX_EPOCH and TRAIN.AUTO_RESUME for
each run; other KEY VALUE pairs pass through to all of them.

Timing comes from each run's metrics.jsonl (the engine's train records:
time_s, img_per_s, loss). With 2 or more epochs the first is warm-up
(allocator, caches, thread pools) and left out: seconds per epoch is the
mean over the others and img/s = their images / their seconds. Results
go to --out (default OUT_DIR/bench): compare.csv, compare.png, and per
method a run folder and a log.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distribuuuu import config
from distribuuuu.errors import USER_ERROR_EXIT, UserError
from distribuuuu.launch import launcher
from distribuuuu.tools import runner
from distribuuuu.tools.plot import pyplot, read_metrics

METHODS = ("single", "dp", "ddp", "ddp+amp")
AMP_CHOICES = ("auto", "bf16", "fp16")
NEEDS_GPUS = "n/a (needs >1 GPU)"
COLUMNS = [
    "method",
    "status",
    "processes",
    "gpus",
    "threads",
    "batch_per_process",
    "global_batch",
    "amp",
    "epoch_s",
    "img_per_s",
    "speedup",
    "final_loss",
    "val_top1",
    "timed_epochs",
    "run_dir",
]
MEASURED = (
    "processes",
    "threads",
    "epoch_s",
    "img_per_s",
    "speedup",
    "final_loss",
    "val_top1",
    "timed_epochs",
)


@dataclass
class Plan:
    """One method's run: what is started, or why nothing is."""

    method: str
    processes: int  # processes started (dp: 1, driving every GPU)
    threads: int  # intra-op threads per process, unless NUM_THREADS is given
    batch: int  # TRAIN.BATCH_SIZE of each process
    amp: str  # TRAIN.AMP
    strategy: str  # DIST.STRATEGY
    skip: str = ""  # why it is not run ("" = it runs)
    channels_last: bool = (
        False  # TRAIN.CHANNELS_LAST True unless the user's KEY VALUE pairs say otherwise
    )

    @property
    def folder(self) -> str:
        return self.method.replace("+", "_")  # ddp+amp -> ddp_amp: no '+' in paths


def parse_methods(text: str) -> list[str]:
    """'ddp,single' -> ['single', 'ddp'] (the canonical order); anything
    else is a UserError."""
    names = [t.strip() for t in text.split(",")]
    unknown = [n for n in names if n not in METHODS]
    if unknown or not text.strip():
        raise UserError(
            f"--compare takes a comma-separated list of methods from {', '.join(METHODS)}; "
            f"unknown: {', '.join(repr(n) for n in unknown) or repr(text)}"
        )
    if len(set(names)) != len(names):
        raise UserError(
            f"--compare names a method twice: {text!r}; give each of {', '.join(METHODS)} at most "
            "once"
        )
    return [m for m in METHODS if m in names]


def _cores() -> int:
    """Cores this process may use (cgroups, Slurm and taskset
    respected)."""
    return (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )


def _amp_dtype(choice: str, gpus: int) -> str:
    if choice != "auto":
        return choice
    if not gpus:
        return "bf16"  # CPU autocast: bf16 is the type with fast kernels (oneDNN)
    import torch  # here, on a GPU only: the CPU path of the sweep's parent never loads torch

    # Native bf16 from Ampere (8.0) on; older GPUs emulate it slowly, so
    # they get fp16 + GradScaler.
    return "bf16" if torch.cuda.get_device_capability(0) >= (8, 0) else "fp16"


def plan_runs(
    methods: Sequence[str], gpus: int, nproc: int | None, global_batch: int, amp: str, cores: int
) -> list[Plan]:
    """Processes, threads and per-process batch of each method, checked
    before anything starts."""
    n = nproc if nproc is not None else (gpus or 2)
    if n < 1:
        raise UserError(f"--nproc must be at least 1, got {n}")
    if gpus and n > gpus:
        raise UserError(
            f"--nproc {n} asks for more DDP processes than the {gpus} GPU(s); use at most {gpus}, "
            "or DEVICE cpu"
        )
    ddp_methods = [m for m in methods if m.startswith("ddp")]
    if ddp_methods and global_batch % n:
        raise UserError(
            f"the global batch {global_batch} does not split evenly over {n} DDP processes; use "
            f"--global-batch (or TRAIN.BATCH_SIZE) a multiple of {n}"
        )
    plans = []
    for m in methods:
        if m == "single":
            plans.append(Plan(m, 1, cores, global_batch, "off", "ddp"))
        elif m == "dp":
            plans.append(
                Plan(m, 1, cores, global_batch, "off", "dp", "" if gpus > 1 else NEEDS_GPUS)
            )
        else:
            # Autocast on a GPU: channels_last, the layout its
            # tensor-core convolutions want (NCHW made ddp+amp look
            # 1.20x where bench, with channels_last, shows 2.2x). The
            # CPU keeps NCHW.
            amp_run = m == "ddp+amp"
            plans.append(
                Plan(
                    m,
                    n,
                    max(1, cores // n),
                    global_batch // n,
                    _amp_dtype(amp, gpus) if amp_run else "off",
                    "ddp",
                    channels_last=amp_run and gpus > 0,
                )
            )
    return plans


def run_opts(plan: Plan, opts: list[str], run_dir: str, epochs: int, seed: int) -> list[str]:
    """KEY VALUE pairs of one method's run. NUM_THREADS and the layout
    come before the user's pairs (theirs win); what defines the method
    comes after them (ours wins)."""
    layout = ["TRAIN.CHANNELS_LAST", "True"] if plan.channels_last else []
    return [
        "NUM_THREADS",
        str(plan.threads),
        *layout,
        *opts,
        "TRAIN.BATCH_SIZE",
        str(plan.batch),
        "TRAIN.AMP",
        plan.amp,
        "DIST.STRATEGY",
        plan.strategy,
        "RNG_SEED",
        str(seed),
        "OUT_DIR",
        run_dir,
        "OPTIM.MAX_EPOCH",
        str(epochs),
        "TRAIN.AUTO_RESUME",
        "False",
    ]


def train_args(plan: Plan, cfg_file: str | None, keys: list[str]) -> list[str]:
    """`distribuuuu train` arguments of one method (the spawner for more
    than one process)."""
    spawn = ["--nproc-per-node", str(plan.processes)] if plan.processes > 1 else []
    return ["train", *(["--cfg", cfg_file] if cfg_file else []), *spawn, *keys]


def read_run(run_dir: str) -> dict[str, Any]:
    """Timed figures of one finished run: its metrics.jsonl (epoch 1
    left out when there are more) and env.json (the world size and
    threads it really had)."""
    train: dict[int, dict] = {}
    val: dict[int, dict] = {}
    for r in read_metrics(run_dir):
        if isinstance(r.get("epoch"), int) and r.get("split") in ("train", "val"):
            (train if r["split"] == "train" else val)[r["epoch"]] = (
                r  # a repeated epoch: the last wins
            )
    if not train:
        raise RuntimeError(f"{run_dir}/metrics.jsonl holds no training epoch")
    epochs = sorted(train)
    timed = [train[e] for e in (epochs[1:] if len(epochs) > 1 else epochs)]
    seconds = sum(r["time_s"] for r in timed)
    with open(os.path.join(run_dir, "env.json")) as f:
        env = json.load(f)
    loss = train[epochs[-1]]["loss"]
    return {
        "processes": env["world_size"],
        "threads": env["num_threads"],
        "epoch_s": seconds / len(timed),
        "img_per_s": sum(r["n"] for r in timed) / seconds,
        "timed_epochs": len(timed),
        "final_loss": math.nan if loss is None else loss,  # metrics.jsonl writes NaN as null
        "val_top1": val[max(val)]["top1"] if val else None,
    }


def compare_rows(
    plans: Sequence[Plan],
    results: dict[str, dict[str, Any] | str],
    gpus: int,
    run_dirs: dict[str, str],
) -> list[dict[str, Any]]:
    """One row per method: measured figures, or 'n/a' with the reason in
    status."""
    single = results.get("single")
    base = single["img_per_s"] if isinstance(single, dict) else None
    rows = []
    for p in plans:
        res = results.get(p.method, p.skip)
        row: dict[str, Any] = {
            "method": p.method,
            "gpus": gpus if p.method == "dp" else min(gpus, p.processes),
            "batch_per_process": p.batch,
            "global_batch": p.batch * p.processes,
            "amp": p.amp,
            "run_dir": run_dirs.get(p.method, ""),
        }
        if isinstance(res, dict):
            row.update(res, status="ok", speedup=res["img_per_s"] / base if base else "n/a")
        else:
            row.update({k: "n/a" for k in MEASURED}, status=res)
        rows.append(row)
    return rows


def _fmt(value: Any, spec: str) -> str:
    return (
        format(value, spec)
        if isinstance(value, (int, float))
        else ""
        if value is None
        else str(value)
    )


def print_table(rows: Sequence[dict[str, Any]], header: str) -> None:
    print(f"\n{header}")
    print(
        f"{'method':<9}{'procs':>6}{'threads':>8}{'batch/proc':>11}{'amp':>6}{'s/epoch':>9}{'img/s':>9}"
        f"{'speed-up':>9}{'final loss':>11}{'val top-1':>10}  notes"
    )
    for r in rows:
        note = "" if r["status"] == "ok" else r["status"]
        if r["method"] == "dp" and r["status"] == "ok":
            note = f"1 process, DataParallel over {r['gpus']} GPUs"
        speedup = f"{r['speedup']:.2f}x" if isinstance(r["speedup"], float) else r["speedup"]
        print(
            f"{r['method']:<9}{_fmt(r['processes'], 'd'):>6}{_fmt(r['threads'], 'd'):>8}"
            f"{r['batch_per_process']:>11}{r['amp']:>6}{_fmt(r['epoch_s'], '.3f'):>9}"
            f"{_fmt(r['img_per_s'], '.1f'):>9}"
            f"{speedup:>9}{_fmt(r['final_loss'], '.4f'):>11}{_fmt(r['val_top1'], '.2f'):>10}  "
            f"{note}"
        )


def plot_compare(rows: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Bars of img/s (speed-up vs single written in each) and of the
    final training loss."""
    plt = pyplot()
    names = [r["method"] for r in rows]
    ran = [r["status"] == "ok" for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), dpi=90)
    colors = [plt.cm.tab10(i) for i in range(len(rows))]
    for ax, key, label in (
        (ax1, "img_per_s", "images / s (timed epochs)"),
        (ax2, "final_loss", "final train loss"),
    ):
        heights = [r[key] if ok and math.isfinite(r[key]) else 0.0 for r, ok in zip(rows, ran)]
        bars = ax.bar(names, heights, color=colors)
        top = max(heights + [1e-9])
        for bar, r, ok in zip(bars, rows, ran):
            x = bar.get_x() + bar.get_width() / 2
            if not ok:
                ax.text(
                    x, top * 0.02, r["status"], ha="center", va="bottom", rotation=90, fontsize=8
                )
            elif key == "img_per_s" and isinstance(r["speedup"], float):
                ax.text(
                    x,
                    bar.get_height() / 2,
                    f"{r['speedup']:.2f}x",
                    ha="center",
                    va="center",
                    color="white",
                    fontsize=9,
                    fontweight="bold",
                )
            else:
                ax.text(x, bar.get_height(), f"{r[key]:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set(title=label, ylabel=label.split(" (")[0])
        ax.grid(alpha=0.3, axis="y")
    ax1.set_xlabel("method (in the bars: speed-up vs single)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _run_all(
    plans: Sequence[Plan],
    cfg_file: str | None,
    keys: dict[str, list[str]],
    run_dirs: dict[str, str],
    out_dir: str,
) -> tuple[dict[str, dict[str, Any] | str], int]:
    """Run the methods one after the other: their figures (or why they
    failed) and the exit status."""
    results: dict[str, dict[str, Any] | str] = {}
    status = 0
    for p in plans:
        if p.skip:
            print(f"[compare] {p.method}: {p.skip}, not run", flush=True)
            continue
        run_dir, log_path = run_dirs[p.method], os.path.join(out_dir, f"{p.folder}.log")
        shutil.rmtree(run_dir, ignore_errors=True)  # bench's own folder: a fresh run every time
        args = train_args(p, cfg_file, keys[p.method])
        print(f"[compare] {p.method}: distribuuuu {' '.join(args)}  (log: {log_path})", flush=True)
        run = runner.run_train(args, log_path, p.threads)
        if run.status == 0:
            results[p.method] = read_run(run_dir)
        elif (
            run.status == USER_ERROR_EXIT
        ):  # the config or data is wrong for every method alike: stop here
            raise UserError(f"the {p.method} run: {run.error} (log: {log_path})")
        else:  # a crash: show it, keep going, so the other methods still get their rows
            print(run.tail(), file=sys.stderr, flush=True)
            results[p.method] = f"failed (exit {run.status}; log: {log_path})"
            status = status or run.status
    return results, status


def run_compare(
    cfg_file: str | None,
    opts: list[str],
    methods_text: str,
    epochs: int,
    out_dir: str | None,
    nproc: int | None,
    global_batch: int | None,
    amp: str,
) -> int:
    """Run each method, print the table, write compare.csv and
    compare.png; the exit status (0, or the first failing run's)."""
    methods = parse_methods(methods_text)
    if epochs < 1:
        raise UserError(f"--epochs must be at least 1, got {epochs}")
    if amp not in AMP_CHOICES:
        raise UserError(f"--amp must be one of {', '.join(AMP_CHOICES)}, got {amp!r}")
    if launcher.detect().launcher != "plain":
        raise UserError(
            "`distribuuuu bench --compare` starts its own processes; run it without a launcher"
        )
    cfg = config.load_config(cfg_file, opts)
    out_dir = out_dir or os.path.join(cfg.OUT_DIR, "bench")
    batch = cfg.TRAIN.BATCH_SIZE if global_batch is None else global_batch
    if batch < 1:
        raise UserError(f"--global-batch must be at least 1, got {batch}")
    gpus = runner.visible_gpus(cfg)
    plans = plan_runs(methods, gpus, nproc, batch, amp, _cores())
    seed = cfg.RNG_SEED if cfg.RNG_SEED is not None else 0
    run_dirs = {p.method: os.path.join(out_dir, p.folder) for p in plans if not p.skip}
    keys = {
        p.method: run_opts(p, opts, run_dirs[p.method], epochs, seed) for p in plans if not p.skip
    }
    for k in keys.values():  # every run's config is valid before the first one starts
        config.load_config(cfg_file, k)

    os.makedirs(out_dir, exist_ok=True)
    load_start = os.getloadavg()[0]
    results, status = _run_all(plans, cfg_file, keys, run_dirs, out_dir)
    load_end = os.getloadavg()[0]
    rows = compare_rows(plans, results, gpus, run_dirs)
    device = runner.device_label(gpus)  # after the runs: this may create a CUDA context
    timed = (
        "epoch 1 of 1 timed (includes warm-up; use --epochs 2 or more)"
        if epochs == 1
        else f"{f'epoch {epochs}' if epochs == 2 else f'epochs 2-{epochs}'} of {epochs} timed "
        "(epoch 1 is warm-up)"
    )
    print_table(
        rows,
        f"compare: {cfg.MODEL.ARCH} on {cfg.TRAIN.DATASET} | {device} | global batch {batch} (per "
        f"process: {batch} / processes) | {timed} | load average {load_start:.2f} -> "
        f"{load_end:.2f}",
    )
    csv_path, png_path = os.path.join(out_dir, "compare.csv"), os.path.join(out_dir, "compare.png")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    plot_compare(
        rows,
        png_path,
        f"{cfg.MODEL.ARCH} on {cfg.TRAIN.DATASET}, {device}, global batch {batch}, {timed}",
    )
    print(f"wrote {csv_path}, {png_path}")
    return status

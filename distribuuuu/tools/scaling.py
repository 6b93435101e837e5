"""`distribuuuu bench --scaling`: the same short training run with 1, 2,
4 ... processes.

    distribuuuu bench --scaling 1,2,4 [--epochs E] [--cfg FILE] [--out DIR] [KEY VALUE ...]

(d) of `distribuuuu bench` (bench.py has (a)-(c)): the same short
    training run (E epochs, default
1) with each number of processes, started by the built-in spawner in a
   child process
(runner.py); a table, scaling.csv and scaling.png. TRAIN.BATCH_SIZE is
per process, so an epoch of the same data takes 1/N of the steps (weak
scaling of the batch). The figures are those of the last epoch in each
run's metrics.jsonl. Results go to --out (default OUT_DIR/bench):
scaling.csv, scaling.png, and per count a run folder pN and its log
pN.log.
"""

from __future__ import annotations

import csv
import os
import shutil
import sys
from collections.abc import Sequence
from typing import Any

from distribuuuu import config
from distribuuuu.errors import UserError
from distribuuuu.tools import runner
from distribuuuu.tools.plot import pyplot, read_metrics

COLUMNS = [
    "processes",
    "img_per_s",
    "img_per_s_per_process",
    "efficiency",
    "epoch_s",
    "data_frac",
    "global_batch",
]


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


def last_train_record(run_dir: str) -> dict[str, Any]:
    """The last training epoch's record in run_dir/metrics.jsonl."""
    train = [
        r
        for r in read_metrics(run_dir)
        if r.get("split") == "train" and isinstance(r.get("epoch"), int)
    ]
    if not train:
        raise RuntimeError(f"{run_dir}/metrics.jsonl holds no training epoch")
    return train[-1]


def scaling_rows(records: Sequence[tuple[int, dict[str, Any]]], batch: int) -> list[dict[str, Any]]:
    """The table from (processes, last train record) pairs; efficiency
    is per-process img/s relative to the smallest process count (1.0 =
    linear scaling)."""
    base_n, base = records[0]
    per_base = base["img_per_s"] / base_n
    return [
        {
            "processes": n,
            "img_per_s": r["img_per_s"],
            "img_per_s_per_process": r["img_per_s"] / n,
            "efficiency": (r["img_per_s"] / n) / per_base,
            "epoch_s": r["time_s"],
            "data_frac": r.get("data_frac"),
            "global_batch": batch * n,
        }
        for n, r in records
    ]


def print_table(rows: Sequence[dict[str, Any]], header: str) -> None:
    print(f"\n{header}")
    print(
        f"{'processes':>9} {'img/s':>10} {'img/s/proc':>11} {'efficiency':>11} {'epoch s':>9} "
        f"{'data wait':>10}"
    )
    for r in rows:
        wait = "" if r["data_frac"] is None else f"{100 * r['data_frac']:.1f}%"
        print(
            f"{r['processes']:>9} {r['img_per_s']:>10.1f} {r['img_per_s_per_process']:>11.1f} "
            f"{r['efficiency']:>10.0%} {r['epoch_s']:>9.2f} {wait:>10}"
        )


def plot_scaling(rows: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Throughput and epoch time against the number of processes, each
    with its ideal (linear) line."""
    plt = pyplot()
    procs = [r["processes"] for r in rows]
    x = [str(p) for p in procs]
    n0, r0 = procs[0], rows[0]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), dpi=90)
    bars = ax1.bar(x, [r["img_per_s"] for r in rows], color="tab:blue", label="measured")
    ax1.plot(
        x, [r0["img_per_s"] * p / n0 for p in procs], "k--", marker="o", label="ideal (linear)"
    )
    for bar, r in zip(bars, rows):
        ax1.text(
            bar.get_x() + bar.get_width() / 2,
            bar.get_height() / 2,
            f"{r['efficiency']:.0%}",
            ha="center",
            va="center",
            color="white",
            fontsize=9,
            fontweight="bold",
        )
    ax1.set(
        title="throughput (in the bars: scaling efficiency)",
        xlabel="processes",
        ylabel="images / s",
    )
    ax2.plot(x, [r["epoch_s"] for r in rows], color="tab:orange", marker="o", label="measured")
    ax2.plot(
        x, [r0["epoch_s"] * n0 / p for p in procs], "k--", marker="o", label="ideal (1 / processes)"
    )
    ax2.set(title="training time of one epoch", xlabel="processes", ylabel="seconds")
    ax2.set_ylim(bottom=0)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _run_counts(
    cfg_file: str | None, opts: list[str], counts: list[int], epochs: int, out_dir: str
) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """Train with each process count in turn: (count, last train record)
    pairs, and the exit status of the first run that failed (0 if none;
    the sweep stops there)."""
    records = []
    for n in counts:
        run_dir = os.path.join(out_dir, f"p{n}")
        shutil.rmtree(run_dir, ignore_errors=True)  # bench's own folder: a fresh run every time
        args = [
            "train",
            *(["--cfg", cfg_file] if cfg_file else []),
            "--nproc-per-node",
            str(n),
            *opts,
            "OUT_DIR",
            run_dir,
            "OPTIM.MAX_EPOCH",
            str(epochs),
            "TRAIN.AUTO_RESUME",
            "False",
        ]
        log_path = os.path.join(out_dir, f"p{n}.log")
        print(
            f"[bench] {n} process(es): distribuuuu {' '.join(args)}  (log: {log_path})", flush=True
        )
        result = runner.run_train(args, log_path)
        if result.status != 0:
            print(result.tail(), file=sys.stderr)
            print(
                f"error: the run with {n} process(es) exited with status {result.status} (log: "
                f"{log_path})",
                file=sys.stderr,
                flush=True,
            )
            return records, result.status
        records.append((n, last_train_record(run_dir)))
    return records, 0


def run_scaling(
    cfg_file: str | None, opts: list[str], counts: list[int], epochs: int, out_dir: str
) -> int:
    """Train for `epochs` with each process count; print the table,
    write scaling.csv / scaling.png."""
    if epochs < 1:
        raise UserError(f"--epochs must be at least 1, got {epochs}")
    cfg = config.load_config(
        cfg_file, opts + ["OPTIM.MAX_EPOCH", str(epochs)]
    )  # bad keys fail here, once
    gpus = runner.visible_gpus(cfg)
    if gpus and counts[-1] > gpus:
        raise UserError(
            f"--scaling asks for {counts[-1]} processes but there are {gpus} GPU(s); use counts up "
            f"to {gpus}, or DEVICE cpu"
        )
    os.makedirs(out_dir, exist_ok=True)
    records, status = _run_counts(cfg_file, opts, counts, epochs, out_dir)
    if status != 0:
        return status
    rows = scaling_rows(records, cfg.TRAIN.BATCH_SIZE)
    device = runner.device_label(gpus)  # after the runs: this may create a CUDA context
    print_table(
        rows,
        f"scaling: {cfg.MODEL.ARCH} | batch {cfg.TRAIN.BATCH_SIZE} per process | {device} | epoch "
        f"{epochs} of {epochs} on {cfg.TRAIN.DATASET}",
    )
    csv_path, png_path = os.path.join(out_dir, "scaling.csv"), os.path.join(out_dir, "scaling.png")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    plot_scaling(
        rows,
        png_path,
        f"{cfg.MODEL.ARCH} on {cfg.TRAIN.DATASET}, batch {cfg.TRAIN.BATCH_SIZE} per process, "
        f"{device} (epoch {epochs} of {epochs} timed)",
    )
    print(f"wrote {csv_path}, {png_path}")
    return 0


def main(
    cfg_file: str | None, opts: list[str], counts_text: str, epochs: int, out: str | None
) -> int:
    """`distribuuuu bench --scaling LIST`: the list and the config are
    checked before any run starts."""
    counts = parse_counts(counts_text)
    cfg = config.load_config(cfg_file, opts)
    return run_scaling(cfg_file, opts, counts, epochs, out or os.path.join(cfg.OUT_DIR, "bench"))

"""Learning curves of runs, from their metrics.jsonl (the sweeps draw
their own figures with pyplot()).

    distribuuuu plot RUN_DIR [RUN_DIR ...] [--out DIR]

writes learning_curves.png (top-1, top-k, loss and LR against the epoch;
train dashed, val solid, one colour per run) and one PNG per panel
(top1.png, topk.png, loss.png, lr.png) into --out (default:
RUN_DIR/plots for one run, ./plots for several); and for each run folder
holding confusion.csv (the best checkpoint's), confusion.png
(confusion_<run>.png for several runs).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from typing import Any

from distribuuuu.errors import UserError
from distribuuuu.files import output_problem
from distribuuuu.run_folder.metrics_files import METRICS, read_jsonl

Series = tuple[list[int], list[float]]
# (file name, panel title, the series of it: (split, key)), in the order
# of the combined figure.
PANELS = [
    ("top1", "top-1 accuracy (%)", [("train", "top1"), ("val", "top1")]),
    ("topk", "top-{k} accuracy (%)", [("train", "topk_acc"), ("val", "topk_acc")]),
    ("loss", "loss", [("train", "loss"), ("val", "loss")]),
    ("lr", "learning rate (end of epoch)", [("train", "lr")]),
]


def pyplot() -> Any:
    """matplotlib.pyplot with the file-only Agg backend. matplotlib is
    imported here, not at the top: it takes a second to import and only
    the drawing functions need it."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The records of RUN_DIR/metrics.jsonl; a missing folder or file is
    a UserError, a line that is not JSON (torn by a kill) is skipped
    with a warning naming the file and the line."""
    if not os.path.isdir(run_dir):
        raise UserError(
            f"run folder {run_dir!r} does not exist; give the OUT_DIR of a training run"
        )
    path = os.path.join(run_dir, METRICS)
    if not os.path.isfile(path):
        raise UserError(
            f"{run_dir!r} has no metrics.jsonl; give the OUT_DIR of a training run (it is written "
            "after the first epoch)"
        )
    return read_jsonl(path)


def run_curves(run_dir: str) -> dict[str, Any]:
    """{"train_top1": (epochs, values), "val_loss": ..., "train_lr":
    ..., "topk": k} of one run.

    Only epoch records count (an `eval` line has epoch null). A resumed
    run may have written an epoch twice (a crash after the metrics line,
    before the checkpoint): the last line wins.
    """
    by_split: dict[str, dict[int, dict]] = {"train": {}, "val": {}}
    topk = None
    for r in read_metrics(run_dir):
        if isinstance(r.get("epoch"), int) and r.get("split") in by_split:
            by_split[r["split"]][r["epoch"]] = r
            topk = r.get("topk", topk)
    if not by_split["train"] and not by_split["val"]:
        raise UserError(
            f"{os.path.join(run_dir, 'metrics.jsonl')} holds no epoch records yet; plot a run that "
            "finished at least one epoch"
        )
    curves: dict[str, Any] = {"topk": topk or 5}
    for _, _, keys in PANELS:
        for split, key in keys:
            epochs = sorted(e for e, r in by_split[split].items() if r.get(key) is not None)
            curves[f"{split}_{key}"] = (epochs, [float(by_split[split][e][key]) for e in epochs])
    return curves


def _labels(run_dirs: Sequence[str]) -> list[str]:
    """Folder names, or the full paths when two runs share a folder
    name."""
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    return names if len(set(names)) == len(names) else [os.path.normpath(d) for d in run_dirs]


def _draw(ax: Any, panel: tuple, runs: dict[str, dict], colors: list[str]) -> dict[str, Series]:
    """One panel; returns what was drawn: {"<run> <split>": (epochs,
    values)} read back from the lines."""
    name, title, keys = panel
    ks = {c["topk"] for c in runs.values()}
    ax.set_title(title.format(k=ks.pop() if len(ks) == 1 else "k"))
    for (label, curves), color in zip(runs.items(), colors):
        for split, key in keys:
            epochs, values = curves[f"{split}_{key}"]
            if epochs:
                ax.plot(
                    epochs,
                    values,
                    color=color,
                    linestyle="--" if split == "train" else "-",
                    marker="." if len(epochs) < 30 else None,
                    label=f"{label} {split}",
                )
    ax.set_xlabel("epoch")
    if name == "lr":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if name == "loss" and all(v > 0 for line in ax.get_lines() for v in line.get_ydata()):
        ax.set_yscale("log")  # the first epochs would flatten the rest of the curve
        ax.set_title(title + " (log scale)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, handlelength=3)
    return {
        line.get_label(): ([int(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()])
        for line in ax.get_lines()
        if not line.get_label().startswith("_")
    }


def plot_runs(run_dirs: Sequence[str], out_dir: str) -> dict[str, Any]:
    """Write the learning-curve PNGs of one or more runs.

    Returns {"files": [...], "series": {run: curves}, "drawn": {panel:
    {"<run> <split>": (x, y)}}}, "drawn" being read back from the lines
    of the combined figure.
    """
    if not run_dirs:
        raise UserError("give at least one run folder (OUT_DIR of a training run)")
    runs = dict(zip(_labels(run_dirs), (run_curves(d) for d in run_dirs)))
    plt = pyplot()
    colors = [plt.cm.tab10(i % 10) for i in range(len(runs))]
    os.makedirs(out_dir, exist_ok=True)
    files, drawn = [], {}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), dpi=90)
    for ax, panel in zip(axes.flat, PANELS):
        drawn[panel[0]] = _draw(ax, panel, runs, colors)
    fig.suptitle("learning curves: " + ", ".join(runs) + "  (train dashed, val solid)", fontsize=10)
    fig.tight_layout()
    files.append(os.path.join(out_dir, "learning_curves.png"))
    fig.savefig(files[-1])
    plt.close(fig)
    for panel in PANELS:
        fig, ax = plt.subplots(figsize=(6, 4), dpi=90)
        _draw(ax, panel, runs, colors)
        fig.tight_layout()
        files.append(os.path.join(out_dir, f"{panel[0]}.png"))
        fig.savefig(files[-1])
        plt.close(fig)
    for label, run_dir in zip(runs, run_dirs):
        if os.path.isfile(os.path.join(run_dir, "confusion.csv")):
            name = (
                "confusion.png"
                if len(run_dirs) == 1
                else f"confusion_{label.replace(os.sep, '_')}.png"
            )
            files.append(
                draw_confusion(
                    os.path.join(run_dir, "confusion.csv"), os.path.join(out_dir, name), label
                )
            )
    return {"files": files, "series": runs, "drawn": drawn}


def draw_confusion(csv_path: str, png_path: str, title: str) -> str:
    """confusion.csv as a picture: each true class's row as shares of
    its samples (the diagonal is its top-1), with the counts written in
    the cells when the classes are few."""
    with open(csv_path, newline="") as f:
        header, *rows = list(csv.reader(f))
    classes, counts = header[1:], [[int(c) for c in row[1:]] for row in rows]
    shares = [[c / max(sum(row), 1) for c in row] for row in counts]
    plt = pyplot()
    side = min(4 + 0.35 * len(classes), 20)
    fig, ax = plt.subplots(figsize=(side, side * 0.85), dpi=90)
    image = ax.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    fig.colorbar(image, ax=ax, fraction=0.046, label="share of the true class's samples")
    if len(classes) <= 30:
        ax.set_xticks(range(len(classes)), classes, rotation=90, fontsize=7)
        ax.set_yticks(range(len(classes)), classes, fontsize=7)
        for i, row in enumerate(counts):
            for j, c in enumerate(row):
                if c:
                    ax.text(
                        j,
                        i,
                        str(c),
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="white" if shares[i][j] > 0.5 else "black",
                    )
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"confusion of the best checkpoint: {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return png_path


def main(run_dirs: Sequence[str], out_dir: str | None) -> int:
    """`distribuuuu plot`: every folder is read (and checked) before any
    file is written."""
    out = out_dir or (os.path.join(run_dirs[0], "plots") if len(run_dirs) == 1 else "plots")
    if problem := output_problem(out, folder=True):
        raise UserError(f"--out {problem}")
    result = plot_runs(run_dirs, out)
    print("wrote " + ", ".join(result["files"]))
    return 0

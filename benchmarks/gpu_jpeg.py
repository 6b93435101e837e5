"""benchmarks/gpu.py's end-to-end JPEG job (issue #26): can the CPU feed ResNet-50 on a GPU?

ImageNet-like JPEGs are generated (500x375 and 375x500, quality 90, about 90 KB each), written once
more as shards (`distribuuuu data shard`), and `distribuuuu bench` trains ResNet-50 at 224 px (bf16,
channels_last, batch 256) from each: its "model" part is the same model on a synthetic batch already
on the GPU (the ceiling), its "full training step" part trains from the loader with as many workers as
the cores allow (cores - 1: one is the main process's, which launches the GPU work) and measures the
share of step time spent waiting for data. Target: at least 0.9 of synthetic with 16 cores; when the
CPU cannot feed the GPU the result says by how much (the next step, GPU decoding: docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

PY = sys.executable
D = [PY, "-m", "distribuuuu"]
TARGET = 0.9  # of the synthetic img/s


def workers(a: argparse.Namespace) -> int:
    return 1 if a.small else max(1, len(os.sched_getaffinity(0)) - 1)


def _figures(bench_json: str) -> dict[str, Any]:
    with open(bench_json) as f:
        b = json.load(f)
    synthetic, real = b["model"]["train_img_per_s"], b["step"]["img_per_s"]
    return {"synthetic_img_per_s": round(synthetic), "img_per_s": round(real), "ratio": round(real / synthetic, 3),
            "data_wait_share": round(b["step"]["data_frac"], 3),
            "loader_alone_img_per_s": round(b["data"]["img_per_s"])}


def verdict(name: str, fig: dict[str, Any]) -> str:
    """One line: the target met, or by how much it is missed and how much faster the input must be."""
    if fig["ratio"] >= TARGET:
        return f"{name}: {fig['ratio']:.2f} of synthetic, target {TARGET} met"
    short, wait = f"{name}: {fig['ratio']:.2f} of synthetic, {TARGET - fig['ratio']:.2f} short of {TARGET}", \
        100 * fig["data_wait_share"]
    if fig["data_wait_share"] < 0.05:  # the loader is not what the steps wait for
        return f"{short}, but waiting for data only {wait:.0f}% of the step time: the workers' CPU load slows the steps"
    need = TARGET * fig["synthetic_img_per_s"] / max(fig["img_per_s"], 1)
    return f"{short}: the input must be {need:.2f}x faster (waiting for data {wait:.0f}% of the step time)"


def parse_jpeg_e2e(n_workers: int) -> Callable[[Any], dict]:
    def parse(job: Any) -> dict:
        figs = {src: _figures(os.path.join(job.out, f"bench_{src}", "bench.json")) for src in ("folder", "shards")}
        lines = [verdict(src, f) for src, f in figs.items()]
        for line in lines:
            print(f"[jpeg_e2e] {line}", flush=True)
        return {"verdict": lines, "target_met": all(f["ratio"] >= TARGET for f in figs.values()), **figs,
                "workers": n_workers, "cores": len(os.sched_getaffinity(0))}
    return parse


def jpeg_jobs(a: argparse.Namespace, job: Callable[..., Any]) -> list[Any]:
    """The jpeg_e2e job; ``job`` is gpu.py's Job class. A speed job: alone on the GPU."""
    n, side, size, batch, arch, classes = (("48", "64", "32", "16", "resnet18", "10") if a.small else
                                           ("7000", "500", "224", "256", "resnet50", "100"))
    it = ["--iters", "3", "--warmup", "1"] if a.small else ["--iters", "20", "--warmup", "5"]  # 25 x 256 < 7000
    w = workers(a)

    def bench(src: str, dataset: str) -> list[str]:
        return D + ["bench", *it, "--out", f"{{out}}/bench_{src}", "MODEL.ARCH", arch, "MODEL.NUM_CLASSES", classes,
                    "TRAIN.DATASET", dataset, "TEST.DATASET", dataset, "TEST.SPLIT", "train",
                    "TRAIN.DATA_PIPELINE", "loader", "TRAIN.WORKERS", str(w), "TRAIN.IM_SIZE", size,
                    "TEST.IM_SIZE", size, "TRAIN.BATCH_SIZE", batch, "TRAIN.AMP", "bf16",
                    "TRAIN.CHANNELS_LAST", "True", "DEVICE", a.device, "RNG_SEED", "0", "OUT_DIR", "{out}/run"]

    return [job("jpeg_e2e", "speed", [
        [PY, "benchmarks/io_jpegs.py", "{out}/jpegs", "--n", n, "--side", side, "--classes", classes,
         "--procs", "2" if a.small else "0"],
        D + ["data", "shard", "{out}/jpegs", "{out}/shards", "--shard-size", "64MB"],
        bench("folder", "{out}/jpegs"),
        bench("shards", "{out}/shards")], 540, parse_jpeg_e2e(w))]

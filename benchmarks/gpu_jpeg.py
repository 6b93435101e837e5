"""benchmarks/gpu.py's JPEG jobs (issues #26, #38): can the CPU feed ResNet-50 on a GPU, and does decoding on
the GPU (TRAIN.IMAGE_DECODE gpu) close the gap?

jpeg_e2e: ImageNet-like JPEGs are generated (500x375 and 375x500, quality 90, about 90 KB each), written
once more as shards (`distribuuuu data shard`), and `distribuuuu bench` trains ResNet-50 at 224 px (bf16,
channels_last, batch 256) from each with TRAIN.IMAGE_DECODE fast and gpu: its "model" part is the same
model on a synthetic batch already on the GPU (the ceiling), its "full training step" part trains from the
loader with as many workers as the cores allow (cores - 1: one is the main process's, which launches the
GPU work and, with gpu, decodes) and measures the share of step time spent waiting for data. Target: at
least 0.9 of synthetic with 16 cores; when it is missed the result says by how much.

jpeg_decode: this file as a script, one table of decode rates (docs/performance.md, 6b):

    python benchmarks/gpu_jpeg.py DIR [--device cuda|cpu] [--n 512] [--batch 128] [--out decode.json]

on DIR/train/*/*.jpg (benchmarks/io_jpegs.py writes them): per core, the fast path in a loader worker and
the gpu path's worker half; then the gpu path's device half (decode_jpeg of whole batches, crop, resize,
normalize) on the device; on CUDA also how far nvJPEG's pixels are from libjpeg-turbo's (the CPU device).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

PY = sys.executable
D = [PY, "-m", "distribuuuu"]
TARGET = 0.9  # of the synthetic img/s
SOURCES = ("folder", "shards")
DECODES = ("fast", "gpu")


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
        figs = {f"{src} {decode}": _figures(os.path.join(job.out, f"bench_{src}_{decode}", "bench.json"))
                for src in SOURCES for decode in DECODES}
        lines = [verdict(name, f) for name, f in figs.items()]
        for line in lines:
            print(f"[jpeg_e2e] {line}", flush=True)
        return {"verdict": lines, "target_met": {name: f["ratio"] >= TARGET for name, f in figs.items()}, **figs,
                "workers": n_workers, "cores": len(os.sched_getaffinity(0))}
    return parse


def parse_jpeg_decode(job: Any) -> dict:
    with open(os.path.join(job.out, "decode.json")) as f:
        return json.load(f)


def jpeg_jobs(a: argparse.Namespace, job: Callable[..., Any]) -> list[Any]:
    """The jpeg_e2e and jpeg_decode jobs; ``job`` is gpu.py's Job class. Speed jobs: alone on the GPU."""
    n, side, size, batch, arch, classes = (("48", "64", "32", "16", "resnet18", "10") if a.small else
                                           ("7000", "500", "224", "256", "resnet50", "100"))
    it = ["--iters", "3", "--warmup", "1"] if a.small else ["--iters", "20", "--warmup", "5"]  # 25 x 256 < 7000
    w = workers(a)

    def bench(src: str, dataset: str, decode: str) -> list[str]:
        return D + ["bench", *it, "--out", f"{{out}}/bench_{src}_{decode}", "MODEL.ARCH", arch, "MODEL.NUM_CLASSES",
                    classes, "TRAIN.DATASET", dataset, "TEST.DATASET", dataset, "TEST.SPLIT", "train",
                    "TRAIN.DATA_PIPELINE", "loader", "TRAIN.IMAGE_DECODE", decode, "TRAIN.WORKERS", str(w),
                    "TRAIN.IM_SIZE", size, "TEST.IM_SIZE", size, "TRAIN.BATCH_SIZE", batch, "TRAIN.AMP", "bf16",
                    "TRAIN.CHANNELS_LAST", "True", "DEVICE", a.device, "RNG_SEED", "0", "OUT_DIR", "{out}/run"]

    def jpegs(count: str) -> list[str]:
        return [PY, "benchmarks/io_jpegs.py", "{out}/jpegs", "--n", count, "--side", side, "--classes", classes,
                "--procs", "2" if a.small else "0"]

    return [
        job("jpeg_e2e", "speed", [jpegs(n), D + ["data", "shard", "{out}/jpegs", "{out}/shards", "--shard-size", "64MB"],
                                  *(bench(src, f"{{out}}/{'jpegs' if src == 'folder' else 'shards'}", decode)
                                    for src in SOURCES for decode in DECODES)], 900, parse_jpeg_e2e(w)),
        job("jpeg_decode", "speed", [jpegs("48" if a.small else "1024"),
                                     [PY, "benchmarks/gpu_jpeg.py", "{out}/jpegs", "--device", a.device, "--size", size,
                                      "--n", "48" if a.small else "1024", "--batch", "8" if a.small else "128",
                                      "--out", "{out}/decode.json"]], 300, parse_jpeg_decode),
    ]


# ---------------------------------------------------------------------------------------------
# jpeg_decode: the decode rates, one table
# ---------------------------------------------------------------------------------------------
def decode_rates(root: str, device_name: str, n: int, batch: int, size: int) -> dict[str, Any]:
    """{row: figure} of the table (module docstring); every CPU figure on one thread, as a loader worker, in
    images per CPU-second of that thread (unmoved by other processes on the cores); the GPU's by the clock."""
    import torch

    from distribuuuu.data.decoding.cpu import FastTrainDecode
    from distribuuuu.data.decoding.device import DecodedBatches, DeviceDecode, encoded_images
    from distribuuuu.data.loading.batches import NormalizedBatches
    from distribuuuu.data.transforms import IMAGENET_STATS

    torch.set_num_threads(1)
    raw = [open(path, "rb").read() for path in sorted(glob.glob(os.path.join(root, "train", "*", "*.jpg")))[:n]]
    fast = FastTrainDecode(size, "RGB")
    halves = DeviceDecode(fast)

    def per_core(decode: Callable[[bytes], Any]) -> tuple[float, list]:  # images per CPU-second of this thread
        torch.manual_seed(0)
        start = time.thread_time()
        made = [decode(data) for data in raw]
        return len(raw) / (time.thread_time() - start), made

    fast_rate, _ = per_core(fast)
    worker_rate, items = per_core(halves)
    batches = [(encoded_images(items[i:i + batch]), torch.zeros(batch, dtype=torch.int64))
               for i in range(0, len(items) - batch + 1, batch)]

    def device_half(device: torch.device) -> tuple[float, torch.Tensor]:  # on the CPU: per CPU-second, as above
        clock = time.perf_counter if device.type == "cuda" else time.thread_time
        made = []
        start = clock()
        for images, _ in DecodedBatches(NormalizedBatches(batches, IMAGENET_STATS, device), halves, _fail):
            made.append(images)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return len(batches) * batch / (clock() - start), torch.cat(made).cpu()

    device = torch.device(device_name)
    device_half(device)  # warm-up: nvJPEG's handle, the kernels' first launches
    device_rate, got = device_half(device)
    res: dict[str, Any] = {
        "images": len(raw), "size": size, "batch": batch, "device": device_name,
        "fast_img_per_s_per_core": round(fast_rate), "gpu_worker_half_img_per_s_per_core": round(worker_rate),
        f"gpu_device_half_img_per_s_on_{device.type}": round(device_rate),
        "encoded_kb_per_image": round(sum(len(d) for d in raw) / len(raw) / 1024, 1),
        "decoded_on_the_device": sum(item[0].dim() == 1 for item in items)}
    if device.type == "cuda":  # nvJPEG's pixels against libjpeg-turbo's, in 0-255
        std = torch.tensor(IMAGENET_STATS[1]).view(1, -1, 1, 1) * 255
        diff = ((got - device_half(torch.device("cpu"))[1]) * std).abs()
        res.update(nvjpeg_vs_cpu_max=round(diff.max().item(), 2), nvjpeg_vs_cpu_mean=round(diff.mean().item(), 3))
    return res


def _fail(index: int, error: Exception) -> None:
    raise error  # a generated JPEG that neither decoder reads: the benchmark is wrong


LABELS = {
    "fast_img_per_s_per_core": "TRAIN.IMAGE_DECODE fast, a loader worker: read, decode, crop, resize (img/CPU-s)",
    "gpu_worker_half_img_per_s_per_core": "TRAIN.IMAGE_DECODE gpu, a loader worker: read, header, crop drawn (img/CPU-s)",
    "gpu_device_half_img_per_s": "TRAIN.IMAGE_DECODE gpu, the main process: decode_jpeg(list), crop, resize (img/s; CPU: /CPU-s)",
    "decoded_on_the_device": "of which the device decoded (the others: the worker, on the fast path)",
    "nvjpeg_vs_cpu_max": "nvJPEG's pixels vs libjpeg-turbo's after crop and resize: largest |difference|",
    "nvjpeg_vs_cpu_mean": "nvJPEG's pixels vs libjpeg-turbo's after crop and resize: mean |difference|",
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", help="a folder with train/<class>/*.jpg (benchmarks/io_jpegs.py)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--n", type=int, default=512, help="images timed")
    p.add_argument("--batch", type=int, default=128, help="images per decode_jpeg call")
    p.add_argument("--size", type=int, default=224, help="the training crop's side")
    p.add_argument("--out", default="", help="also write the figures here (JSON)")
    a = p.parse_args()
    res = decode_rates(a.root, a.device, a.n, a.batch, a.size)
    for key, value in res.items():
        print(f"{LABELS.get(key.removesuffix('_on_' + a.device), key):84s} {value!s:>8s}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()

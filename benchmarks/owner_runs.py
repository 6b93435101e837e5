"""The owner's runs of issue #47: image sets nobody tuned for, trained
with the installed command and nothing but TRAIN.DATASET, as a user
would, from a folder outside the repository.

    .venv/bin/python benchmarks/owner_runs.py                 # all sets (10-20 minutes on 2 cores)
    .venv/bin/python benchmarks/owner_runs.py --sets digits --seeds 1,2,3

The sets are made here from images that packages ship (scikit-image's
photos and textures, scikit-learn's digits), never downloaded:
  photos    600 RGB 96 px JPEG crops of four photos (astronaut, coffee,
            chelsea, rocket), one folder of class folders, no split
  textures  gray 64 px PNG patches of brick, grass and gravel, in
            train/ (100 per class) and val/ (20 per class)
  digits    8x8 digits with a 10:1 imbalance (classes 5-9 keep a tenth
            of their images) in one folder, and a balanced test folder
            (15 per class) the run never sees
Each run: `distribuuuu train TRAIN.DATASET SET --nproc-per-node N`
(RNG_SEED for the digits' seeds), then `distribuuuu eval` of best.pth
and last.pth on the test folder where there is one. The table gives the
epochs the run chose and ran, the whole command's wall time, the best
val top-1 and the test top-1 of both checkpoints. The machine's load
is printed: the times mean little without it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = os.path.join(ROOT, ".venv", "bin", "distribuuuu")


def photos(dest: str, per_class: int = 150, size: int = 96) -> str:
    """Crops of 120-250 px at random places of four photos, resized to
    size px, mirrored at random: classes told apart by what they show."""
    import skimage.data

    rng = np.random.default_rng(0)
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        image = Image.fromarray(getattr(skimage.data, name)())
        os.makedirs(os.path.join(dest, name))
        for i in range(per_class):
            side = int(rng.integers(120, min(250, *image.size) + 1))
            x = int(rng.integers(0, image.width - side + 1))
            y = int(rng.integers(0, image.height - side + 1))
            crop = image.crop((x, y, x + side, y + side)).resize((size, size), Image.BILINEAR)
            if rng.random() < 0.5:
                crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
            crop.save(os.path.join(dest, name, f"{i:04d}.jpg"), quality=90)
    return dest


def textures(dest: str, size: int = 64) -> str:
    """Gray patches of three textures: train/ 100 and val/ 20 per class,
    the val patches from the image's bottom quarter only."""
    import skimage.data

    rng = np.random.default_rng(1)
    for name in ("brick", "grass", "gravel"):
        image = getattr(skimage.data, name)()
        for split, n, rows in (("train", 100, (0, 384 - size)), ("val", 20, (384, 512 - size))):
            os.makedirs(os.path.join(dest, split, name))
            for i in range(n):
                y = int(rng.integers(rows[0], rows[1] + 1))
                x = int(rng.integers(0, image.shape[1] - size + 1))
                patch = Image.fromarray(image[y : y + size, x : x + size])
                patch.save(os.path.join(dest, split, name, f"{i:04d}.png"))
    return dest


def digits(dest: str, test_per_class: int = 15) -> tuple[str, str]:
    """scikit-learn's 1,797 digits as 8x8 PNGs: a balanced test folder
    (test_per_class of each digit) and a training folder where digits
    5-9 keep a tenth of the rest."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    images = (images.reshape(-1, 8, 8) * (255 / 16)).astype(np.uint8)
    rng = np.random.default_rng(2)
    train, test = os.path.join(dest, "train"), os.path.join(dest, "test")
    for digit in range(10):
        mine = rng.permutation(np.flatnonzero(labels == digit))
        kept = mine[test_per_class:]
        if digit >= 5:
            kept = kept[: len(kept) // 10]
        for folder, idx in ((test, mine[:test_per_class]), (train, kept)):
            os.makedirs(os.path.join(folder, str(digit)), exist_ok=True)
            for i in idx:
                Image.fromarray(images[i]).save(os.path.join(folder, str(digit), f"{i:04d}.png"))
    return train, test


def run(args: list[str], cwd: str) -> tuple[str, float]:
    """The command's output and wall time; exits on a failure."""
    start = time.perf_counter()
    proc = subprocess.run([COMMAND, *args], cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr, wall


def test_top1(run_dir: str, checkpoint: str, test: str, cwd: str) -> float:
    out, _ = run(["eval", "--checkpoint", os.path.join(run_dir, "checkpoints", checkpoint),
                  "TEST.DATASET", test, "TEST.SPLIT", ""], cwd)
    found = re.findall(r"top-1 ([0-9.]+)%", out)
    if not found:
        sys.exit(f"no top-1 in eval's output:\n{out[-2000:]}")
    return float(found[-1])


def train(name: str, data: str, nproc: int, seed: int | None, test: str | None, cwd: str) -> dict:
    out_dir = os.path.join(cwd, f"run-{name}-{seed}")
    args = ["train", "TRAIN.DATASET", data, "--nproc-per-node", str(nproc), "OUT_DIR", out_dir]
    if seed is not None:
        args += ["RNG_SEED", str(seed)]
    log, wall = run(args, cwd)
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    val = [r for r in rows if r["split"] == "val"]
    best = max(val, key=lambda r: (r["balanced_top1"], -r["loss"], r["epoch"]))
    planned = re.search(r"setup: OPTIM.MAX_EPOCH (\d+)", log)
    result = {"set": name, "seed": seed, "planned": planned.group(1) if planned else "given",
              "epochs": val[-1]["epoch"], "wall_s": wall, "best_epoch": best["epoch"],
              "val_top1": best["top1"], "stop": "early" if "early stop" in log else "budget"}
    if test is not None:
        result["best_test"] = test_top1(out_dir, "best.pth", test, cwd)
        result["last_test"] = test_top1(out_dir, "last.pth", test, cwd)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="photos,textures,digits")
    parser.add_argument("--seeds", default="1,2,3", help="RNG_SEED of the digits' runs")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--keep", help="make the sets and runs in this folder and keep them")
    args = parser.parse_args()
    if not os.path.exists(COMMAND):
        sys.exit(f"no {COMMAND}: run `make venv` first")
    work = args.keep or tempfile.mkdtemp(prefix="owner-runs-")
    os.makedirs(work, exist_ok=True)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; work in {work}")
    results = []
    for name in args.sets.split(","):
        if name == "photos":
            results.append(train(name, photos(os.path.join(work, "photos")), args.nproc, None, None, work))
        elif name == "textures":
            results.append(train(name, textures(os.path.join(work, "textures")), args.nproc, None, None, work))
        elif name == "digits":
            data, test = digits(os.path.join(work, "digits"))
            for seed in map(int, args.seeds.split(",")):
                results.append(train(name, data, args.nproc, seed, test, work))
        print(json.dumps(results[-1]), flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}\n")
    print("| set | seed | epochs planned / run | stop | wall | best epoch | val top-1 | test: best.pth | last.pth |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        tests = f"{r['best_test']:.2f}% | {r['last_test']:.2f}%" if "best_test" in r else "- | -"
        print(f"| {r['set']} | {r['seed'] if r['seed'] is not None else '-'} | {r['planned']} / "
              f"{r['epochs']} | {r['stop']} | {r['wall_s']:.0f} s | {r['best_epoch']} | "
              f"{r['val_top1']:.2f}% | {tests} |")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Side-by-side benchmarks of issue #7: every ratio from one command.

    .venv/bin/python benchmarks/overhead.py                    # all sections (5-15 minutes on 2 cores)
    .venv/bin/python benchmarks/overhead.py --quick            # fewer repetitions (2-5 minutes)
    .venv/bin/python benchmarks/overhead.py --sections overhead,memory --json out.json

Sections (each measured side by side in this one run, repetitions interleaved, medians reported):
  overhead  distribuuuu's training step (Trainer.train_epoch + hooks + Stepper + optimizer from the config)
            vs a minimal hand-written PyTorch loop: same ResNet-18, same batches in memory, CPU,
            1 thread; with TRAIN.NONFINITE off and skip. Then the same with 2 DDP processes (gloo).
  memory    data throughput on 32 px CIFAR-sized uint8 images: the in-memory path (MemoryLoader)
            vs distribuuuu's DataLoader path and vs torchvision's classic PIL CIFAR recipe.
  jpeg      per-core throughput on ~500x375 JPEGs: TRAIN.IMAGE_DECODE fast vs torchvision's default
            ImageFolder pipeline, and the output statistics of both (same crops, pixel differences).
  threads   `distribuuuu train` with 2 processes x 1 thread vs 1 process x 2 threads (img/s), for
            ResNet-18 and for the speedrun's small model.
  speedrun  `distribuuuu train --cfg config/mnist5k_fast.yaml` wall time and val top-1, with the
            in-memory path and with the DataLoader path.
The machine (CPU model, cores, load average) is printed first: the figures mean little without it.
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("DISTRIBUUUU_PROGRESS", "lines")  # no tqdm bar inside the timed loops

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

RESULTS: list[tuple[str, str, str]] = []  # (section, figure, value) for the final table


def report(section: str, name: str, value: str) -> None:
    RESULTS.append((section, name, value))
    print(f"  {name}: {value}", flush=True)


def machine() -> dict[str, Any]:
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": model, "cores": len(os.sched_getaffinity(0)), "load_avg": [round(x, 2) for x in os.getloadavg()],
            "torch": torch.__version__, "cuda": torch.cuda.is_available()}


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def interleaved(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[Any]]:
    """Call each fn (returning a throughput) reps times, rotating the order every round."""
    names = list(fns)
    out: dict[str, list[Any]] = {n: [] for n in names}
    for r in range(reps):
        for n in names[r % len(names):] + names[:r % len(names)]:
            out[n].append(fns[n]())
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def make_cfg(opts: dict[str, Any]) -> Any:
    from distribuuuu import inferred
    from distribuuuu.config import load_config

    flat: list[str] = []
    for k, v in opts.items():
        flat += [k, v if isinstance(v, str) else repr(v)]
    return inferred.resolve(load_config(None, flat), 1)  # the unset keys decided as for one process


# ---------------------------------------------------------------------------------------------
# 1. framework overhead
# ---------------------------------------------------------------------------------------------
OVERHEAD_CFG = {"MODEL.ARCH": "resnet18", "MODEL.NUM_CLASSES": 10, "TRAIN.IM_SIZE": 32, "TEST.IM_SIZE": 32,
                "TRAIN.BATCH_SIZE": 32, "TRAIN.DATASET": "synthetic", "TEST.DATASET": "synthetic",
                "TRAIN.PRINT_FREQ": 10**6, "OPTIM.MAX_EPOCH": 10**6, "OPTIM.WARMUP_EPOCHS": 0,
                "OPTIM.BASE_LR": 0.01, "DEVICE": "cpu", "NUM_THREADS": 1, "RNG_SEED": 0}


class _Batches:
    """Pre-made batches with the train-loader interface Trainer.train_epoch uses."""

    class _Sampler:
        def set_epoch(self, epoch: int, start: int = 0) -> None:
            pass

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], world_size: int = 1) -> None:
        self.batches, self.sampler = batches, self._Sampler()
        # The engine reads len(dataset) as the whole epoch over ALL ranks (as a DistributedSampler's dataset).
        self.dataset = range(sum(len(y) for _, y in batches) * world_size)

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _make_batches(n: int, batch: int, size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(n)]


def _framework(cfg: Any, ctx: Any, model: torch.nn.Module) -> Callable[[list], float]:
    """A callable that trains one 'epoch' over the given batches with Trainer.train_epoch (the built-in
    hooks included: the per-step stop/checkpoint vote); returns img/s. ``model``: the bare model."""
    from distribuuuu import engine

    trainer = engine.Trainer(cfg, ctx)
    trainer.build_model(model)  # wrapped by the strategy, its optimizer, the Stepper
    quiet_metrics(trainer)
    state = trainer.state

    def run(loader: Any) -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        trainer.train_epoch(loader)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        state.samples_in_epoch = 0
        n = len(loader) * cfg.TRAIN.BATCH_SIZE
        return n / seconds, n / cpu

    return run


def quiet_metrics(trainer: Any) -> None:
    """train_epoch without fit: the metrics hook gets the no-op writer of a non-main rank (fit's
    before_fit would make a real one; the epoch's last iteration is a print step that writes)."""
    from distribuuuu.engine.hooks import MetricsHook
    from distribuuuu.run_folder.metrics_files import MetricsWriter

    for hook in trainer.hooks:
        if isinstance(hook, MetricsHook):
            hook.writer = MetricsWriter(trainer.cfg.OUT_DIR, False, topk=trainer.cfg.TRAIN.TOPK)


def _minimal(cfg: Any, model: torch.nn.Module) -> Callable[[list], float]:
    """The hand-written loop: forward, loss, backward, step, zero_grad(set_to_none) - nothing else.
    The same SGD (Nesterov momentum, weight decay, fused kernel) as strategies.build_optimizer builds."""
    o = cfg.OPTIM
    opt = torch.optim.SGD(model.parameters(), lr=o.BASE_LR, momentum=o.MOMENTUM, nesterov=o.NESTEROV,
                          weight_decay=o.WEIGHT_DECAY, fused=True)

    def run(batches: list) -> tuple[float, float]:
        model.train()
        start, cpu = time.perf_counter(), time.process_time()
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        n = len(batches) * len(batches[0][1])
        return n / (time.perf_counter() - start), n / (time.process_time() - cpu)

    return run


def section_overhead(args: argparse.Namespace) -> None:
    from distribuuuu import models
    from distribuuuu.launch import comm

    print(f"\n[overhead] ResNet-18, 32 px, batch 32, CPU, 1 thread ({load()})", flush=True)
    torch.set_num_threads(1)
    steps, reps = (6, 5) if args.quick else (10, 9)
    batches = _make_batches(steps, 32, 32, seed=0)
    variants: dict[str, Callable[[], float]] = {}
    torch.manual_seed(0)
    base = models.build_model(make_cfg(OVERHEAD_CFG))
    minimal = _minimal(make_cfg(OVERHEAD_CFG), copy.deepcopy(base))
    variants["minimal loop"] = lambda: minimal(batches)
    for mode in ("off", "skip"):
        cfg = make_cfg({**OVERHEAD_CFG, "TRAIN.NONFINITE": mode})
        ctx = comm.setup(cfg)
        model = copy.deepcopy(base)
        run = _framework(cfg, ctx, model)
        variants[f"distribuuuu NONFINITE {mode}"] = (lambda run=run: run(_Batches(batches)))
    for fn in variants.values():  # warm-up: first-touch allocations, oneDNN primitive caches
        fn()
    res = interleaved(variants, reps)
    # Wall time is what a user waits for; CPU time of this 1-thread process is the work done,
    # and is far less disturbed by other processes on a shared machine: both are reported.
    for k, clock in ((0, "wall"), (1, "CPU")):
        base_ips = med([r[k] for r in res["minimal loop"]])
        for name, rs in res.items():
            xs = [r[k] for r in rs]
            report("overhead", f"{name} img/s by {clock} time (median of {reps})",
                   f"{med(xs):.1f}  [{min(xs):.1f} .. {max(xs):.1f}]")
        for mode in ("off", "skip"):
            ratio = med([r[k] for r in res[f"distribuuuu NONFINITE {mode}"]]) / base_ips
            report("overhead", f"ratio distribuuuu (NONFINITE {mode}) / minimal, 1 process, {clock} time", f"{ratio:.3f}")
    base_ips = med([r[1] for r in res["minimal loop"]])
    # The one extra per-step computation with NONFINITE skip: the foreach norm of all gradients,
    # timed alone on the gradients of one real step (on the device path it is not waited for: the
    # bool() here stands for the synced check that optimizers without a fused kernel keep).
    model = copy.deepcopy(base)
    F.cross_entropy(model(batches[0][0]), batches[0][1]).backward()
    from distribuuuu.strategies import Strategy

    params, strategy = list(model.parameters()), Strategy(make_cfg(OVERHEAD_CFG), None)
    t0 = time.perf_counter()
    for _ in range(20):
        bool(strategy.grads_finite(params))  # with its host sync, as the stepper pays it
    check_ms = (time.perf_counter() - t0) / 20 * 1e3
    report("overhead", "grads_finite() per step (NONFINITE skip/stop)",
           f"{check_ms:.2f} ms = {check_ms / (32 / base_ips * 1e3) * 100:.1f}% of a minimal step")
    comm.teardown()
    if not args.one_process:
        _ddp_overhead(args)


def _ddp_worker(rank: int, world: int, port: int, reps: int, steps: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DISTRIBUUUU_PROGRESS="lines")
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distribuuuu import models
    from distribuuuu.launch import comm

    cfg = make_cfg({**OVERHEAD_CFG, "TRAIN.NONFINITE": "off"})
    ctx = comm.setup(cfg)
    batches = _make_batches(steps, 32, 32, seed=1 + rank)
    torch.manual_seed(0)
    base = models.build_model(cfg)
    minimal = _minimal(cfg, DDP(copy.deepcopy(base)))
    torch.manual_seed(0)
    framework = _framework(cfg, ctx, models.build_model(cfg))
    variants = {"minimal DDP loop": lambda: minimal(batches), "distribuuuu": lambda: framework(_Batches(batches, world))}
    for fn in variants.values():
        fn()
    res = interleaved(variants, reps)
    # comm.max_over_ranks: the one per-step collective the engine adds (stop signal / timed checkpoint).
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(200):
        comm.max_over_ranks([False, False])
    any_rank_ms = (time.perf_counter() - t0) / 200 * 1e3
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"res": res, "any_rank_ms": any_rank_ms}, f)
    comm.teardown()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_overhead(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    print(f"\n[overhead] the same with 2 DDP processes x 1 thread (gloo) ({load()})", flush=True)
    steps, reps = (6, 3) if args.quick else (10, 7)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ddp.json")
        mp.start_processes(_ddp_worker, args=(2, _free_port(), reps, steps, out), nprocs=2, start_method="spawn")
        with open(out) as f:
            got = json.load(f)
    # Wall time includes waiting for the other rank (where an extra sync would show); CPU time
    # (rank 0) is the work done, steadier when other processes share the cores.
    for k, clock in ((0, "wall"), (1, "CPU")):
        res = {name: [r[k] for r in rs] for name, rs in got["res"].items()}
        for name, xs in res.items():
            report("overhead", f"{name} img/s per process by {clock} time (median of {reps})",
                   f"{med(xs):.1f}  [{min(xs):.1f} .. {max(xs):.1f}]")
        ratio = med(res["distribuuuu"]) / med(res["minimal DDP loop"])
        report("overhead", f"ratio distribuuuu (NONFINITE off) / minimal, 2 DDP processes, {clock} time", f"{ratio:.3f}")
    step_ms = 32 / med([r[0] for r in got["res"]["minimal DDP loop"]]) * 1e3
    report("overhead", "comm.max_over_ranks() per step (2 processes)",
           f"{got['any_rank_ms']:.3f} ms = {got['any_rank_ms'] / step_ms * 100:.2f}% of a step")


# ---------------------------------------------------------------------------------------------
# 2. in-memory data path vs DataLoader paths, 32 px
# ---------------------------------------------------------------------------------------------
def write_cifar_like(folder: str, n_train: int, n_test: int, seed: int = 0) -> None:
    """A CIFAR-10 python-pickle folder of random-but-structured 32x32 images (nothing downloaded)."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)

    def images(n: int) -> np.ndarray:
        low = rng.integers(0, 256, (n, 3, 4, 4)).astype(np.float32)
        up = torch.nn.functional.interpolate(torch.from_numpy(low), size=32, mode="bilinear").numpy()
        return np.clip(up + rng.normal(0, 20, up.shape), 0, 255).astype(np.uint8).reshape(n, -1)

    per = n_train // 5
    for i in range(1, 6):
        with open(os.path.join(folder, f"data_batch_{i}"), "wb") as f:
            pickle.dump({"data": images(per), "labels": rng.integers(0, 10, per).tolist()}, f)
    with open(os.path.join(folder, "test_batch"), "wb") as f:
        pickle.dump({"data": images(n_test), "labels": rng.integers(0, 10, n_test).tolist()}, f)


class _PilCifar(torch.utils.data.Dataset):
    """torchvision's CIFAR10 dataset recipe: a PIL image per item, then the classic transforms."""

    def __init__(self, images: np.ndarray, targets: list[int]) -> None:
        import torchvision.transforms as T

        self.images, self.targets = images, targets  # [N, 32, 32, 3] uint8 (HWC, as CIFAR10.data)
        self.transform = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(),
                                    T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))])

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        return self.transform(Image.fromarray(self.images[i])), self.targets[i]


def _throughput(loader: Any, n_batches: int) -> float:
    """img/s through n_batches batches of an iterable of (images, target)."""
    if hasattr(loader, "sampler") and hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(0)
    start, seen = time.perf_counter(), 0
    for i, (x, _) in enumerate(loader):
        seen += x.shape[0]
        if i + 1 == n_batches:
            break
    return seen / (time.perf_counter() - start)


def section_memory(args: argparse.Namespace) -> None:
    from distribuuuu import data

    print(f"\n[memory] 32 px CIFAR-sized uint8 images, batch 128, CPU, 1 thread ({load()})", flush=True)
    torch.set_num_threads(1)
    n_batches, reps = (10, 3) if args.quick else (20, 5)
    with tempfile.TemporaryDirectory() as tmp:
        write_cifar_like(tmp, 10000, 1000)
        base = {"TRAIN.DATASET": tmp, "TEST.DATASET": tmp, "MODEL.NUM_CLASSES": 10, "TRAIN.IM_SIZE": 32,
                "TEST.IM_SIZE": 32, "TRAIN.BATCH_SIZE": 128, "TRAIN.WORKERS": 0, "RNG_SEED": 0}
        cpu = torch.device("cpu")
        memory = data.build_train_loader(make_cfg({**base, "TRAIN.DATA_PIPELINE": "memory"}), 0, 1, cpu)
        loader = data.build_train_loader(make_cfg({**base, "TRAIN.DATA_PIPELINE": "loader"}), 0, 1, cpu)
        hwc = memory.dataset.images.permute(0, 2, 3, 1).numpy()
        pil = torch.utils.data.DataLoader(_PilCifar(hwc, memory.dataset.targets.tolist()), batch_size=128,
                                          shuffle=True, num_workers=0, drop_last=True)
        variants = {"in-memory (MemoryLoader)": lambda: _throughput(memory, n_batches),
                    "DataLoader + per-sample tensor transforms (distribuuuu loader path)":
                        lambda: _throughput(loader, n_batches),
                    "DataLoader + PIL transforms (torchvision CIFAR recipe)": lambda: _throughput(pil, n_batches)}
        for fn in variants.values():
            fn()
        res = interleaved(variants, reps)
    for name, xs in res.items():
        report("memory", f"{name} img/s", f"{med(xs):.0f}")
    mem = med(res["in-memory (MemoryLoader)"])
    report("memory", "ratio in-memory / DataLoader+PIL", f"{mem / med(res['DataLoader + PIL transforms (torchvision CIFAR recipe)']):.1f}x")
    report("memory", "ratio in-memory / distribuuuu DataLoader path",
           f"{mem / med(res['DataLoader + per-sample tensor transforms (distribuuuu loader path)']):.1f}x")


# ---------------------------------------------------------------------------------------------
# 3. JPEG pipeline
# ---------------------------------------------------------------------------------------------
def write_jpegs(root: str, n: int, seed: int = 0, scale: int = 1) -> None:
    """n photo-like JPEGs (500x375 and 375x500 times scale, quality 90, ~80 KB at scale 1) in 4 class folders."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for i in range(n):
        w, h = (500 * scale, 375 * scale) if i % 4 else (375 * scale, 500 * scale)
        low = rng.random((h // 25 + 1, w // 25 + 1, 3)) * 255  # smooth colour regions ...
        a = np.asarray(Image.fromarray(low.astype(np.uint8)).resize((w, h), Image.BICUBIC)).astype(np.float32)
        yy, xx = np.mgrid[0:h, 0:w]
        a += 30 * np.sin(xx / rng.uniform(3, 12) + yy / rng.uniform(3, 12))[..., None]  # ... texture ...
        a += rng.normal(0, 12, a.shape)  # ... and sensor-like noise, so it compresses like a photo
        folder = os.path.join(root, "train", f"c{i % 4}")
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(os.path.join(folder, f"{i:04d}.jpg"), quality=90)


def _reference_folder(root: str, size: int) -> Any:
    import torchvision.transforms as T
    from torchvision.datasets import ImageFolder

    return ImageFolder(os.path.join(root, "train"), transform=T.Compose([
        T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(),
        T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))]))


def _cpu_throughput(loader: Any, n_batches: int) -> float:
    """img per CPU-second of this process (1 thread, no workers): throughput per core, which other
    processes on a shared machine disturb far less than wall time."""
    if hasattr(loader, "sampler") and hasattr(loader.sampler, "set_epoch"):
        loader.sampler.set_epoch(0)
    start, seen = time.process_time(), 0
    for i, (x, _) in enumerate(loader):
        seen += x.shape[0]
        if i + 1 == n_batches:
            break
    return seen / (time.process_time() - start)


def section_jpeg(args: argparse.Namespace) -> None:
    from distribuuuu import data
    from distribuuuu.data.decoding import cpu

    torch.set_num_threads(1)
    n_images = 128 if args.quick else 256
    n_batches, reps = (n_images // 32, 3) if args.quick else (n_images // 32, 5)
    with tempfile.TemporaryDirectory() as tmp:
        write_jpegs(tmp, n_images)
        kb = sum(os.path.getsize(p) for p in glob.glob(f"{tmp}/train/*/*.jpg")) / n_images / 1024
        for size in (224, 128):
            print(f"\n[jpeg] {n_images} JPEGs 500x375 (~{kb:.0f} KB), RandomResizedCrop({size}) + flip, batch 32, "
                  f"DataLoader without workers, 1 thread, img per CPU-second ({load()})", flush=True)
            base = {"TRAIN.DATASET": tmp, "TEST.DATASET": tmp, "TEST.SPLIT": "train", "MODEL.NUM_CLASSES": 4,
                    "TRAIN.IM_SIZE": size, "TEST.IM_SIZE": size, "TRAIN.BATCH_SIZE": 32, "TRAIN.WORKERS": 0,
                    "RNG_SEED": 0, "TRAIN.TOPK": 1}
            cpu = torch.device("cpu")
            fast = data.build_train_loader(make_cfg({**base, "TRAIN.IMAGE_DECODE": "fast"}), 0, 1, cpu)
            pil = data.build_train_loader(make_cfg({**base, "TRAIN.IMAGE_DECODE": "pil"}), 0, 1, cpu)
            ref = torch.utils.data.DataLoader(_reference_folder(tmp, size), batch_size=32, shuffle=True, num_workers=0)
            variants = {"torchvision default ImageFolder pipeline": lambda ref=ref: _cpu_throughput(ref, n_batches),
                        "distribuuuu IMAGE_DECODE pil": lambda pil=pil: _cpu_throughput(pil, n_batches),
                        "distribuuuu IMAGE_DECODE fast": lambda fast=fast: _cpu_throughput(fast, n_batches)}
            _cpu_throughput(fast, 2)
            _cpu_throughput(ref, 2)
            res = interleaved(variants, reps)
            for name, xs in res.items():
                report("jpeg", f"{size} px: {name} img/CPU-s", f"{med(xs):.1f}  [{min(xs):.1f} .. {max(xs):.1f}]")
            report("jpeg", f"{size} px: ratio fast / torchvision default (per core)",
                   f"{med(res['distribuuuu IMAGE_DECODE fast']) / med(res['torchvision default ImageFolder pipeline']):.2f}x")
            _jpeg_distribution(tmp, size, cpu)
    _jpeg_reduced_decoding(args, cpu)


def _jpeg_reduced_decoding(args: argparse.Namespace, cpu: Any) -> None:
    """What decoding at 1/2 scale buys on large JPEGs (1000x750): the fast decoder with and without it."""
    n = 32 if args.quick else 64
    with tempfile.TemporaryDirectory() as tmp:
        write_jpegs(tmp, n, seed=1, scale=2)
        paths = sorted(glob.glob(f"{tmp}/train/*/*.jpg"))
        print(f"\n[jpeg] {n} JPEGs 1000x750, RandomResizedCrop(224): reduced-size decoding on / off, "
              f"img per CPU-second of FastTrainDecode ({load()})", flush=True)
        decode, threshold = cpu.FastTrainDecode(224, "RGB"), cpu.HALF_SCALE_MIN_PIXELS

        def run(on: bool) -> float:
            cpu.HALF_SCALE_MIN_PIXELS = threshold if on else 10**12  # off: never 1/2 (1/4 needs >= 896 px crops)
            torch.manual_seed(0)
            start = time.process_time()
            for p in paths:
                decode(open(p, "rb").read())
            cpu.HALF_SCALE_MIN_PIXELS = threshold
            return len(paths) / (time.process_time() - start)

        res = interleaved({"on": lambda: run(True), "off": lambda: run(False)}, 3 if args.quick else 5)
    report("jpeg", "1000x750 JPEGs, 224 px: reduced-size decoding on / off (img/CPU-s)",
           f"{med(res['on']):.1f} / {med(res['off']):.1f} = {med(res['on']) / med(res['off']):.2f}x")


def _jpeg_distribution(root: str, size: int, cpu: Any) -> None:
    """Same crop and flip draws in both pipelines (same seed, same RNG calls in the same order),
    so each output pair can be compared pixel by pixel; and the statistics over all images."""
    import torchvision.transforms as T
    from PIL import Image

    ref_tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.PILToTensor()])
    fast = cpu.FastTrainDecode(size, "RGB")
    paths = sorted(glob.glob(f"{root}/train/*/*.jpg"))
    diffs, refs, fasts, drafted = [], [], [], 0
    for i, path in enumerate(paths):
        torch.manual_seed(i)
        r = ref_tf(Image.open(path).convert("RGB")).float()
        torch.manual_seed(i)
        x = fast(open(path, "rb").read()).float()
        torch.manual_seed(i)  # the crop the fast path drew: was it decoded at reduced scale?
        width, height = Image.open(path).size
        _, _, h, w = T.RandomResizedCrop.get_params(torch.empty(1).expand(1, height, width), [0.08, 1.0], [3 / 4, 4 / 3])
        with open(path, "rb") as f:
            drafted += cpu.decode_scale(f.read(), width, height, w, h, size) > 1
        diffs.append((r - x).abs().mean().item())
        refs.append(r)
        fasts.append(x)
    r, x = torch.stack(refs), torch.stack(fasts)
    report("jpeg", f"{size} px: mean |fast - reference| per pixel, same crops (0-255 scale)",
           f"{statistics.mean(diffs):.2f} (max image {max(diffs):.2f}); {drafted}/{len(paths)} crops decoded reduced")
    report("jpeg", f"{size} px: per-channel mean reference / fast",
           f"{[round(v, 2) for v in r.mean((0, 2, 3)).tolist()]} / {[round(v, 2) for v in x.mean((0, 2, 3)).tolist()]}")
    report("jpeg", f"{size} px: per-channel std reference / fast",
           f"{[round(v, 2) for v in r.std((0, 2, 3)).tolist()]} / {[round(v, 2) for v in x.std((0, 2, 3)).tolist()]}")


# ---------------------------------------------------------------------------------------------
# 4. threads and 5. speedrun: the real command line
# ---------------------------------------------------------------------------------------------
def _train(args: list[str], out: str, nproc: int | None, timeout: float = 600,
           env_extra: dict[str, str] | None = None) -> tuple[float, list[dict]]:
    """Run `distribuuuu train [--nproc-per-node N] ... OUT_DIR out` (None: one plain process, no
    spawner); return (wall seconds of the whole command, metrics.jsonl records)."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                "MASTER_PORT"):
        env.pop(var, None)
    env.update(DISTRIBUUUU_PROGRESS="lines", **(env_extra or {}))
    launch = ["--nproc-per-node", str(nproc)] if nproc else []
    cmd = [sys.executable, "-m", "distribuuuu", "train", *launch, *args, "OUT_DIR", out, "TRAIN.AUTO_RESUME", "False"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    from distribuuuu.run_folder.metrics_files import (
        read_jsonl,  # a bad line is skipped with a warning, as in plot
    )

    return wall, read_jsonl(os.path.join(out, "metrics.jsonl"))


THREADS_ARGS = ["--cfg", os.path.join(ROOT, "config", "synthetic_tiny.yaml"), "MODEL.ARCH", "resnet18",
                "MODEL.NUM_CLASSES", "10", "MODEL.SMALL_STEM", "False", "TRAIN.TOPK", "5", "TRAIN.IM_SIZE", "32",
                "TEST.IM_SIZE", "32", "TRAIN.SYNTHETIC_SAMPLES", "1024", "TEST.SYNTHETIC_SAMPLES", "64",
                "TRAIN.DATA_PIPELINE", "memory", "OPTIM.MAX_EPOCH", "2", "TRAIN.PRINT_FREQ", "1000"]


# The speedrun's model on mnist5k: 0.3M parameters, so its gradient all-reduce is cheap.
SMALL_MODEL_ARGS = ["--cfg", os.path.join(ROOT, "config", "mnist5k_fast.yaml"), "OPTIM.MAX_EPOCH", "2"]


def section_threads(args: argparse.Namespace) -> None:
    reps, timeout = (1, 240) if args.quick else (2, 240)
    workloads = [("ResNet-18 32 px, global batch 64", "", THREADS_ARGS, 32),
                 ("resnet_tiny on mnist5k (speedrun config), global batch 128", "small model: ", SMALL_MODEL_ARGS, 64)]
    for title, tag, base, per_proc in workloads:
        print(f"\n[threads] {title}, `distribuuuu train`, 2nd epoch img/s ({load()})", flush=True)
        # OMP_WAIT_POLICY=PASSIVE: OpenMP threads sleep instead of spinning at barriers; it matters
        # when the cores are shared with other processes (see docs/performance.md).
        one_proc = ["TRAIN.BATCH_SIZE", str(2 * per_proc)]
        setups = {"2 processes x 1 thread": (2, ["TRAIN.BATCH_SIZE", str(per_proc), "NUM_THREADS", "1"], {}),
                  "1 process x 2 threads": (1, [*one_proc, "NUM_THREADS", "2"], {}),
                  "1 process x 2 threads, OMP_WAIT_POLICY=PASSIVE": (1, [*one_proc, "NUM_THREADS", "2"],
                                                                     {"OMP_WAIT_POLICY": "PASSIVE"}),
                  "1 process x 1 thread": (1, [*one_proc, "NUM_THREADS", "1"], {})}
        with tempfile.TemporaryDirectory() as tmp:
            def one(name: str, base: list[str] = base, setups: dict = setups) -> float:
                nproc, extra, env = setups[name]
                try:
                    _, records = _train(base + extra, os.path.join(tmp, f"r{time.time_ns()}"), nproc, timeout, env)
                except subprocess.TimeoutExpired:
                    return float("nan")  # the run did not finish in time
                return [m for m in records if m["split"] == "train"][-1]["img_per_s"]  # 2nd epoch: warmed up

            res = interleaved({name: (lambda name=name: one(name)) for name in setups}, reps)
        for name, xs in res.items():
            each = ", ".join(f"{x:.0f}" for x in xs)  # a run that timed out shows as nan
            report("threads", f"{tag}{name} img/s (median of {reps})", f"{med(xs):.0f}  [{each}]")
        report("threads", f"{tag}ratio 2 processes x 1 thread / 1 process x 2 threads",
               f"{med(res['2 processes x 1 thread']) / med(res['1 process x 2 threads']):.2f}")


def section_speedrun(args: argparse.Namespace) -> None:
    cfg = os.path.join(ROOT, "config", "mnist5k_fast.yaml")
    runs = [("2 processes, memory", 2, "memory"), ("2 processes, loader", 2, "loader"),
            ("1 process (no spawner), memory", None, "memory")]
    with tempfile.TemporaryDirectory() as tmp:
        for name, nproc, pipeline in runs:
            print(f"\n[speedrun] config/mnist5k_fast.yaml, {name} ({load()})", flush=True)
            wall, records = _train(["--cfg", cfg, "TRAIN.DATA_PIPELINE", pipeline], os.path.join(tmp, name), nproc)
            val = [m for m in records if m["split"] == "val"]
            train = [m for m in records if m["split"] == "train"]
            report("speedrun", f"{name}: wall time of the whole command", f"{wall:.1f} s ({load()})")
            report("speedrun", f"{name}: final / best val top-1",
                   f"{val[-1]['top1']:.2f}% / {max(m['top1'] for m in val):.2f}% after {len(train)} epochs")
            report("speedrun", f"{name}: train img/s (last epoch), training time",
                   f"{train[-1]['img_per_s']:.0f}, {sum(m['time_s'] for m in train):.1f} s")


SECTIONS = {"overhead": section_overhead, "memory": section_memory, "jpeg": section_jpeg,
            "threads": section_threads, "speedrun": section_speedrun}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (noisier)")
    parser.add_argument("--one-process", action="store_true", help="overhead: skip the 2-process DDP part")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args()
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    info = machine()
    print(f"machine: {info['cpu']} | {info['cores']} cores | load average {info['load_avg']} | torch {info['torch']} "
          f"| CUDA {info['cuda']}", flush=True)
    for name in chosen:
        SECTIONS[name](args)
    info["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    width = max(len(n) for _, n, _ in RESULTS) if RESULTS else 10
    print(f"\n{'=' * 20} summary ({load()} at the end) {'=' * 20}")
    for section, name, value in RESULTS:
        print(f"{section:9s} {name:{width}s}  {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "results": [list(r) for r in RESULTS]}, f, indent=1)


if __name__ == "__main__":
    main()

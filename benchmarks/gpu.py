"""The GPU paths run for real on one CUDA GPU: correctness runs, then speed figures (docs/performance.md 6).

    python benchmarks/gpu.py --out DIR                       # everything (H100: ~2 + ~6 minutes measured before the mr_* and
                                                             # jpeg_e2e jobs, which add an estimated ~3 + ~4)
    python benchmarks/gpu.py --out DIR --only fp16,resume    # the named jobs alone
    python benchmarks/gpu.py --out DIR --list                # the job names
    python benchmarks/gpu.py --out DIR --device cpu --small  # a dry run of every command on the CPU

Each job is its own subprocess with its own timeout; a failure is recorded (exit status, the tail of
its output) and the next job runs. Correctness jobs (short `distribuuuu train` runs on mnist5k and
eval/predict/export from a checkpoint) run 4 at a time; speed jobs run one after the other, alone on
the GPU. Results: DIR/gpu.json (every figure, command and status) and DIR/gpu.log (every output);
a table is printed at the end. With one GPU the ddp / zero1 / fsdp jobs run at world size 1, where
distribuuuu makes no process group: they check the strategies and launchers on a GPU, not NCCL
(which refuses two ranks on one GPU); DIST.STRATEGY dp needs two GPUs. The mr_* jobs
(gpu_multirank.py) run the multi-rank paths with 2 ranks sharing the GPU under gloo, and jpeg_e2e
(gpu_jpeg.py) trains ResNet-50 from JPEGs against synthetic data. Measured on an H100:
docs/performance.md section 6; the mr_* and jpeg_e2e figures are still to be measured (section 6b).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import glob
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PY = sys.executable
D = [PY, "-m", "distribuuuu"]


class Job:
    """One subprocess (or a few in a row: steps) with a timeout and a parser of what it wrote."""

    def __init__(self, name: str, kind: str, steps: list[list[str]], timeout: float,
                 parse: Callable[[Job], dict] | None = None, env: dict[str, str] | None = None) -> None:
        self.name, self.kind, self.steps, self.timeout = name, kind, steps, timeout
        self.parse, self.env = parse, env or {}
        self.out = ""  # the job's folder, set by run_job


def train_opts(args: argparse.Namespace) -> list[str]:
    """mnist5k's speedrun config on the device: 4 epochs x 62 steps (1 epoch with --small)."""
    epochs = "1" if args.small else "4"
    return ["--cfg", "mnist5k_fast", "DEVICE", args.device, "OPTIM.MAX_EPOCH", epochs, "NUM_THREADS", "2",
            "TRAIN.PRINT_FREQ", "25", "TRAIN.AUTO_RESUME", "False"]


def read_metrics(out: str) -> list[dict]:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def parse_train(job: Job) -> dict:
    """Final train/val figures of a run, the launcher line, and the fp16 overflow count."""
    recs = read_metrics(os.path.join(job.out, "run"))
    train = [r for r in recs if r.get("split") == "train"]
    val = [r for r in recs if r.get("split") == "val"]
    res: dict[str, Any] = {"epochs": len(train)}
    if train:
        t = train[-1]
        res.update(train_loss=round(t["loss"], 4), train_top1=round(t["top1"], 2),
                   img_per_s=round(t.get("img_per_s", 0)), peak_mem_mb=t.get("peak_mem_mb"))
    if val:
        res["val_top1"] = round(val[-1]["top1"], 2)
    log = open(os.path.join(job.out, "out.txt")).read()
    res["overflow_steps"] = log.count("gradients overflowed")
    res["dist"] = next((line.strip() for line in log.splitlines() if line.startswith("[dist]")), "")
    if not train or res.get("val_top1", 0) < 50:
        res["problem"] = "no metrics or val top-1 below 50%"
    return res


def parse_resume(job: Job) -> dict:
    """The straight and the stopped-then-resumed run: per-epoch records, losses and weights equal."""
    import torch

    s, r = os.path.join(job.out, "straight"), os.path.join(job.out, "resumed")
    key = lambda recs: [(m["epoch"], m["split"], m["n"], m["loss"], m["top1"]) for m in recs]  # noqa: E731
    same_metrics = key(read_metrics(s)) == key(read_metrics(r)) and bool(read_metrics(s))
    losses = [open(os.path.join(d, "loss.rank0")).read().split() for d in (s, r)]
    a, b = (torch.load(os.path.join(d, "checkpoints", "last.pth"), map_location="cpu", weights_only=True)["model"]
            for d in (s, r))
    same_weights = all(torch.equal(a[k], b[k]) for k in a)
    first = [m for m in read_metrics(r) if m["split"] == "val"]
    res = {"same_epoch_metrics": same_metrics, "same_losses": losses[0] == losses[1], "steps": len(losses[0]),
           "same_final_weights": same_weights, "val_top1": [round(m["top1"], 2) for m in first]}
    if not (same_metrics and res["same_losses"] and same_weights):
        res["problem"] = "resumed run differs from the straight one"
    return res


def parse_bench(job: Job) -> dict:
    with open(os.path.join(job.out, "bench", "bench.json")) as f:
        b = json.load(f)
    return {"batch": b["batch"], "model_train_img_per_s": round(b["model"]["train_img_per_s"]),
            "model_train_ms": round(b["model"]["train_ms"], 2), "train_iqr_ms": round(b["model"]["train_iqr_ms"], 2),
            "eval_img_per_s": round(b["model"]["eval_img_per_s"]), "data_img_per_s": round(b["data"]["img_per_s"]),
            "step_img_per_s": round(b["step"]["img_per_s"]), "step_data_frac": round(b["step"]["data_frac"], 3)}


def parse_csv(name: str) -> Callable[[Job], dict]:
    def parse(job: Job) -> dict:
        with open(os.path.join(job.out, "bench", name)) as f:
            return {"rows": list(csv.DictReader(f))}
    return parse


def parse_inner(job: Job) -> dict:
    with open(os.path.join(job.out, "inner.json")) as f:
        return json.load(f)


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def parse_infer(job: Job) -> dict:
    """eval's result line, the exported files and export's check (max |exported - eager| per format)."""
    lines = open(os.path.join(job.out, "out.txt")).read().splitlines()
    res = {"exported": sorted(os.path.basename(p) for p in glob.glob(os.path.join(job.out, "export", "*"))),
           "eval_line": next((ln for ln in lines if "[eval]" in ln), "")[-110:],
           "predicted": len(json.load(open(os.path.join(job.out, "pred.json")))),
           "export_check": [ln.split()[0] + " " + ln.split()[-1] for ln in lines
                            if ln.startswith("  ") and len(ln.split()) == 3 and _is_number(ln.split()[-1])],
           "eval_dist": [ln for ln in lines if ln.startswith("[dist]")][-1:]}
    if not res["eval_line"]:
        res["problem"] = "no eval line"
    return res


# ---------------------------------------------------------------------------------------------
# the jobs
# ---------------------------------------------------------------------------------------------
def _fault(*opts: str) -> list[str]:
    return [PY, "tests/scripts/fault_run.py", *opts]


def correctness_jobs(a: argparse.Namespace) -> list[Job]:
    base = train_opts(a)
    # The backend a run with 2+ GPUs would use (at world size 1 no process group is made).
    nccl = ["DIST.BACKEND", "nccl"] if a.device == "cuda" else ["DIST.BACKEND", "gloo"]
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "train_net.py"]

    def train(name: str, *opts: str, head: list[str] | None = None, timeout: float = 240) -> Job:
        cmd = (head or D + ["train"]) + base + list(opts) + ["OUT_DIR", "{out}/run"]
        return Job(name, "correct", [cmd], timeout, parse_train)

    det = ["CUDNN.DETERMINISTIC", "True", "CUDNN.BENCHMARK", "False", "TRAIN.AUTO_RESUME", "True"]
    stop_at = "30" if a.small else "100"  # epoch 1 of 4 (62 steps per epoch), mid-epoch
    ckpt, imgs = "{out}/run/checkpoints/last.pth", "{out}/imgs"
    return [
        train("fp32"), train("bf16", "TRAIN.AMP", "bf16"), train("fp16", "TRAIN.AMP", "fp16"),
        train("channels_last", "TRAIN.CHANNELS_LAST", "True"),
        train("compile", "TRAIN.COMPILE", "True", timeout=420),
        train("loader_path", "TRAIN.DATA_PIPELINE", "loader", "TRAIN.WORKERS", "2"),
        train("ddp_spawner", "DIST.STRATEGY", "ddp", *nccl, head=D + ["train", "--nproc-per-node", "1"]),
        train("ddp_torchrun_bf16", "DIST.STRATEGY", "ddp", "TRAIN.AMP", "bf16", *nccl, head=torchrun),
        train("zero1_torchrun", "DIST.STRATEGY", "zero1", *nccl, head=torchrun),
        train("fsdp_spawner", "DIST.STRATEGY", "fsdp", *nccl, head=D + ["train", "--nproc-per-node", "1"]),
        train("fsdp_offload_torchrun", "DIST.STRATEGY", "fsdp", "DIST.CPU_OFFLOAD", "True", *nccl, head=torchrun),
        train("fsdp_sharded_torchrun", "DIST.STRATEGY", "fsdp", "DIST.FSDP_STATE_DICT", "sharded", *nccl,
              head=torchrun),
        Job("resume", "correct", [
            (_fault(*base, *det, "OUT_DIR", "{out}/straight"), {"LOSS_LOG": "{out}/straight/loss"}, False),
            (_fault(*base, *det, "OUT_DIR", "{out}/resumed"),
             {"LOSS_LOG": "{out}/resumed/loss", "SIGNAL_AT": f"{stop_at}:0:SIGUSR1"}, True),
            (_fault(*base, *det, "OUT_DIR", "{out}/resumed"), {"LOSS_LOG": "{out}/resumed/loss"}, False)],
            420, parse_resume),
        Job("eval_predict_export", "correct", [
            D + ["train"] + base + ["OPTIM.MAX_EPOCH", "1", "OUT_DIR", "{out}/run"],
            D + ["eval", "MODEL.WEIGHTS", ckpt],
            [PY, "benchmarks/io_jpegs.py", imgs, "--n", "8", "--side", "64"],
            D + ["predict", "MODEL.WEIGHTS", ckpt, imgs, "--output", "{out}/pred.json"],
            D + ["export", "--out", "{out}/export", "MODEL.WEIGHTS", ckpt]], 300, parse_infer),
    ]


def r50(a: argparse.Namespace, batch: int) -> list[str]:
    """ResNet-50 at 224 px on the synthetic source held in GPU memory (no CPU data work per step)."""
    arch, size, n = ("resnet18", "32", "512") if a.small else ("resnet50", "224", "4096")
    batch = 16 if a.small else batch
    return ["MODEL.ARCH", arch, "MODEL.NUM_CLASSES", "1000", "TRAIN.DATASET", "synthetic", "TEST.DATASET",
            "synthetic", "TRAIN.IM_SIZE", size, "TEST.IM_SIZE", size, "TRAIN.SYNTHETIC_SAMPLES", n,
            "TEST.SYNTHETIC_SAMPLES", "512", "TRAIN.DATA_PIPELINE", "memory", "TRAIN.WORKERS", "0",
            "TRAIN.BATCH_SIZE", str(batch), "TEST.BATCH_SIZE", str(batch), "DEVICE", a.device, "RNG_SEED", "0",
            "OUT_DIR", "{out}/run"]


def speed_jobs(a: argparse.Namespace) -> list[Job]:
    it = ["--iters", "3", "--warmup", "1"] if a.small else ["--iters", "40", "--warmup", "5"]

    def bench(name: str, batch: int, *opts: str, timeout: float = 300) -> Job:
        return Job(name, "speed", [D + ["bench", *it, "--out", "{out}/bench"] + r50(a, batch) + list(opts)],
                   timeout, parse_bench)

    bf16 = ["TRAIN.AMP", "bf16", "TRAIN.CHANNELS_LAST", "True"]
    jpegs, n_jpegs = "{out}/jpegs", ("64" if a.small else "3000")
    workers = "0,1" if a.small else "1,2,4,8,12,16"
    return [
        bench("bench_bf16_cl", 256, *bf16),
        bench("bench_bf16_cl_compile", 256, *bf16, "TRAIN.COMPILE", "True", timeout=480),
        Job("overhead", "speed", [[PY, __file__, "--inner", "overhead", "--out", "{out}", "--device", a.device]
                                  + (["--small"] if a.small else [])], 300, parse_inner),
        bench("bench_fp32_tf32", 128, "CUDNN.TF32", "True"),
        bench("bench_fp32_no_tf32", 128, "CUDNN.TF32", "False"),
        Job("compare", "speed", [D + ["bench", "--compare", "single,ddp,ddp+amp", "--epochs", "3",
                                      "--global-batch", "16" if a.small else "256", "--out", "{out}/bench"]
                                 + r50(a, 256)], 480, parse_csv("compare.csv")),
        Job("memory", "speed", [[PY, __file__, "--inner", "memory", "--out", "{out}", "--device", a.device]
                                + (["--small"] if a.small else [])], 240, parse_inner),
        Job("jpeg_io", "speed", [
            [PY, "benchmarks/io_jpegs.py", jpegs, "--n", n_jpegs, "--side", "64" if a.small else "384"],
            D + ["bench", "--io", "--workers", workers, "--iters", "3" if a.small else "20", "--warmup", "3",
                 "--repeats", "2", "--out", "{out}/bench", "TRAIN.DATASET", jpegs, "MODEL.NUM_CLASSES", "10",
                 "TRAIN.BATCH_SIZE", "16" if a.small else "256", "TRAIN.IM_SIZE", "64" if a.small else "224",
                 "DEVICE", a.device, "OUT_DIR", "{out}/run"]], 420, parse_csv("io.csv")),
    ]


def sync_debug_job(a: argparse.Namespace) -> Job:
    """A few hundred default steps (TRAIN.NONFINITE skip, fused SGD) with no print step among them, under
    torch.cuda.set_sync_debug_mode("error"): a host sync in any of them raises (issue 24). Also counts the
    sync-forcing tensor calls (item, __bool__, tolist, cpu, ...), which is what the CPU dry run checks."""
    return Job("sync_debug", "correct", [[PY, __file__, "--inner", "sync_debug", "--out", "{out}", "--device",
                                              a.device] + (["--small"] if a.small else [])], 300, parse_inner)


def inner_sync_debug(a: argparse.Namespace) -> dict:
    """The body of sync_debug_job: train_epoch over batches already on the device; the debug mode is on
    from the second step (fused SGD's first step checks on the host: its momentum is not born yet) to the
    last iteration (the epoch's end reads its sums)."""
    import torch
    from torch.overrides import TorchFunctionMode

    from benchmarks.overhead import _Batches, make_cfg, quiet_metrics
    from distribuuuu import engine
    from distribuuuu.launch import comm

    size, batch, steps = (16, 4, 20) if a.small else (32, 64, 300)
    cfg = make_cfg({"MODEL.ARCH": "resnet18", "MODEL.NUM_CLASSES": 10, "TRAIN.IM_SIZE": size, "TEST.IM_SIZE": size,
                    "TRAIN.BATCH_SIZE": batch, "TRAIN.PRINT_FREQ": 10**6, "OPTIM.MAX_EPOCH": 10**6,
                    "DEVICE": a.device, "RNG_SEED": 0, "TRAIN.NONFINITE": "skip"})
    ctx = comm.setup(cfg)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(batch, 3, size, size, generator=g).to(ctx.device),
                torch.randint(0, 10, (batch,), generator=g).to(ctx.device)) for _ in range(steps)]
    batches[steps // 2][0][0] = float("nan")  # one skipped step among them, decided on the device
    cuda = ctx.device.type == "cuda"
    syncing = {torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
               torch.Tensor.__float__, torch.Tensor.__int__}

    class Watch(TorchFunctionMode, engine.HookBase):
        """Counts sync-forcing calls between the second step and the last iteration; sets the debug mode."""

        def __init__(self) -> None:
            super().__init__()
            self.step, self.calls, self.on = 0, 0, False

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += self.on and func in syncing
            return func(*args, **(kwargs or {}))

        def after_step(self, trainer: Any, step: Any, printed: Any) -> None:
            self.step += 1
            self.on = 1 <= self.step < steps - 1
            if cuda:
                torch.cuda.set_sync_debug_mode("error" if self.on else "default")

    watch = Watch()
    trainer = engine.Trainer(cfg, ctx, hooks=[watch])
    trainer.build_model()
    quiet_metrics(trainer)
    with watch:
        metrics = trainer.train_epoch(_Batches(batches))
    comm.teardown()
    result = {"steps": steps, "watched_steps": steps - 2, "sync_calls_while_watched": watch.calls,
              "cuda_sync_debug_mode": "error" if cuda else "not on the CPU", "skipped_steps": metrics["skipped_steps"],
              "global_step": trainer.state.global_step, "ok": watch.calls == 0 and metrics["skipped_steps"] == 1}
    if not result["ok"]:  # the job's status says it (its output keeps the figures)
        raise SystemExit(f"sync_debug failed: {result}")
    return result


# ---------------------------------------------------------------------------------------------
# in-process measurements (run as `gpu.py --inner NAME`, a fresh process each)
# ---------------------------------------------------------------------------------------------
def _timed(fn: Callable[[], int], device: Any) -> float:
    """img/s of fn (which returns the images it processed), the device's queue drained at both ends."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    n = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return n / (time.perf_counter() - start)


def _minimal_loop(cfg: Any, model: Any, device: Any) -> Callable[[list], int]:
    """The hand-written loop: autocast, channels_last, forward, loss, backward, the same SGD, zero_grad."""
    import torch
    import torch.nn.functional as F

    o, cl = cfg.OPTIM, cfg.TRAIN.CHANNELS_LAST
    model = model.to(device, memory_format=torch.channels_last if cl else torch.contiguous_format).train()
    opt = torch.optim.SGD(model.parameters(), lr=o.BASE_LR, momentum=o.MOMENTUM, nesterov=o.NESTEROV,
                          weight_decay=o.WEIGHT_DECAY, foreach=True)
    amp = cfg.TRAIN.AMP == "bf16"

    def run(batches: list) -> int:
        for x, y in batches:
            x = x.contiguous(memory_format=torch.channels_last) if cl else x
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return len(batches) * len(batches[0][1])

    return run


def inner_overhead(a: argparse.Namespace) -> dict:
    """distribuuuu's step (Trainer.train_epoch, hooks, Stepper) vs the minimal loop, same batches on the
    device, repetitions interleaved; NONFINITE off and skip (skip adds a host sync per step on CUDA)."""
    import copy

    import torch

    from benchmarks.overhead import _Batches, interleaved, make_cfg, med, quiet_metrics
    from distribuuuu import engine, models
    from distribuuuu.launch import comm

    size, batch, steps, reps = (32, 16, 4, 2) if a.small else (224, 256, 15, 5)
    opts = {"MODEL.ARCH": "resnet18" if a.small else "resnet50", "MODEL.NUM_CLASSES": 1000,
            "TRAIN.IM_SIZE": size, "TEST.IM_SIZE": size, "TRAIN.BATCH_SIZE": batch, "TRAIN.DATASET": "synthetic",
            "TEST.DATASET": "synthetic", "TRAIN.PRINT_FREQ": 10**6, "OPTIM.MAX_EPOCH": 10**6,
            "OPTIM.WARMUP_EPOCHS": 0, "OPTIM.BASE_LR": 0.01, "DEVICE": a.device, "RNG_SEED": 0,
            "TRAIN.AMP": "bf16", "TRAIN.CHANNELS_LAST": True}
    cfg = make_cfg({**opts, "TRAIN.NONFINITE": "off"})
    ctx = comm.setup(cfg)
    dev = ctx.device
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(batch, 3, size, size, generator=g).to(dev), torch.randint(0, 1000, (batch,), generator=g).to(dev))
               for _ in range(steps)]
    torch.manual_seed(0)
    base = models.build_model(cfg)
    minimal = _minimal_loop(cfg, copy.deepcopy(base), dev)
    variants = {"minimal loop": (lambda: minimal(batches))}
    for mode in ("off", "skip"):
        c = make_cfg({**opts, "TRAIN.NONFINITE": mode})
        trainer = engine.Trainer(c, ctx)
        trainer.build_model(copy.deepcopy(base))
        quiet_metrics(trainer)

        def run(trainer: Any = trainer) -> int:
            trainer.train_epoch(_Batches(batches))
            trainer.state.samples_in_epoch = 0
            return steps * batch

        variants[f"distribuuuu NONFINITE {mode}"] = run
    timed = {k: (lambda fn=fn: _timed(fn, dev)) for k, fn in variants.items()}
    for fn in timed.values():
        fn()  # warm-up: cuDNN autotuning (CUDNN.BENCHMARK), allocator
    res = interleaved(timed, reps)
    out: dict[str, Any] = {"setup": f"{opts['MODEL.ARCH']}, {size} px, batch {batch}, bf16 autocast, channels_last, "
                                    f"{steps} steps per repetition, median of {reps} interleaved"}
    for k, xs in res.items():
        out[f"{k} img/s"] = round(med(xs), 1)
        out[f"{k} spread"] = [round(min(xs), 1), round(max(xs), 1)]
    for mode in ("off", "skip"):
        out[f"ratio distribuuuu NONFINITE {mode} / minimal"] = round(
            med(res[f"distribuuuu NONFINITE {mode}"]) / med(res["minimal loop"]), 3)
    comm.teardown()
    return out


def inner_memory(a: argparse.Namespace) -> dict:
    """32 px CIFAR-sized images: the in-memory path (set and augmentation on the device) vs the
    DataLoader path (workers 0 and 4, batches copied to the device), img/s of the data alone."""
    import tempfile

    import torch

    from benchmarks.overhead import interleaved, make_cfg, med, write_cifar_like
    from distribuuuu import data

    dev = torch.device(a.device)
    n_batches, reps = (3, 2) if a.small else (60, 5)

    def through(loader: Any) -> int:
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(0)
        seen = 0
        for i, (x, y) in enumerate(loader):
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            seen += x.shape[0]
            if i + 1 == n_batches:
                break
        return seen

    with tempfile.TemporaryDirectory() as tmp:
        write_cifar_like(tmp, 2000 if a.small else 50000, 500)
        base = {"TRAIN.DATASET": tmp, "TEST.DATASET": tmp, "MODEL.NUM_CLASSES": 10, "TRAIN.IM_SIZE": 32,
                "TEST.IM_SIZE": 32, "TRAIN.BATCH_SIZE": 256, "RNG_SEED": 0, "DEVICE": a.device}
        loaders = {"in-memory (MemoryLoader)": ("memory", 0), "DataLoader, 0 workers": ("loader", 0),
                   "DataLoader, 4 workers": ("loader", 4)}
        built = {k: data.build_train_loader(make_cfg({**base, "TRAIN.DATA_PIPELINE": p, "TRAIN.WORKERS": w}),
                                            0, 1, dev) for k, (p, w) in loaders.items()}
        timed = {k: (lambda ld=ld: _timed(lambda: through(ld), dev)) for k, ld in built.items()}
        for fn in timed.values():
            fn()
        res = interleaved(timed, reps)
    out: dict[str, Any] = {"setup": f"32 px, batch 256, {n_batches} batches per repetition, median of {reps}"}
    for k, xs in res.items():
        out[f"{k} img/s"] = round(med(xs))
    mem = med(res["in-memory (MemoryLoader)"])
    for k in list(res)[1:]:
        out[f"ratio in-memory / {k}"] = round(mem / med(res[k]), 1)
    return out


# ---------------------------------------------------------------------------------------------
# running, recording, the table
# ---------------------------------------------------------------------------------------------
def _fill(x: Any, out: str) -> Any:
    return [s.replace("{out}", out) for s in x] if isinstance(x, list) else {k: v.replace("{out}", out) for k, v in x.items()}


def run_job(job: Job, root: str) -> dict:
    """Run the job's steps in order (a step that fails ends the job, unless it is allowed to),
    then its parser; every output goes to <root>/<name>/out.txt."""
    job.out = os.path.join(root, job.name)
    os.makedirs(job.out, exist_ok=True)
    rec: dict[str, Any] = {"kind": job.kind, "ok": True, "cmds": [], "rc": []}
    start = time.perf_counter()
    with open(os.path.join(job.out, "out.txt"), "w") as log:
        for step in job.steps:
            cmd, env, may_fail = step if isinstance(step, tuple) else (step, {}, False)
            cmd = _fill(cmd, job.out)
            rec["cmds"].append(" ".join(cmd[1:] if cmd[0] == PY else cmd))
            log.write(f"\n$ {' '.join(cmd)}\n")
            log.flush()
            e = {**os.environ, **_fill({**job.env, **env}, job.out)}
            try:
                p = subprocess.run(cmd, cwd=ROOT, env=e, stdout=log, stderr=subprocess.STDOUT, timeout=job.timeout)
                rc = p.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            rec["rc"].append(rc)
            if rc != 0 and not may_fail:
                rec["ok"] = False
                break
    rec["seconds"] = round(time.perf_counter() - start, 1)
    if rec["ok"] and job.parse:
        try:
            rec["result"] = job.parse(job)
            rec["ok"] = "problem" not in rec["result"]
        except Exception as exc:  # noqa: BLE001 -- a parser failure is the job's failure, not the script's
            rec["ok"], rec["result"] = False, {"parse_error": repr(exc)}
    if not rec["ok"]:
        rec["tail"] = open(os.path.join(job.out, "out.txt")).read()[-3000:]
    return rec


def machine() -> dict:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0],
                            "cores": len(os.sched_getaffinity(0))}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
        info["cudnn"] = torch.backends.cudnn.version()
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total",
                                             "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
        except OSError:
            pass
    return info


def summary_line(name: str, rec: dict) -> str:
    res = rec.get("result", {})
    short = {k: v for k, v in res.items() if k not in ("rows", "dist", "setup") and not k.endswith("spread")}
    status = "ok" if rec["ok"] else f"FAIL rc={rec['rc']}"
    return f"{name:24s} {status:14s} {rec['seconds']:7.1f}s  {json.dumps(short)[:400]}"


def write_results(root: str, results: dict) -> None:
    with open(os.path.join(root, "gpu.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(root, "gpu.log"), "w") as log:
        for name in results["jobs"]:
            path = os.path.join(root, name, "out.txt")
            if os.path.exists(path):
                log.write(f"\n===== {name}\n" + open(path).read()[-20000:])


def all_jobs(a: argparse.Namespace) -> list[Job]:
    """Every job, in order: each group below is one function (add a group as one more line here)."""
    from benchmarks.gpu_jpeg import jpeg_jobs
    from benchmarks.gpu_multirank import multirank_jobs

    return correctness_jobs(a) + multirank_jobs(a, Job) + speed_jobs(a) + [sync_debug_job(a)] + jpeg_jobs(a, Job)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results folder")
    p.add_argument("--only", default="", help="comma-separated job names (default: all)")
    p.add_argument("--skip", default="", help="comma-separated job names to leave out")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="tiny sizes: a dry run of every command")
    p.add_argument("--deadline", type=float, default=0, help="start no job after this many seconds (0: none)")
    p.add_argument("--parallel", type=int, default=4, help="correctness jobs at a time")
    p.add_argument("--list", action="store_true")
    p.add_argument("--inner", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.inner:
        res = {"overhead": inner_overhead, "memory": inner_memory, "sync_debug": inner_sync_debug}[a.inner](a)
        print(json.dumps(res, indent=1))
        with open(os.path.join(a.out, "inner.json"), "w") as f:
            json.dump(res, f)
        return
    jobs = all_jobs(a)
    if a.list:
        print("\n".join(f"{j.kind:8s} {j.name}" for j in jobs))
        return
    only, skip = set(filter(None, a.only.split(","))), set(filter(None, a.skip.split(",")))
    jobs = [j for j in jobs if (not only or j.name in only) and j.name not in skip]
    run_all(a, jobs)


def run_all(a: argparse.Namespace, jobs: list[Job]) -> None:
    os.makedirs(a.out, exist_ok=True)
    results: dict[str, Any] = {"machine": machine(), "jobs": {}}
    print(json.dumps(results["machine"]), flush=True)
    t0 = time.perf_counter()

    def late() -> bool:
        return bool(a.deadline) and time.perf_counter() - t0 > a.deadline

    def record(job: Job, rec: dict) -> None:
        results["jobs"][job.name] = rec
        print(summary_line(job.name, rec), flush=True)
        write_results(a.out, results)

    with cf.ThreadPoolExecutor(a.parallel) as pool:  # correctness: small runs side by side
        futures = {pool.submit(run_job, j, a.out): j for j in jobs if j.kind == "correct"}
        for fut in cf.as_completed(futures):
            record(futures[fut], fut.result())
    for job in (j for j in jobs if j.kind == "speed"):  # speed: one at a time, alone on the GPU
        if late():
            record(job, {"kind": "speed", "ok": False, "rc": ["not started: deadline"], "seconds": 0.0})
            continue
        record(job, run_job(job, a.out))
    print("\n" + "\n".join(summary_line(n, r) for n, r in results["jobs"].items()))
    print(f"total {time.perf_counter() - t0:.0f}s; not ok: "
          + ",".join(n for n, r in results["jobs"].items() if not r["ok"]))


if __name__ == "__main__":
    main()

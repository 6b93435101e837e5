"""The run folder's record of what ran where: OUT_DIR/env.json, env_history.jsonl and model.txt.

env.json: library versions, the git commit of the code, every rank's host and device, world size,
backend, launcher, start time, command line and the run's seed, of the latest start (one JSON
object, as before: tools read it). env_history.jsonl gets the same object as one line at every
start, so a resumed run keeps the record of each of its starts. model.txt: a per-parameter table (name, shape,
count), the totals, the size in MB and the FLOPs of one image at TRAIN.IM_SIZE.

``prepare_run_record`` gathers every rank's host name, so ALL ranks must call it; ``write_run_record``
writes it (rank 0) once the run has passed every check, so that a refused run changes nothing.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import shlex
import socket
import subprocess
import sys
from typing import Any

import torch
from yacs.config import CfgNode

from distribuuuu.launch import comm
from distribuuuu.launch.comm import DistContext
from distribuuuu.run_folder.layout import ENV, ENV_HISTORY, MODEL_TABLE, checkpoint_dir

log = logging.getLogger("distribuuuu")


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def git_commit(path: str | None = None) -> dict[str, Any] | None:
    """{"commit", "dirty"} of the git checkout holding path (the package by default), or None."""
    path = path or os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", path, *args], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):  # no git, or not a checkout (an installed package)
        return None
    return {"commit": commit, "dirty": dirty}


def _cpu_name() -> str:
    try:  # Linux: platform.processor() is often empty there
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _placement(ctx: DistContext) -> dict[str, Any]:
    device = ctx.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return {"rank": ctx.rank, "local_rank": ctx.local_rank, "node_rank": ctx.node_rank,
            "host": socket.gethostname(), "pid": os.getpid(), "device": str(device), "device_name": name}


def gather_placements(ctx: DistContext) -> list[dict[str, Any]]:
    """Every rank's host and device, in rank order. A collective when there is a process group."""
    return comm.all_gather_object(_placement(ctx))


def _command_line() -> str:
    """The command as typed: `python -m distribuuuu ...` shows as such, not as .../__main__.py."""
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    if prog == "__main__.py":
        prog = "python -m " + os.path.basename(os.path.dirname(os.path.abspath(sys.argv[0])))
    return " ".join([prog, shlex.join(sys.argv[1:])]).strip()


def env_record(cfg: CfgNode, ctx: DistContext, placements: list[dict[str, Any]],
               seed: int | None = None) -> dict[str, Any]:
    """The facts of this start of the run (a resumed run records its new start)."""
    cuda = torch.version.cuda if torch.cuda.is_available() else None
    return {
        "start_time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "seed": seed, "rng_seed_given": cfg.RNG_SEED is not None,
        "command": _command_line(),
        "argv": list(sys.argv), "cwd": os.getcwd(), "executable": sys.executable,
        "out_dir": os.path.abspath(cfg.OUT_DIR),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "torchvision": _version("torchvision"), "timm": _version("timm"),
                     "numpy": _version("numpy"), "cuda": cuda,
                     "cudnn": torch.backends.cudnn.version() if cuda else None},
        "git": git_commit(),
        "launcher": ctx.launcher, "world_size": ctx.world_size, "backend": ctx.backend,
        "master": f"{ctx.master_addr}:{ctx.master_port}" if ctx.distributed else None,
        "hosts": sorted({p["host"] for p in placements}), "ranks": placements,
        "devices": [p["device"] for p in placements], "num_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def count_flops(model: torch.nn.Module, input_shape: tuple[int, ...]) -> int:
    """FLOPs of one forward pass on a zero batch of input_shape (torch.utils.flop_counter counts
    a multiply-add as 2). Runs in eval mode under no_grad on the model's device, then restores
    every module's train/eval flag: eval-mode BatchNorm reads its running statistics and changes
    nothing, and no random numbers are drawn, so the run that follows is unaffected."""
    from torch.utils.flop_counter import FlopCounterMode

    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.zeros(input_shape, device=device))
    finally:
        for m, training in modes.items():
            m.training = training
    return int(counter.get_total_flops())


def _human(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def model_table(model: torch.nn.Module, cfg: CfgNode) -> str:
    """model.txt: one row per parameter, then totals, size and FLOPs."""
    rows = [(name, "(" + ", ".join(str(s) for s in p.shape) + ")", p.numel(), p.requires_grad)
            for name, p in model.named_parameters()]
    wn = max([len(r[0]) for r in rows] + [4])
    ws = max([len(r[1]) for r in rows] + [5])
    lines = [f"{cfg.MODEL.ARCH} ({type(model).__module__}.{type(model).__name__}), "
             f"{cfg.MODEL.NUM_CLASSES} classes", "",
             f"{'name':<{wn}}  {'shape':<{ws}}  {'params':>12}  trainable"]
    lines.append("-" * len(lines[-1]))
    lines += [f"{n:<{wn}}  {s:<{ws}}  {c:>12,}  {'yes' if g else 'no'}" for n, s, c, g in rows]
    total = sum(r[2] for r in rows)
    trainable = sum(r[2] for r in rows if r[3])
    buffers = sum(b.numel() for b in model.buffers())
    size = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    shape = (1, cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE, cfg.TRAIN.IM_SIZE)
    try:
        flops = count_flops(model, shape)
        flop_line = (f"FLOPs:      {_human(flops)} per image of {shape[1]}x{shape[2]}x{shape[3]} "
                     f"({_human(flops / 2)} multiply-adds; torch.utils.flop_counter)")
    except Exception as e:  # noqa: BLE001 - a model the counter cannot trace still trains
        flop_line = f"FLOPs:      not counted ({type(e).__name__}: {e})"
    lines += ["", f"parameters: {total:,} ({trainable:,} trainable) in {len(rows)} tensors",
              f"buffers:    {buffers:,} values (e.g. BatchNorm running statistics)",
              f"size:       {size / 2**20:.2f} MB (parameters and buffers as stored)", flop_line]
    return "\n".join(lines) + "\n"


def previous_seed(cfg: CfgNode) -> int | None:
    """With RNG_SEED None, the seed of the run that TRAIN.AUTO_RESUME will continue (from its
    env.json), so the resumed run shuffles as it began; None for a fresh run or a given RNG_SEED."""
    ckpt_dir = checkpoint_dir(cfg.OUT_DIR)
    if cfg.RNG_SEED is not None or not cfg.TRAIN.AUTO_RESUME or not os.path.isdir(ckpt_dir):
        return None
    if not any(name.endswith(".pth") for name in os.listdir(ckpt_dir)):
        return None
    try:
        with open(os.path.join(cfg.OUT_DIR, ENV)) as f:
            seed = json.load(f).get("seed")
    except (OSError, ValueError, AttributeError):
        return None  # the checkpoint's own seed is applied on resume (engine.trainer)
    return seed if isinstance(seed, int) else None


def prepare_run_record(cfg: CfgNode, ctx: DistContext, model: torch.nn.Module) -> dict[str, Any] | None:
    """What write_run_record writes, taken now and written nothing yet: a run refused later (resume
    checks) leaves OUT_DIR as it was. Call on ALL ranks (host names are gathered); model is the bare
    module, before sharding (models.unwrap). Rank 0 gets the record, the others None."""
    placements = gather_placements(ctx)
    if not ctx.is_main:
        return None
    return {"env": env_record(cfg, ctx, placements, None), "model": model_table(model, cfg)}


def write_run_record(cfg: CfgNode, prepared: dict[str, Any] | None, seed: int | None = None) -> None:
    """Once every check has passed: config.yaml and config_diff.yaml, env.json, a line appended to
    env_history.jsonl, model.txt, and log.txt with the lines held so far (logger.release_log).
    prepared: prepare_run_record's (None on ranks other than 0, which write log.txt only)."""
    from distribuuuu import config  # config imports the model registry, which imports this module's users
    from distribuuuu.logger import release_log

    if prepared is not None:
        os.makedirs(cfg.OUT_DIR, exist_ok=True)
        config.dump_to_run_folder(cfg, cfg.OUT_DIR)
        record = {**prepared["env"], "seed": seed}
        with open(os.path.join(cfg.OUT_DIR, ENV), "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
        with open(os.path.join(cfg.OUT_DIR, ENV_HISTORY), "a") as f:  # one line per start, never rewritten
            f.write(json.dumps(record) + "\n")
        table = prepared["model"]
        with open(os.path.join(cfg.OUT_DIR, MODEL_TABLE), "w") as f:
            f.write(table)
        log.info("run record: env.json, model.txt (%s)", table.rstrip().splitlines()[-1].strip())
    release_log()

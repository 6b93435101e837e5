"""What the run folder records about a run: the config it ran with, what
ran where, and the model.

OUT_DIR/env.json: library versions, the git commit of the code, every
rank's host and device, world size, backend, launcher, start time,
command line and the run's seed, of the latest start (one JSON object:
tools read it); env_history.jsonl gets the same object as one line at
every start, so a resumed run keeps the record of each of its starts.
model.txt: a per-parameter table (name, shape, count), the totals, the
size in MB and the FLOPs of one image at TRAIN.IM_SIZE. config.yaml
(CFG_DEST) and config_diff.yaml: the whole config, and the keys that
differ from the defaults.

RunFolder.prepare_record gathers these (a collective: every rank's host)
and RunFolder.write_record writes them, each file atomically, once the
run has passed every check: a refused run changes nothing.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from typing import Any

import torch
import yaml
from yacs.config import CfgNode

from distribuuuu import config
from distribuuuu.launch.comm import DistContext

ENV, ENV_HISTORY, MODEL_TABLE = "env.json", "env_history.jsonl", "model.txt"


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def git_commit(path: str | None = None) -> dict[str, Any] | None:
    """{"commit", "dirty"} of the git checkout holding path (the package
    by default), or None."""
    path = path or os.path.dirname(os.path.abspath(__file__))
    try:  # one call: "# branch.oid <commit>", then a line per changed tracked file
        lines = subprocess.run(
            ["git", "-C", path, "status", "--porcelain=v2", "--branch", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.splitlines()
    except (
        OSError,
        subprocess.SubprocessError,
    ):  # no git, or not a checkout (an installed package)
        return None
    commit = next((ln.split()[2] for ln in lines if ln.startswith("# branch.oid ")), "(initial)")
    if commit == "(initial)":  # a repository without a commit yet
        return None
    return {"commit": commit, "dirty": any(not ln.startswith("#") for ln in lines)}


def _cpu_name() -> str:
    try:  # Linux: platform.processor() is often empty there
        with open("/proc/cpuinfo") as f:
            return next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def placement(ctx: DistContext) -> dict[str, Any]:
    """This rank's host and device (prepare_record gathers every
    rank's)."""
    name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else _cpu_name()
    return {
        "rank": ctx.rank,
        "local_rank": ctx.local_rank,
        "node_rank": ctx.node_rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(ctx.device),
        "device_name": name,
    }


def _command_line() -> str:
    """The command as typed: `python -m distribuuuu ...` shows as such,
    not as .../__main__.py."""
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    if prog == "__main__.py":
        prog = "python -m " + os.path.basename(os.path.dirname(os.path.abspath(sys.argv[0])))
    return " ".join([prog, shlex.join(sys.argv[1:])]).strip()


def env_record(cfg: CfgNode, ctx: DistContext, placements: list[dict[str, Any]]) -> dict[str, Any]:
    """The facts of this start of the run (a resumed run records its new
    start); the seed is added when it is written."""
    cuda = torch.version.cuda if torch.cuda.is_available() else None
    return {
        "start_time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "seed": None,
        "rng_seed_given": cfg.RNG_SEED is not None,
        "command": _command_line(),
        "argv": list(sys.argv),
        "cwd": os.getcwd(),
        "executable": sys.executable,
        "out_dir": os.path.abspath(cfg.OUT_DIR),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            **{name: _version(name) for name in ("torchvision", "timm", "numpy")},
            "cuda": cuda,
            "cudnn": torch.backends.cudnn.version() if cuda else None,
        },
        "git": git_commit(),
        "launcher": ctx.launcher,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "master": f"{ctx.master_addr}:{ctx.master_port}" if ctx.distributed else None,
        "hosts": sorted({p["host"] for p in placements}),
        "ranks": placements,
        "devices": [p["device"] for p in placements],
        "num_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def count_flops(model: torch.nn.Module, input_shape: tuple[int, ...]) -> int:
    """FLOPs of one forward pass on a zero batch of input_shape
    (torch.utils.flop_counter counts a multiply-add as 2). Runs in eval
    mode under no_grad on the model's device, then restores every
    module's train/eval flag: eval-mode BatchNorm reads its running
    statistics and changes nothing, and no random numbers are drawn, so
    the run that follows is unaffected."""
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
    rows = [
        (name, "(" + ", ".join(str(s) for s in p.shape) + ")", p.numel(), p.requires_grad)
        for name, p in model.named_parameters()
    ]
    wn = max([len(r[0]) for r in rows] + [4])
    ws = max([len(r[1]) for r in rows] + [5])
    lines = [
        f"{cfg.MODEL.ARCH} ({type(model).__module__}.{type(model).__name__}), "
        f"{cfg.MODEL.NUM_CLASSES} classes",
        "",
        f"{'name':<{wn}}  {'shape':<{ws}}  {'params':>12}  trainable",
    ]
    lines.append("-" * len(lines[-1]))
    lines += [f"{n:<{wn}}  {s:<{ws}}  {c:>12,}  {'yes' if g else 'no'}" for n, s, c, g in rows]
    total, trainable = sum(r[2] for r in rows), sum(r[2] for r in rows if r[3])
    buffers = sum(b.numel() for b in model.buffers())
    size = sum(
        t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())
    )
    shape = (1, cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE, cfg.TRAIN.IM_SIZE)
    try:
        flops = count_flops(model, shape)
        flop_line = (
            f"FLOPs:      {_human(flops)} per image of {shape[1]}x{shape[2]}x{shape[3]} "
            f"({_human(flops / 2)} multiply-adds; torch.utils.flop_counter)"
        )
    except Exception as e:  # noqa: BLE001 - a model the counter cannot trace still trains
        flop_line = f"FLOPs:      not counted ({type(e).__name__}: {e})"
    lines += [
        "",
        f"parameters: {total:,} ({trainable:,} trainable) in {len(rows)} tensors",
        f"buffers:    {buffers:,} values (e.g. BatchNorm running statistics)",
        f"size:       {size / 2**20:.2f} MB (parameters and buffers as stored)",
        flop_line,
    ]
    return "\n".join(lines) + "\n"


def config_diff(cfg: CfgNode) -> str:
    """config_diff.yaml: the keys whose value differs from the default,
    nested as in config.yaml."""
    nested: dict[str, Any] = {}
    for key, value in config.diff_from_defaults(
        cfg
    ).items():  # "OPTIM.BASE_LR" -> nested["OPTIM"]["BASE_LR"]
        *parents, leaf = key.split(".")
        functools.reduce(lambda node, part: node.setdefault(part, {}), parents, nested)[leaf] = (
            value
        )
    return yaml.safe_dump(nested, sort_keys=True)


def recorded_seed(out_dir: str) -> int | None:
    """The seed in OUT_DIR/env.json, or None when it cannot be read (the
    checkpoint's own seed is then applied on resume: engine.trainer)."""
    try:
        with open(os.path.join(out_dir, ENV)) as f:
            seed = json.load(f).get("seed")
    except (OSError, ValueError, AttributeError):
        return None
    return seed if isinstance(seed, int) else None

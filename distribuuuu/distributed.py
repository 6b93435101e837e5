"""Everything about launchers, process groups and devices, in one place.

No other module reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` or ``SLURM_*``: they call
``setup(cfg)`` (or ``session(cfg)``) once and use the returned ``DistContext``, or the small
rank helpers below, which work unchanged (rank 0 of 1) when no process group exists.

How ``detect()`` decides who started us (first match wins):

1. ``launch``: argv holds ``--local-rank``/``--local_rank`` (``=N`` or ``N``) and the environment
   holds ``RANK`` and ``WORLD_SIZE``: the legacy ``python -m torch.distributed.launch``. It passes
   the local rank on the command line; ``LOCAL_RANK`` may be missing from the environment (no
   ``--use-env``), so the argv value is used. A ``--local-rank`` without ``RANK`` is ignored.
2. ``spawn``: ``DISTRIBUUUU_LAUNCHER=spawn``, set with the other variables by our ``spawn()``.
3. ``torchrun``: ``RANK`` and ``WORLD_SIZE`` are set (torchrun also sets ``LOCAL_RANK``,
   ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``/``MASTER_PORT``). This wins over Slurm:
   ``srun torchrun ...`` runs one agent per node and the workers must follow torchrun.
4. ``slurm``: ``SLURM_PROCID`` is set AND we are a task of a job step started by ``srun``
   (``SLURM_STEP_ID``/``SLURM_STEPID`` holds a real step number and ``SLURM_STEP_NUM_TASKS`` is set).
   A bare ``python train.py`` in an sbatch script (the batch step) also sees ``SLURM_PROCID=0``
   and ``SLURM_NTASKS=8``; treating it as rank 0 of 8 would hang forever, so it is ``plain``.
   rank = ``SLURM_PROCID``, world = ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``), local rank =
   ``SLURM_LOCALID``, node = ``SLURM_NODEID``, processes on this node from
   ``SLURM_STEP_TASKS_PER_NODE`` (else ``SLURM_TASKS_PER_NODE``, ``SLURM_NTASKS_PER_NODE``).
   Master: ``MASTER_ADDR`` if set, else the first host of the step's node list. Port:
   ``MASTER_PORT`` if set, else ``10000 + SLURM_JOB_ID % 20000``, so that two jobs sharing a node
   do not fight over one port (two concurrent steps of ONE job still need ``MASTER_PORT``).
   Use ``srun --kill-on-bad-exit=1`` so that one failing task stops the others at once.
5. ``plain``: rank 0 of 1, no process group.

Every value read is checked: a non-integer or inconsistent value (``RANK=4`` with
``WORLD_SIZE=4``) raises ``UserError`` naming the variable. The legacy launcher appends
``--local-rank=N`` to the script's arguments: argument parsers drop it with ``strip_local_rank_args``.

What ``setup(cfg)`` chooses, once per process:

- device: ``DEVICE auto`` is ``cuda:<local_rank>`` when CUDA is available, else CPU. With fewer
  visible GPUs than processes on the node, only Slurm's ``--gpus-per-task`` (each task sees its own
  GPUs) is right: ``cuda:0`` then; anything else is a UserError (two ranks would share a GPU).
- backend: ``DIST.BACKEND auto`` is nccl on CUDA, gloo on CPU.
- intra-op threads: ``NUM_THREADS`` if > 0; else an ``OMP_NUM_THREADS`` already in the environment
  (torchrun sets 1 for several processes per node); else the usable cores / processes on the node.
- cuDNN: ``CUDNN.BENCHMARK`` unless ``CUDNN.DETERMINISTIC``, which also turns on
  ``torch.use_deterministic_algorithms(True, warn_only=True)``; TF32 for float32 matmuls and
  convolutions as ``CUDNN.TF32`` says (on by default).
- the process group (``env://``), only with more than one process.
- stop signals: from then on, SIGINT (Ctrl-C) and SIGTERM unwind the process cleanly and exit
  with 130 / 143 (``handle_stop_signals``); ``teardown()`` puts the old handlers back.
"""

from __future__ import annotations

import datetime
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from distribuuuu.errors import USER_ERROR_EXIT, UserError

LAUNCHERS = ("plain", "torchrun", "launch", "slurm", "spawn")
LOCAL_RANK_FLAGS = ("--local-rank", "--local_rank")
SPAWN_MASTER_ADDR = "127.0.0.1"
# Step ids >= this are Slurm's special steps (batch script, extern, interactive, pending);
# srun's own steps count up from 0. Older Slurm versions write "batch"/"extern" instead.
_SLURM_SPECIAL_STEP_ID = 0xFFFFFFF0


# ---------------------------------------------------------------------------------------------
# Detection: a pure function of (environ, argv)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher told this process."""

    launcher: str  # one of LAUNCHERS
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    """Read an integer variable; a missing one without default, or a non-integer, is a UserError."""
    if name not in env:
        if default is None:
            raise UserError(f"environment variable {name} is not set, but the launcher should have set it")
        return default
    value = env[name]
    try:
        return int(value.strip())
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def _argv_local_rank(argv: Sequence[str]) -> int | None:
    """The value of --local-rank/--local_rank in argv (either `--flag=N` or `--flag N`), or None."""
    for i, arg in enumerate(argv):
        for flag in LOCAL_RANK_FLAGS:
            if arg == flag:
                if i + 1 >= len(argv):
                    raise UserError(f"{flag} is given without a value")
                value = argv[i + 1]
            elif arg.startswith(flag + "="):
                value = arg[len(flag) + 1 :]
            else:
                continue
            try:
                return int(value)
            except ValueError:
                raise UserError(f"{flag} {value!r} is not an integer") from None
    return None


def strip_local_rank_args(argv: Sequence[str]) -> list[str]:
    """argv without the --local-rank/--local_rank option the legacy launcher appends."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in LOCAL_RANK_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in LOCAL_RANK_FLAGS)):
            out.append(arg)
    return out


def _master(env: Mapping[str, str], world_size: int, who: str) -> tuple[str, int]:
    """MASTER_ADDR/MASTER_PORT as set by torchrun, launch or spawn (required with > 1 process)."""
    if world_size > 1 and ("MASTER_ADDR" not in env or "MASTER_PORT" not in env):
        raise UserError(f"{who} started {world_size} processes but MASTER_ADDR/MASTER_PORT are not both set")
    return env.get("MASTER_ADDR", SPAWN_MASTER_ADDR), _int(env, "MASTER_PORT", 0)


def _from_rank_env(launcher: str, env: Mapping[str, str], local_rank: int | None = None) -> LaunchInfo:
    """torchrun, legacy launch and spawn all speak the same RANK/WORLD_SIZE/... dialect."""
    rank, world_size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if local_rank is None:
        if "LOCAL_RANK" not in env and world_size > 1:
            raise UserError(
                f"RANK and WORLD_SIZE are set but LOCAL_RANK is not (launcher {launcher}); "
                "set LOCAL_RANK too, or start the processes with torchrun"
            )
        local_rank = _int(env, "LOCAL_RANK", 0)
    elif "LOCAL_RANK" in env and _int(env, "LOCAL_RANK") != local_rank:
        raise UserError(f"LOCAL_RANK={env['LOCAL_RANK']} disagrees with --local-rank {local_rank}")
    # Missing LOCAL_WORLD_SIZE (torch 1.x launch): assume one node; it only sizes thread pools.
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", world_size)
    node_var = "GROUP_RANK" if "GROUP_RANK" in env else "NODE_RANK"
    node_rank = _int(env, node_var, rank // max(local_world_size, 1))
    addr, port = _master(env, world_size, launcher)
    return LaunchInfo(launcher, rank, local_rank, world_size, local_world_size, node_rank, addr, port)


def _is_srun_step(env: Mapping[str, str]) -> bool:
    """True in a task of a step started by srun; False in the sbatch batch step or a salloc shell."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if step is None or "SLURM_STEP_NUM_TASKS" not in env:
        return False
    try:
        return int(step) < _SLURM_SPECIAL_STEP_ID
    except ValueError:
        return False  # "batch", "extern", "interactive"


def _slurm_local_world_size(env: Mapping[str, str], node_rank: int) -> int:
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if name in env:
            counts = parse_tasks_per_node(env[name])
            if node_rank >= len(counts):
                raise UserError(f"SLURM_NODEID={node_rank} is out of range for {name}={env[name]!r}")
            return counts[node_rank]
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int(env, "SLURM_NTASKS_PER_NODE")
    raise UserError("cannot tell how many Slurm tasks run on this node: SLURM_STEP_TASKS_PER_NODE is not set")


def _slurm_master_addr(env: Mapping[str, str]) -> str:
    if "MASTER_ADDR" in env:
        return env["MASTER_ADDR"]
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if name in env:
            try:
                return parse_hostlist(env[name])[0]
            except UserError:
                # A hostlist form we do not parse: ask Slurm itself (the only impure path here).
                try:
                    out = subprocess.run(["scontrol", "show", "hostnames", env[name]],
                                         capture_output=True, text=True, check=True, timeout=30)
                    return out.stdout.split()[0]
                except (OSError, subprocess.SubprocessError, IndexError):
                    raise UserError(
                        f"cannot read the master host from {name}={env[name]!r}; set MASTER_ADDR"
                    ) from None
    raise UserError("cannot find the master host: no SLURM_STEP_NODELIST / SLURM_JOB_NODELIST; set MASTER_ADDR")


def _from_slurm(env: Mapping[str, str]) -> LaunchInfo:
    rank = _int(env, "SLURM_PROCID")
    world_size = _int(env, "SLURM_STEP_NUM_TASKS") if "SLURM_STEP_NUM_TASKS" in env else _int(env, "SLURM_NTASKS")
    local_rank, node_rank = _int(env, "SLURM_LOCALID"), _int(env, "SLURM_NODEID")
    local_world_size = _slurm_local_world_size(env, node_rank)
    addr = _slurm_master_addr(env)
    if "MASTER_PORT" in env:
        port = _int(env, "MASTER_PORT")
    else:
        job = env.get("SLURM_JOB_ID", env.get("SLURM_JOBID"))
        if job is None:
            raise UserError("SLURM_JOB_ID is not set, so no master port can be derived; set MASTER_PORT")
        port = 10000 + _int({"SLURM_JOB_ID": job}, "SLURM_JOB_ID") % 20000
    return LaunchInfo("slurm", rank, local_rank, world_size, local_world_size, node_rank, addr, port)


def _validate(info: LaunchInfo) -> LaunchInfo:
    """Catch inconsistent launcher variables here, not as a hang in init_process_group."""
    names = {  # the variable each field came from, for the message
        "slurm": ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID"),
    }.get(info.launcher, ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"))
    rank_n, local_n, world_n, local_world_n, node_n = names
    checks = [
        (info.world_size >= 1, f"{world_n}={info.world_size} must be >= 1"),
        (0 <= info.rank < info.world_size, f"{rank_n}={info.rank} must be in [0, {world_n}={info.world_size})"),
        (info.local_world_size >= 1, f"{local_world_n}={info.local_world_size} must be >= 1"),
        (0 <= info.local_rank < info.local_world_size,
         f"{local_n}={info.local_rank} must be in [0, {local_world_n}={info.local_world_size})"),
        (info.local_world_size <= info.world_size,
         f"{local_world_n}={info.local_world_size} exceeds {world_n}={info.world_size}"),
        (info.node_rank >= 0, f"{node_n}={info.node_rank} must be >= 0"),
        (0 <= info.master_port < 65536, f"MASTER_PORT={info.master_port} must be in [0, 65535]"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UserError(f"bad {info.launcher} launch: {msg}")
    return info


def detect(environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> LaunchInfo:
    """Who started this process, and where it sits (rules in the module docstring)."""
    env = os.environ if environ is None else environ
    argv = sys.argv if argv is None else argv
    has_rank_env = "RANK" in env and "WORLD_SIZE" in env
    argv_local_rank = _argv_local_rank(argv)
    if argv_local_rank is not None and has_rank_env:
        info = _from_rank_env("launch", env, local_rank=argv_local_rank)
    elif env.get("DISTRIBUUUU_LAUNCHER") == "spawn":
        info = _from_rank_env("spawn", env)
    elif has_rank_env:
        info = _from_rank_env("torchrun", env)
    elif "SLURM_PROCID" in env and _is_srun_step(env):
        info = _from_slurm(env)
    else:
        info = LaunchInfo("plain", 0, 0, 1, 1, 0, SPAWN_MASTER_ADDR, 0)
    return _validate(info)


# ---------------------------------------------------------------------------------------------
# Slurm's compact notations
# ---------------------------------------------------------------------------------------------


def _split_top_level(spec: str) -> list[str]:
    """Split on commas outside brackets: "a[1,3],b" -> ["a[1,3]", "b"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise UserError(f"hostlist {spec!r}: nested brackets are not valid")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise UserError(f"hostlist {spec!r}: ']' without '['")
        elif ch == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    if depth:
        raise UserError(f"hostlist {spec!r}: '[' without ']'")
    parts.append(spec[start:])
    return parts


def _expand_brackets(body: str, spec: str) -> list[str]:
    """ "01-03,07" -> ["01", "02", "03", "07"]; the width of the low end sets the zero padding."""
    out: list[str] = []
    for item in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not m:
            raise UserError(f"hostlist {spec!r}: bad range {item!r} in [{body}]")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise UserError(f"hostlist {spec!r}: range {item!r} runs backwards")
        out.extend(f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1))
    return out


def parse_hostlist(spec: str) -> list[str]:
    """Expand a Slurm hostlist: "node[01-04,07],gpu2" -> node01..node04, node07, gpu2.

    Zero padding is kept ("n[08-11]" -> n08, n09, n10, n11). Several bracket groups in one name
    give every combination in order ("r[1-2]n[3-4]" -> r1n3, r1n4, r2n3, r2n4), as scontrol does.
    Anything else (nested brackets, empty names, backward ranges) raises UserError.
    """
    hosts: list[str] = []
    for part in _split_top_level(spec.strip()):
        part = part.strip()
        if not part:
            raise UserError(f"hostlist {spec!r} has an empty host name")
        # Alternate literal text and bracket bodies: "r", "1-2", "n", "3-4", "".
        pieces = re.split(r"\[([^\]]*)\]", part)
        choices = [[p] if i % 2 == 0 else _expand_brackets(p, spec) for i, p in enumerate(pieces)]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def parse_tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's tasks-per-node notation: "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in spec.strip().split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise UserError(f"tasks-per-node {spec!r}: cannot read {item!r} (expected N or N(xM))")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


# ---------------------------------------------------------------------------------------------
# Setup and teardown
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DistContext:
    """The launch, plus the device and backend this process uses."""

    info: LaunchInfo
    device: torch.device
    backend: str  # the backend of the process group ("nccl"/"gloo"); chosen even for one process

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def local_rank(self) -> int:
        return self.info.local_rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def local_world_size(self) -> int:
        return self.info.local_world_size

    @property
    def is_main(self) -> bool:
        return self.info.rank == 0

    @property
    def distributed(self) -> bool:
        return self.info.world_size > 1


def _choose_device(cfg: Any, info: LaunchInfo) -> torch.device:
    want = cfg.DEVICE
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("DEVICE is cuda but no CUDA GPU is visible to this process; use DEVICE cpu or auto")
    count = torch.cuda.device_count()
    if info.local_world_size <= count:  # every process of the node sees every GPU: one each
        return torch.device("cuda", info.local_rank)
    # Fewer visible GPUs than processes on the node is right only when srun gave each task its
    # own GPUs (--gpus-per-task: CUDA_VISIBLE_DEVICES differs per task); otherwise two processes
    # would share a GPU and NCCL stops with "Duplicate GPU detected".
    if info.launcher == "slurm" and os.environ.get("SLURM_GPUS_PER_TASK"):
        return torch.device("cuda", 0)  # the first of this task's own GPUs
    hint = ("request as many GPUs as tasks per node (--gres gpu:N with --ntasks-per-node N) or bind one "
            "GPU per task (srun --gpus-per-task=1)" if info.launcher == "slurm"
            else "start at most one process per GPU")
    raise UserError(
        f"{info.local_world_size} processes on this node but only {count} GPU(s) visible to each, so two "
        f"would share a GPU; {hint}, or use DEVICE cpu"
    )


def _choose_backend(cfg: Any, device: torch.device) -> str:
    backend = cfg.DIST.BACKEND
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise UserError("DIST.BACKEND nccl needs CUDA GPUs, but this run uses the CPU; use DIST.BACKEND gloo or auto")
    return backend


def _num_threads(cfg: Any, info: LaunchInfo) -> int | None:
    """Intra-op threads for this process, or None to keep what torch read from OMP_NUM_THREADS.

    Order: cfg.NUM_THREADS > 0 wins; else an explicit OMP_NUM_THREADS is kept (torchrun sets it
    to 1 when it starts several processes per node and prints so; NUM_THREADS overrides it);
    else the cores this process may use, split evenly between the processes on the node.
    """
    if cfg.NUM_THREADS > 0:
        return cfg.NUM_THREADS
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    # sched_getaffinity respects cgroups/cpusets of Slurm or containers; cpu_count does not.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if info.launcher == "slurm" and os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return max(1, min(cores, int(os.environ["SLURM_CPUS_PER_TASK"])))
    return max(1, cores // info.local_world_size)


def _set_cudnn(cfg: Any) -> None:
    deterministic = bool(cfg.CUDNN.DETERMINISTIC)
    if deterministic:
        # cuBLAS needs this before its first call to be deterministic; a user's value is kept.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = bool(cfg.CUDNN.BENCHMARK) and not deterministic
    torch.backends.cudnn.deterministic = deterministic
    # TF32 (Ampere and newer): float32 matmuls and convolutions on tensor cores with a 10-bit mantissa.
    # The legacy flags, on purpose: after torch 2.14's fp32_precision setters, reading a legacy flag
    # raises, and torch.compile's dynamo still reads one; the new getters follow the legacy flags.
    torch.backends.cuda.matmul.allow_tf32 = bool(cfg.CUDNN.TF32)
    torch.backends.cudnn.allow_tf32 = bool(cfg.CUDNN.TF32)
    # warn_only: ops without a deterministic kernel warn instead of stopping the run. Called only
    # on a change: the first call imports parts of torch that cost seconds at every start.
    if deterministic != torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
    elif deterministic and not torch.is_deterministic_algorithms_warn_only_enabled():
        torch.use_deterministic_algorithms(True, warn_only=True)


def _is_addr_in_use(err: BaseException) -> bool:
    text = str(err).lower()
    return "address already in use" in text or "eaddrinuse" in text


_groups_made = 0  # process groups this process has created (all ranks create them in step)
# A gloo group beside an nccl one, for any_rank(): its CPU all-reduce does not wait for the GPU
# queue, so a per-step decision costs no host-device sync. None when the main group is gloo.
_control_group: Any = None


def gloo_side_group(timeout: datetime.timedelta) -> Any:
    """Collective: a gloo group of all ranks for any_rank() beside an nccl main group.

    With the main group's timeout (DIST.TIMEOUT_S; torch's default for a gloo group is 30 minutes),
    so that a vote with a dead or hung rank fails as soon as an nccl collective would. Gloo finds
    its network interface from the hostname: where that resolves to a loopback address, set
    GLOO_SOCKET_IFNAME as NCCL_SOCKET_IFNAME (docs/launching.md).
    """
    return dist.new_group(backend="gloo", timeout=timeout)


def _group_backend(cfg: Any, backend: str) -> str:
    """The backend string of the default group: under nccl with FSDP CPU offload the gradients,
    their norm (clipping) and the non-finite vote are CPU tensors, which nccl cannot reduce
    ("No backend type associated with device type cpu"): gloo takes the CPU tensors then."""
    if backend == "nccl" and cfg.DIST.STRATEGY == "fsdp" and cfg.DIST.CPU_OFFLOAD:
        return "cpu:gloo,cuda:nccl"
    return backend


def _init_process_group(info: LaunchInfo, backend: str, device: torch.device, timeout_s: float,
                        group_backend: str | None = None) -> None:
    if not dist.is_available():
        raise UserError("this PyTorch build has no torch.distributed; run a single process")
    if dist.is_initialized():
        raise RuntimeError("a process group already exists; call distributed.teardown() before setup() again")
    if info.launcher in ("slurm", "spawn"):
        # init_method="env://" reads these; torchrun and launch have set them already.
        os.environ.update(
            MASTER_ADDR=info.master_addr, MASTER_PORT=str(info.master_port), RANK=str(info.rank),
            WORLD_SIZE=str(info.world_size), LOCAL_RANK=str(info.local_rank),
            LOCAL_WORLD_SIZE=str(info.local_world_size),
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        # The env:// store, with keys private to this restart: after torchrun --max-restarts
        # restarts the workers, the store still holds the dead workers' gloo addresses, and
        # connecting to those fails ("connectFullMesh ... Connection refused"). The same holds
        # for a second group in one process when the store outlives the first (torchrun's and
        # our spawner's store live in the launcher): hence the count of groups made here.
        global _groups_made
        store, _, _ = next(dist.rendezvous("env://", info.rank, info.world_size, timeout=timeout))
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = f"distribuuuu/restart{restart}/group{_groups_made}"
        _groups_made += 1
        dist.init_process_group(
            backend=group_backend or backend, store=dist.PrefixStore(prefix, store),
            rank=info.rank, world_size=info.world_size, timeout=timeout,
            device_id=device if backend == "nccl" else None,  # binds NCCL to our GPU eagerly
        )
        if backend == "nccl":
            global _control_group
            _control_group = gloo_side_group(timeout)
    except (dist.DistNetworkError, RuntimeError) as e:
        if _is_addr_in_use(e):
            raise UserError(
                f"master port {info.master_port} on {info.master_addr} is already in use; "
                "pick another with MASTER_PORT=... or --master-port ..."
            ) from None
        raise


def setup(cfg: Any) -> DistContext:
    """Detect the launch, pick device/backend/threads/cuDNN flags, join the process group.

    The process group is created only with more than one process. Prints one ``[dist]`` line
    per process. With Slurm and spawn it exports MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK
    to os.environ first (init_method env:// reads them).
    """
    info = detect()
    device = _choose_device(cfg, info)
    backend = _choose_backend(cfg, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    threads = _num_threads(cfg, info)
    if threads is not None:
        torch.set_num_threads(threads)
    _set_cudnn(cfg)
    if info.world_size > 1:
        _init_process_group(info, backend, device, cfg.DIST.TIMEOUT_S, _group_backend(cfg, backend))
    master = f"{info.master_addr}:{info.master_port}" if info.world_size > 1 else "-"
    # One write of the whole line: print() writes the text and the newline apart, so the ranks'
    # lines could interleave in a shared output file (seen in Slurm job logs).
    sys.stdout.write(
        f"[dist] rank {info.rank}/{info.world_size} | local rank {info.local_rank}/{info.local_world_size} "
        f"| node {info.node_rank} | master {master} | device {device} "
        f"| backend {backend if info.world_size > 1 else '-'} | launcher {info.launcher}\n")
    sys.stdout.flush()
    # Only now: until the group exists a signal may end the process at once (nothing to clean
    # up), and a Python handler could not run while init_process_group blocks in C++ anyway.
    handle_stop_signals()
    return DistContext(info, device, backend)


def teardown() -> None:
    """Destroy the process group if there is one, restore the signal handlers setup() replaced.

    Safe to call twice or without setup().
    """
    global _control_group
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _control_group = None
    restore_signal_handlers()


@contextmanager
def session(cfg: Any) -> Iterator[DistContext]:
    """``with session(cfg) as ctx:`` setup, and teardown on any exit (error, Ctrl-C, SIGTERM too)."""
    ctx = setup(cfg)
    try:
        yield ctx
    finally:
        try:
            teardown()
        except KeyboardInterrupt:  # the stop signal landed in this cleanup: finish it, then go on
            teardown()
            raise


# ---------------------------------------------------------------------------------------------
# Stop signals: Ctrl-C (SIGINT) and SIGTERM end a process the same, clean way
# ---------------------------------------------------------------------------------------------


class Terminated(KeyboardInterrupt):
    """SIGTERM as an exception. A KeyboardInterrupt, so it unwinds exactly like Ctrl-C."""

    signum = signal.SIGTERM


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_stopping: int | None = None  # the stop signal this process is ending for, if any
_saved_handlers: dict[int, Any] = {}


def _on_stop_signal(signum: int, frame: Any) -> None:
    global _stopping
    if _stopping is not None:
        return  # already on the way out: a second exception would cut the cleanup short
    _stopping = signum
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def handle_stop_signals() -> None:
    """Make SIGINT and SIGTERM stop this process cleanly. Called by setup() and spawn().

    The policy, in one place:

    - The first SIGINT or SIGTERM raises in the main thread: KeyboardInterrupt for SIGINT (what
      Python does anyway), ``Terminated`` (a KeyboardInterrupt) for SIGTERM. Both unwind through
      the same code: ``session()`` destroys the process group, the CLI prints one line and exits
      with 128 + the signal number: 130 for SIGINT, 143 for SIGTERM. The spawner first passes
      the same signal to its children and waits for them (``STOP_GRACE_S``); its children run
      in sessions of their own (as torchrun's do), so a signal to the job's process group
      reaches them once, through the spawner, exactly like a signal to the spawner's pid.
    - Later SIGINT/SIGTERM are ignored while the process winds down: under other launchers a
      terminal's Ctrl-C may reach every process and the launcher then forwards its own. Launchers
      follow up with SIGKILL when a process does not exit in time (torchrun and spawn: 30 s).
    - A signal that was already ignored (``nohup``, ``cmd &`` in a script) stays ignored.

    During ``engine.fit``, ``faults.preemption_signals`` takes over the signals named in
    TRAIN.PREEMPT_SIGNALS (SIGTERM by default): they first write a checkpoint at the next step,
    then end the run with the same status; a second one comes back here.
    """
    global _stopping
    if threading.current_thread() is not threading.main_thread():
        return  # Python delivers signals to the main thread only
    _stopping = None
    for signum in STOP_SIGNALS:
        previous = signal.getsignal(signum)
        if previous is signal.SIG_IGN or previous is _on_stop_signal:
            continue
        _saved_handlers[signum] = previous
        signal.signal(signum, _on_stop_signal)


def restore_signal_handlers() -> None:
    """Put back the handlers handle_stop_signals() replaced; kept while a stop is under way."""
    if _stopping is not None or threading.current_thread() is not threading.main_thread():
        return
    for signum, previous in list(_saved_handlers.items()):
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        del _saved_handlers[signum]


def stop_status(exc: KeyboardInterrupt) -> int:
    """The exit status of a process stopped by exc: 128 + signal, 130 for Ctrl-C, 143 for SIGTERM."""
    return 128 + int(getattr(exc, "signum", signal.SIGINT))


# ---------------------------------------------------------------------------------------------
# Rank helpers and collectives: they all work without a process group (one process)
# ---------------------------------------------------------------------------------------------


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if _initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if _initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if _initialized():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum t over all processes, in place, and return it. With nccl, t must be on the GPU."""
    if _initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def average_buffers(module: torch.nn.Module) -> None:
    """Average floating-point buffers (BatchNorm running statistics) over all processes.

    DDP keeps parameters identical but each rank's running statistics follow its own batches
    (DDP only copies rank 0's at the start of the next forward). Averaging them once per epoch
    makes every rank evaluate, and rank 0 save, the same model. One coalesced all-reduce.
    """
    buffers = [b for b in module.buffers() if b.is_floating_point()]
    if not _initialized() or not buffers:
        return
    flat = torch.cat([b.detach().reshape(-1) for b in buffers])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= get_world_size()
    offset = 0
    with torch.no_grad():
        for b in buffers:
            b.copy_(flat[offset: offset + b.numel()].view_as(b))
            offset += b.numel()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """The picklable obj of rank src, on every rank."""
    if not _initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


# ---------------------------------------------------------------------------------------------
# The built-in spawner: `distribuuuu train --nproc-per-node N`
# ---------------------------------------------------------------------------------------------


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable obj, in rank order, on every rank ([obj] for one process)."""
    if not _initialized():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def any_rank(flags: Sequence[bool]) -> list[bool]:
    """For each flag, whether it is set on ANY rank: one small all-reduce, so all ranks agree.

    Used at step boundaries for decisions that must be collective (stop after a signal, a
    time-based checkpoint): a rank acting alone would leave the others waiting in a collective.
    Under nccl it runs on a gloo side group with a CPU tensor: no GPU sync per step.
    """
    if not _initialized():
        return [bool(f) for f in flags]
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_control_group)  # None: the default (gloo) group
    return [bool(v) for v in t.tolist()]


def slurm_requeue() -> bool:
    """Put this Slurm job back in the queue (`scontrol requeue $SLURM_JOB_ID`); False if not Slurm.

    The requeued job starts the same batch script again, and TRAIN.AUTO_RESUME picks up the
    checkpoint. The sbatch script needs --requeue (and --signal=USR1@90 for an early warning).
    """
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        print("[preempt] TRAIN.REQUEUE is set but this is not a Slurm job: nothing requeued", flush=True)
        return False
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    print(f"[preempt] scontrol requeue {job}: {'ok' if done.returncode == 0 else done.stderr.strip()}",
          flush=True)
    return done.returncode == 0


def free_port() -> int:
    """A TCP port that is free on this host right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


STOP_GRACE_S = 30.0  # how long stopped children may take to exit before SIGKILL (torchrun's default too)
# After one child fails: how long the others may take to end by themselves (an error that every
# rank finds together, such as engine.NonFiniteLoss, is then reported by each), before SIGTERM and,
# that long again later, SIGKILL.
FAILURE_GRACE_S = 5.0


def _host_store(port: int) -> tuple[Any, int]:
    """Start the rendezvous store in the spawner, as torchrun's agent does; return it and its port.

    The children only connect to it (see _spawn_entry), so no other program can take the port
    between our choosing it and rank 0 binding it. port 0 lets the OS choose; a port in use is
    replaced by a free one, and the log says so.
    """
    if port:
        try:
            return dist.TCPStore(SPAWN_MASTER_ADDR, port, is_master=True, wait_for_workers=False), port
        except (dist.DistNetworkError, RuntimeError) as e:
            if not _is_addr_in_use(e):
                raise
    store = dist.TCPStore(SPAWN_MASTER_ADDR, 0, is_master=True, wait_for_workers=False)
    if port:
        print(f"[spawn] master port {port} is in use; using free port {store.port} instead", flush=True)
    return store, store.port


def _spawn_entry(local_rank: int, worker: Callable[..., None], nprocs: int, port: int, args: tuple) -> None:
    """First code of every spawned child: export the launcher variables, run the worker."""
    # A session of its own (as torchrun does for its workers): a terminal's Ctrl-C or a signal to
    # the job's process group then reaches only the spawner, which relays it once (_stop). Without
    # it each child got SIGTERM twice, from the group and from the spawner, and the second one
    # aborted the step checkpoint on some ranks only. A spawner killed outright still takes the
    # children along (torch sets PR_SET_PDEATHSIG, which does not depend on the session).
    try:
        os.setsid()
    except OSError:  # already a session leader: nothing to leave
        pass
    # TORCHELASTIC_USE_AGENT_STORE=True: env:// connects to the store the spawner hosts at
    # MASTER_ADDR:MASTER_PORT instead of having rank 0 start one (torchrun's protocol).
    os.environ.update(
        RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs), GROUP_RANK="0", MASTER_ADDR=SPAWN_MASTER_ADDR,
        MASTER_PORT=str(port), DISTRIBUUUU_LAUNCHER="spawn", TORCHELASTIC_USE_AGENT_STORE="True",
    )
    # The exit code is the child's message to the parent, so decide it here: torch's wrapper would
    # turn Ctrl-C into status 0 and hide a traceback in a pickle file.
    try:
        worker(*args)
    except UserError as e:  # the CLI normally reports these itself; this is the safety net
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_EXIT)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (Terminated)
        sys.exit(stop_status(e))
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)


def _signal_children(processes: Sequence[Any], signum: int) -> None:
    """Send signum to every child that has not exited (an unreaped child's pid is not reused)."""
    for p in processes:
        if p.is_alive():
            try:
                os.kill(p.pid, signum)
            except ProcessLookupError:  # exited meanwhile
                pass


@contextmanager
def _relaying(processes: Sequence[Any]) -> Iterator[None]:
    """While the children wind down, pass every further SIGINT/SIGTERM on to them.

    A second Ctrl-C or SIGTERM then does in the children what it does when they receive it
    directly: it cuts a stuck step checkpoint short (faults.py). The spawner itself keeps waiting.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {}
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            saved[signum] = signal.signal(signum, lambda n, _f: _signal_children(processes, n))
    try:
        yield
    finally:
        for signum, previous in saved.items():
            signal.signal(signum, previous)


def _stop(processes: Sequence[Any], grace_s: float = STOP_GRACE_S, signum: int = signal.SIGTERM) -> None:
    """Send signum to every live child, then SIGKILL whatever is still there after grace_s.

    signum is the stop signal the spawner received (SIGTERM when it stops the children itself), so
    the children act as if it had reached them directly: a TRAIN.PREEMPT_SIGNALS signal writes a
    step checkpoint first. Stop signals that arrive meanwhile are relayed too (_relaying).
    """
    with _relaying(processes):
        _signal_children(processes, signum)
        deadline = time.monotonic() + grace_s
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join()


@contextmanager
def _stop_signals_held() -> Iterator[None]:
    """Hold a SIGINT/SIGTERM that arrives while the children are being started, act on it after.

    Raised in the middle of mp.start_processes, the stop would lose the processes started so
    far (there is no context to stop yet); afterwards the usual path stops them all.
    """
    held: list[int] = []
    saved = {}
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is _on_stop_signal:
                saved[signum] = signal.signal(signum, lambda n, _f: held.append(n))
    try:
        yield
    finally:
        for signum, previous in saved.items():
            signal.signal(signum, previous)
    if held:
        _on_stop_signal(held[0], None)  # raises KeyboardInterrupt / Terminated, as if it came now


def _status_of(exitcode: int) -> int:
    """A child's exit code as a shell status: signals become 128 + signal number."""
    return 128 - exitcode if exitcode < 0 else exitcode


def _report_odd_endings(processes: Sequence[Any], status: int) -> None:
    """After a stop: name each child that ended otherwise than with status (killed, crashed)."""
    for rank, p in enumerate(processes):
        if p.exitcode is not None and _status_of(p.exitcode) not in (0, status):
            print(f"[spawn] process {rank} (pid {p.pid}) ended with status {_status_of(p.exitcode)}",
                  file=sys.stderr, flush=True)


def spawn(worker: Callable[..., None], nprocs: int, args: tuple = (), *, port: int | None = None) -> int:
    """Run ``worker(*args)`` in nprocs fresh processes on this host; return the exit status.

    Each child sees the torchrun variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    GROUP_RANK=0, MASTER_ADDR=127.0.0.1, MASTER_PORT) and DISTRIBUUUU_LAUNCHER=spawn, so its
    ``setup()`` needs nothing else. worker must be a module-level function (it is pickled), and
    the script that calls spawn() must guard its entry point with ``if __name__ == "__main__"``.

    port: the rendezvous port; default MASTER_PORT from the environment, else one the OS picks.
    The spawner listens on it itself before any child starts (_host_store); a port in use is
    replaced by a free one and logged.

    Returns 0 when all children exit 0, else the status of the first child that failed: its own
    exit code (2 for a UserError), 1 for an exception (its traceback is printed by the child),
    128+N for a signal. The other children get FAILURE_GRACE_S seconds to end by themselves, then
    are stopped; none is left behind. SIGINT (Ctrl-C)
    or SIGTERM to the spawner, whether sent to its pid or to its process group (the children run
    in sessions of their own, so only the spawner receives either): every child gets the same
    signal once, and STOP_GRACE_S seconds to exit (then SIGKILL); a further signal is relayed too;
    the status is 130 or 143. A spawner killed outright (SIGKILL) takes the
    children with it: torch.multiprocessing asks Linux to send them SIGINT then (PR_SET_PDEATHSIG).
    """
    if nprocs < 1:
        raise UserError(f"--nproc-per-node must be >= 1, got {nprocs}")
    outer = detect()
    if outer.launcher != "plain" and not (outer.launcher == "slurm" and outer.world_size == 1):
        raise UserError(
            f"this process was already started by {outer.launcher} ({outer.world_size} processes); "
            f"drop --nproc-per-node, or let {outer.launcher} start the processes"
        )
    if port is None:
        port = _int(os.environ, "MASTER_PORT", 0)
    if not 0 <= port < 65536:
        raise UserError(f"master port {port} must be in [0, 65535]")
    handle_stop_signals()
    context = None
    try:
        store, port = _host_store(port)  # kept alive until the children are done
        print(f"[spawn] {nprocs} processes, master {SPAWN_MASTER_ADDR}:{port}", flush=True)
        with _stop_signals_held():
            context = mp.start_processes(_spawn_entry, args=(worker, nprocs, port, tuple(args)),
                                         nprocs=nprocs, join=False, start_method="spawn")
        # join() returns True once all exited 0, and on the first failure stops the rest and raises.
        while not context.join(grace_period=FAILURE_GRACE_S):
            pass
        return 0
    except mp.ProcessExitedException as e:
        status = _status_of(e.exit_code)
        print(f"[spawn] process {e.error_index} (pid {e.error_pid}) exited with status {status}; "
              "the other processes were stopped", file=sys.stderr, flush=True)
        return status
    except mp.ProcessRaisedException as e:  # only if a worker bypassed _spawn_entry's handler
        print(e, file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM to the spawner (handle_stop_signals)
        status = stop_status(e)
        if context is not None:
            _stop(context.processes, signum=status - 128)  # the same signal, once, to every child
        print(f"[spawn] stopped by {signal.Signals(status - 128).name}; all processes stopped",
              file=sys.stderr, flush=True)
        _report_odd_endings(context.processes if context is not None else [], status)
        return status
    finally:
        # Belt and braces for any other way out: no child may outlive the parent's return.
        if context is not None:
            _stop(context.processes, grace_s=1.0)
        restore_signal_handlers()

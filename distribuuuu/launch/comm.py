"""The process group of a run (setup, teardown, and what each process
chooses once), and the collectives over it, which all work without a
process group too (rank 0 of 1).

What ``setup(cfg, info, strategy)`` chooses, once per process (``info``:
the launch, from launch.launcher.detect; ``strategy``: the DIST.STRATEGY
class, whose needs the caller passes in, so this room imports nothing
above it):
- device: ``DEVICE auto`` is ``cuda:<local_rank>`` when CUDA is
  available, else CPU. With fewer visible GPUs than processes on the
  node, only Slurm's ``--gpus-per-task`` (each task sees its own GPUs)
  is right: ``cuda:0`` then; or ``DIST.BACKEND gloo``, which lets ranks
  share a GPU (``cuda:<local_rank % GPUs>``, a test mode); anything else
  is a UserError (NCCL refuses a shared GPU).
- backend: ``DIST.BACKEND auto`` is nccl on CUDA, gloo on CPU.
- intra-op threads: ``NUM_THREADS`` if > 0; else an ``OMP_NUM_THREADS``
  already in the environment (torchrun sets 1 for several processes per
  node); else the usable cores / processes on the node.
- cuDNN: ``CUDNN.BENCHMARK`` unless ``CUDNN.DETERMINISTIC``, which also
  turns on ``torch.use_deterministic_algorithms(True, warn_only=True)``;
  TF32 for float32 matmuls and convolutions as ``CUDNN.TF32`` says (on
  by default).
- the process group (``env://``, its store: launch.store; the backend
  string the strategy asks for), only with more than one process, and
  under nccl a gloo side group for ``max_over_ranks``; under gloo on
  CUDA, a check that gloo serves the collectives the strategy runs on
  CUDA tensors (launch.gloo_cuda), before any work. A group that exists
  already was made by an engine that owns the processes (Ray Train's
  TorchTrainer): it is adopted (``_adopt_group``), checked against the
  launch and the backend, and left for its maker to destroy.
- stop signals: from then on, SIGINT (Ctrl-C), SIGTERM and SIGHUP unwind
  the process cleanly and exit with 130 / 143 / 129
  (launch.signals.handle_stop_signals); ``teardown()`` puts the old
  handlers back.

Collectives: every rank must call them, in the same order; with nccl,
tensors must be on this rank's GPU. ``max_over_ranks`` runs on the gloo
side group under nccl, so a per-step vote costs no host-device sync.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from distribuuuu.errors import UserError
from distribuuuu.launch import gloo_cuda, launcher, signals, store
from distribuuuu.launch.launcher import LaunchInfo

__all__ = [
    "DistContext",
    "setup",
    "teardown",
    "session",
    "gloo_side_group",
    "is_addr_in_use",
    "get_world_size",
    "barrier",
    "all_reduce_sum",
    "average_buffers",
    "broadcast_object",
    "all_gather_object",
    "max_over_ranks",
    "set_control_group",
]


# What a plain DDP run's collectives are (a strategy names its own:
# Strategy.collectives), for the check of gloo on CUDA tensors
_DDP_COLLECTIVES = ["all_reduce", "broadcast"]


@dataclass(frozen=True)
class DistContext(LaunchInfo):
    """The launch (rank, world size, launcher, master...), plus the
    device and backend this process uses."""

    device: torch.device
    backend: str  # the backend of the process group ("nccl"/"gloo"); chosen even for one process

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _choose_device(cfg: Any, info: LaunchInfo) -> torch.device:
    want = cfg.DEVICE
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(
            "DEVICE is cuda but no CUDA GPU is visible to this process; use DEVICE cpu or auto"
        )
    if (
        info.local_world_size <= torch.cuda.device_count()
    ):  # every process of the node sees every GPU: one each
        return torch.device("cuda", info.local_rank)
    return _fewer_gpus_than_processes(cfg, info)


def _fewer_gpus_than_processes(cfg: Any, info: LaunchInfo) -> torch.device:
    """Right only when srun gave each task its own GPUs
    (--gpus-per-task: CUDA_VISIBLE_DEVICES differs per task), or under
    gloo; otherwise two processes would share a GPU and NCCL stops with
    "Duplicate GPU detected"."""
    count = torch.cuda.device_count()
    if info.launcher == "slurm" and launcher.slurm_gpus_per_task():
        return torch.device("cuda", 0)  # the first of this task's own GPUs
    if cfg.DIST.BACKEND == "gloo":
        # gloo copies CUDA tensors through host memory, so several ranks
        # may share a GPU (NCCL refuses that): the way to run the
        # multi-rank GPU paths on one GPU (docs/launching.md). Round
        # robin.
        return torch.device("cuda", info.local_rank % count)
    hint = (
        "request as many GPUs as tasks per node (--gres gpu:N with --ntasks-per-node N) or bind "
        "one GPU per task (srun --gpus-per-task=1)"
        if info.launcher == "slurm"
        else "start at most one process per GPU"
    )
    raise UserError(
        f"{info.local_world_size} processes on this node but only {count} GPU(s) visible to each, "
        f"so two would share a GPU, which NCCL refuses; {hint}, or use DEVICE cpu, or DIST.BACKEND "
        "gloo to share the GPU (a test mode: slow collectives through host memory)"
    )


def _choose_backend(cfg: Any, device: torch.device) -> str:
    backend = cfg.DIST.BACKEND
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise UserError(
            "DIST.BACKEND nccl needs CUDA GPUs, but this run uses the CPU; use DIST.BACKEND gloo "
            "or auto"
        )
    return backend


def _set_threads(cfg: Any, info: LaunchInfo) -> None:
    """Intra-op threads for this process: cfg.NUM_THREADS, which
    inferred.resolve decides from the free cores (0 only in a config
    that was not resolved: torch's own default is kept)."""
    if cfg.NUM_THREADS > 0:
        torch.set_num_threads(cfg.NUM_THREADS)


def _set_determinism(cfg: Any) -> None:
    """CUDNN.DETERMINISTIC: torch.use_deterministic_algorithms(True,
    warn_only=True) (ops without a deterministic kernel warn instead of
    stopping the run), or off. Called only on a change: the first call
    imports parts of torch that cost seconds at every start."""
    wanted = bool(cfg.CUDNN.DETERMINISTIC)
    if torch.are_deterministic_algorithms_enabled() != wanted or (
        wanted and not torch.is_deterministic_algorithms_warn_only_enabled()
    ):
        torch.use_deterministic_algorithms(wanted, warn_only=True)


def _set_cuda_flags(cfg: Any) -> None:
    """cuDNN's autotuner (CUDNN.BENCHMARK, off when deterministic) and
    TF32 (CUDNN.TF32)."""
    deterministic = bool(cfg.CUDNN.DETERMINISTIC)
    if deterministic:
        # cuBLAS needs this before its first call to be deterministic; a
        # user's value is kept.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = bool(cfg.CUDNN.BENCHMARK) and not deterministic
    torch.backends.cudnn.deterministic = deterministic
    # TF32 (Ampere and newer): float32 matmuls and convolutions on
    # tensor cores with a 10-bit mantissa. The legacy flags, on purpose:
    # after torch 2.14's fp32_precision setters, reading a legacy flag
    # raises, and torch.compile's dynamo still reads one; the new
    # getters follow the legacy flags.
    torch.backends.cuda.matmul.allow_tf32 = bool(cfg.CUDNN.TF32)
    torch.backends.cudnn.allow_tf32 = bool(cfg.CUDNN.TF32)


def is_addr_in_use(err: BaseException) -> bool:
    """Whether a store or group failed because its port is taken."""
    text = str(err).lower()
    return "address already in use" in text or "eaddrinuse" in text


def gloo_side_group(timeout: datetime.timedelta) -> Any:
    """Collective: a gloo group of all ranks for the votes
    (max_over_ranks) beside an nccl main group.

    With the main group's timeout (DIST.TIMEOUT_S; torch's default for a
    gloo group is 30 minutes), so that a vote with a dead or hung rank
    fails as soon as an nccl collective would. Gloo finds its network
    interface from the hostname: where that resolves to a loopback
    address, set GLOO_SOCKET_IFNAME as NCCL_SOCKET_IFNAME
    (docs/launching.md).
    """
    return dist.new_group(backend="gloo", timeout=timeout)


def _export_launch_env(info: LaunchInfo) -> None:
    """Slurm and the spawner: init_method="env://" reads these (torchrun
    and launch have set them)."""
    os.environ.update(
        MASTER_ADDR=info.master_addr,
        MASTER_PORT=str(info.master_port),
        RANK=str(info.rank),
        WORLD_SIZE=str(info.world_size),
        LOCAL_RANK=str(info.local_rank),
        LOCAL_WORLD_SIZE=str(info.local_world_size),
    )


def _init_process_group(
    info: LaunchInfo,
    backend: str,
    device: torch.device,
    timeout_s: float,
    group_backend: str | None = None,
) -> None:
    if not dist.is_available():
        raise UserError("this PyTorch build has no torch.distributed; run a single process")
    if info.launcher in ("slurm", "spawn"):
        _export_launch_env(info)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(
            backend=group_backend or backend,
            store=store.private_store(info.rank, info.world_size, timeout),
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout,
            device_id=device if backend == "nccl" else None,  # binds NCCL to our GPU eagerly
        )
        if backend == "nccl":
            set_control_group(gloo_side_group(timeout))
    except (dist.DistNetworkError, RuntimeError) as e:
        if is_addr_in_use(e):
            raise _port_taken(info) from None
        raise


def _port_taken(info: LaunchInfo) -> UserError:
    return UserError(
        f"master port {info.master_port} on {info.master_addr} is already in use; pick another "
        "with MASTER_PORT=... or --master-port ..."
    )


def _check_gloo_cuda(device: torch.device, collectives: list[str]) -> None:
    """Collective: gloo on CUDA tensors serves every collective this run
    needs, or every rank stops here with the same UserError
    (launch.gloo_cuda), its process group destroyed."""
    try:
        gloo_cuda.check(device, collectives)
    except UserError:
        dist.destroy_process_group()
        raise


def setup(cfg: Any, info: LaunchInfo | None = None, strategy: Any = None) -> DistContext:
    """Pick device/backend/threads/cuDNN flags, join the process group
    (only with more than one process), and print one ``[dist]`` line per
    process. ``info``: the launch (detected when None); ``strategy``:
    DIST.STRATEGY's class (its group_backend and collectives; None: a
    plain DDP run's)."""
    info = info or launcher.detect()
    device = _choose_device(cfg, info)
    backend = _choose_backend(cfg, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        _set_cuda_flags(cfg)
    _set_threads(cfg, info)
    _set_determinism(cfg)
    if dist.is_initialized():  # made by the engine that started us (Ray Train)
        _adopt_group(cfg, info, device, backend, strategy)
    elif info.world_size > 1:
        group_backend = strategy.group_backend(cfg, backend) if strategy else backend
        _init_process_group(info, backend, device, cfg.DIST.TIMEOUT_S, group_backend)
        if backend == "gloo" and device.type == "cuda":
            _check_gloo_cuda(device, strategy.collectives(cfg) if strategy else _DDP_COLLECTIVES)
    _print_dist_line(info, device, backend)
    # Only now: until the group exists a signal may end the process at
    # once (nothing to clean up), and a Python handler could not run
    # while init_process_group blocks in C++ anyway.
    signals.handle_stop_signals()
    return DistContext(**asdict(info), device=device, backend=backend)


def _adopt_group(
    cfg: Any, info: LaunchInfo, device: torch.device, backend: str, strategy: Any
) -> None:
    """Use the process group an engine made before it called us, as it
    is: its rank, world size and backend must be this launch's, since
    neither can change now. Then what setup() adds to a group it makes:
    under nccl a gloo side group for the votes, under gloo on CUDA the
    check of its collectives (launch.gloo_cuda)."""
    global _adopted
    rank, world_size, made = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    wanted = strategy.group_backend(cfg, backend) if strategy else backend
    if (rank, world_size) != (info.rank, info.world_size):
        raise UserError(
            f"the process group that exists is rank {rank} of {world_size}, but {info.launcher} "
            f"says RANK={info.rank} of WORLD_SIZE={info.world_size}; start each process with "
            "the variables of its own group"
        )
    if made != wanted:
        raise UserError(
            f"the process group that {info.launcher} made uses backend {made}, but this run needs "
            f"{wanted} (device {cfg.DEVICE}, DIST.BACKEND {cfg.DIST.BACKEND}); make the group "
            f"with {wanted} (Ray Train: TorchConfig(backend={wanted!r})) or set DEVICE and "
            "DIST.BACKEND to match it"
        )
    if cfg.TRAIN.PREEMPT_SIGNALS and threading.current_thread() is not threading.main_thread():
        raise UserError(
            "this run is not in the main thread, where Python delivers signals (Ray Train runs "
            "the training function in a thread of its own): set TRAIN.PREEMPT_SIGNALS [], as "
            "distribuuuu.ray_train does"
        )
    if backend == "nccl":
        set_control_group(gloo_side_group(datetime.timedelta(seconds=cfg.DIST.TIMEOUT_S)))
    if backend == "gloo" and device.type == "cuda":
        gloo_cuda.check(device, strategy.collectives(cfg) if strategy else _DDP_COLLECTIVES)
    _adopted = dist.group.WORLD
    # What joining a group does: every rank is past its checks before
    # rank 0 takes the run lock, which a rank still checking would see
    barrier()


def _print_dist_line(info: LaunchInfo, device: torch.device, backend: str) -> None:
    """One write of the whole line: print() writes the text and the
    newline apart, so the ranks' lines could interleave in a shared
    output file (seen in Slurm job logs)."""
    master = f"{info.master_addr}:{info.master_port}" if info.world_size > 1 else "-"
    sys.stdout.write(
        f"[dist] rank {info.rank}/{info.world_size} | local rank "
        f"{info.local_rank}/{info.local_world_size} | node {info.node_rank} | master {master} | "
        f"device {device} | backend {backend if info.world_size > 1 else '-'} | launcher "
        f"{info.launcher}\n"
    )
    sys.stdout.flush()


def teardown() -> None:
    """Destroy the process group if there is one (an adopted one is its
    maker's), restore the signal handlers setup() replaced.

    Safe to call twice or without setup().
    """
    if dist.is_initialized() and dist.group.WORLD is not _adopted:
        dist.destroy_process_group()
    store.forget()
    set_control_group(None)
    signals.restore_signal_handlers()


@contextmanager
def session(
    cfg: Any, info: LaunchInfo | None = None, strategy: Any = None
) -> Iterator[DistContext]:
    """``with session(cfg) as ctx:`` setup (same arguments), and
    teardown on any exit (an error, a stop signal too)."""
    ctx = setup(cfg, info, strategy)
    try:
        yield ctx
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM on this rank: say so to the others first
        if not isinstance(stop, signals.PeerStopped):
            store.announce_stop(ctx.rank, stop)
        raise
    finally:
        try:
            teardown()
        except KeyboardInterrupt:  # the stop signal landed in this cleanup: finish it, then go on
            teardown()
            raise


# -- collectives
# ------------------------------------------------------------------------------------
# A gloo group beside an nccl one, for the votes (max_over_ranks): its
# CPU all-reduce does not wait for the GPU queue, so a per-step decision
# costs no host-device sync. None: the default group (gloo).
_control_group: Any = None
# The process group an engine made and setup() adopted (_adopt_group):
# teardown() leaves it to its maker.
_adopted: Any = None


def set_control_group(group: Any) -> None:
    """The group max_over_ranks() votes on (None: the default group).
    Set by launch.comm.setup/teardown."""
    global _control_group
    _control_group = group


def get_world_size() -> int:
    """Processes in the default group (1 without one)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    """Wait until every rank gets here (nothing to wait for without a
    group)."""
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum t over all processes, in place, and return it. With nccl, t
    must be on the GPU."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def average_buffers(module: torch.nn.Module) -> None:
    """Average floating-point buffers (BatchNorm running statistics)
    over all processes, with one coalesced all-reduce: DDP keeps the
    parameters identical, but each rank's running statistics follow its
    own batches, so every rank then evaluates, and rank 0 saves, the
    same model."""
    buffers = [b for b in module.buffers() if b.is_floating_point()]
    if not dist.is_initialized() or not buffers:
        return
    flat = torch.cat([b.detach().reshape(-1) for b in buffers])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= get_world_size()
    offset = 0
    with torch.no_grad():
        for b in buffers:
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """The picklable obj of rank src, on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable obj, in rank order, on every rank ([obj]
    for one process)."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def max_over_ranks(values: Sequence[int]) -> list[int]:
    """For each int (or bool: any rank's), its maximum over all ranks:
    one small all-reduce, for the decisions that must be collective (a
    stop signal, a time-based checkpoint): a rank acting alone would
    leave the others waiting. Under nccl it runs on the gloo side group:
    no GPU sync per step."""
    if not dist.is_initialized():
        return [int(v) for v in values]
    t = torch.tensor([int(v) for v in values], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_control_group)  # None: the default (gloo) group
    return t.tolist()

"""Who started this process, and where it sits: a pure function of
(environ, argv).

This is the only module of the package that reads the launchers'
variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_*``, ``SLURM_*``,
``TORCHELASTIC_*``); everything else asks ``detect()`` or one of the
small readers at the end.

How ``detect()`` decides who started us (first match wins):

1. ``launch``: argv holds ``--local-rank``/``--local_rank`` (``=N`` or
   ``N``) and the environment holds ``RANK`` and ``WORLD_SIZE``: the
   legacy ``python -m torch.distributed.launch``. It passes the local
   rank on the command line; ``LOCAL_RANK`` may be missing from the
   environment (no ``--use-env``), so the argv value is used. A
   ``--local-rank`` without ``RANK`` is ignored.
2. ``spawn`` / ``ray``: ``DISTRIBUUUU_LAUNCHER`` names it, set with
   the other variables by ``launch.spawn``, or beside Ray Train's
   (``LOCAL_RANK``, ``NODE_RANK``, ...) by ``distribuuuu.ray_train``.
3. ``one-per-node``: ``RANK`` and ``WORLD_SIZE`` are set but not
   ``LOCAL_RANK``: one process per node, as a Kubeflow PyTorchJob v1 pod
   runs a plain ``python`` (its operator sets ``RANK``, ``WORLD_SIZE``,
   ``MASTER_ADDR``, ``MASTER_PORT``): local rank 0 of 1, node = rank. A
   ``LOCAL_WORLD_SIZE`` above 1 says otherwise and is refused.
4. ``torchrun``: ``RANK`` and ``WORLD_SIZE`` are set (torchrun also sets
   ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
   ``MASTER_ADDR``/``MASTER_PORT``). This wins over Slurm: ``srun
   torchrun ...`` runs one agent per node and the workers must follow
   torchrun.
5. ``slurm``: ``SLURM_PROCID`` is set AND we are a task of a job step
   started by ``srun`` (``SLURM_STEP_ID``/``SLURM_STEPID`` holds a real
   step number and ``SLURM_STEP_NUM_TASKS`` is set). A bare ``python
   train.py`` in an sbatch script (the batch step) also sees
   ``SLURM_PROCID=0`` and ``SLURM_NTASKS=8``; treating it as rank 0 of 8
   would hang forever, so it is ``plain``. rank = ``SLURM_PROCID``,
   world = ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``), local rank
   = ``SLURM_LOCALID``, node = ``SLURM_NODEID``, processes on this node
   from ``SLURM_STEP_TASKS_PER_NODE`` (else ``SLURM_TASKS_PER_NODE``,
   ``SLURM_NTASKS_PER_NODE``). Master: ``MASTER_ADDR`` if set, else the
   first host of the step's node list. Port: ``MASTER_PORT`` if set,
   else ``10000 + SLURM_JOB_ID % 20000``, so that two jobs sharing a
   node do not fight over one port (two concurrent steps of ONE job
   still need ``MASTER_PORT``). Use ``srun --kill-on-bad-exit=1`` so
   that one failing task stops the others at once.
6. ``plain``: rank 0 of 1, no process group.

Every value read is checked: a non-integer or inconsistent value
(``RANK=4`` with ``WORLD_SIZE=4``) raises ``UserError`` naming the
variable. The legacy launcher appends ``--local-rank=N`` to the script's
arguments: argument parsers drop it with ``strip_local_rank_args``.
Slurm's host list and tasks-per-node notations are parsed in
launch/hostlist.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from distribuuuu.errors import UserError
from distribuuuu.launch.hostlist import parse_hostlist, parse_tasks_per_node

__all__ = [
    "LAUNCHERS",
    "NAMED_LAUNCHERS",
    "LOCAL_RANK_FLAGS",
    "SPAWN_MASTER_ADDR",
    "LaunchInfo",
    "detect",
    "strip_local_rank_args",
    "parse_hostlist",
    "parse_tasks_per_node",
    "rank_label",
    "master_port",
    "slurm_gpus_per_task",
    "slurm_cpus_per_task",
    "slurm_job_id",
    "restart_count",
    "job_and_attempt",
]

LAUNCHERS = ("plain", "torchrun", "launch", "slurm", "spawn", "ray", "one-per-node")
# DISTRIBUUUU_LAUNCHER's values: set by launch.spawn and distribuuuu.ray_train
NAMED_LAUNCHERS = ("spawn", "ray")
LOCAL_RANK_FLAGS = ("--local-rank", "--local_rank")
SPAWN_MASTER_ADDR = "127.0.0.1"
# Step ids >= this are Slurm's special steps (batch script, extern,
# interactive, pending); srun's own steps count up from 0. Older Slurm
# versions write "batch"/"extern" instead.
_SLURM_SPECIAL_STEP_ID = 0xFFFFFFF0


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
    """Read an integer variable; a missing one without default, or a
    non-integer, is a UserError."""
    if name not in env:
        if default is None:
            raise UserError(
                f"environment variable {name} is not set, but the launcher should have set it"
            )
        return default
    value = env[name]
    try:
        return int(value.strip())
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def _argv_local_rank(argv: Sequence[str]) -> int | None:
    """The value of --local-rank/--local_rank in argv (either `--flag=N`
    or `--flag N`), or None."""
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
    """argv without the --local-rank/--local_rank option the legacy
    launcher appends."""
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
    """MASTER_ADDR/MASTER_PORT as set by torchrun, launch or spawn
    (required with > 1 process)."""
    if world_size > 1 and ("MASTER_ADDR" not in env or "MASTER_PORT" not in env):
        raise UserError(
            f"{who} started {world_size} processes but MASTER_ADDR/MASTER_PORT are not both set"
        )
    return env.get("MASTER_ADDR", SPAWN_MASTER_ADDR), _int(env, "MASTER_PORT", 0)


def _from_rank_env(
    launcher: str, env: Mapping[str, str], local_rank: int | None = None
) -> LaunchInfo:
    """torchrun, legacy launch and spawn all speak the same
    RANK/WORLD_SIZE/... dialect."""
    rank, world_size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if local_rank is None:
        local_rank = _int(env, "LOCAL_RANK")
    elif "LOCAL_RANK" in env and _int(env, "LOCAL_RANK") != local_rank:
        raise UserError(f"LOCAL_RANK={env['LOCAL_RANK']} disagrees with --local-rank {local_rank}")
    # Missing LOCAL_WORLD_SIZE (torch 1.x launch): assume one node; it
    # only sizes thread pools.
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", world_size)
    node_var = "GROUP_RANK" if "GROUP_RANK" in env else "NODE_RANK"
    node_rank = _int(env, node_var, rank // max(local_world_size, 1))
    addr, port = _master(env, world_size, launcher)
    return LaunchInfo(
        launcher, rank, local_rank, world_size, local_world_size, node_rank, addr, port
    )


def _one_per_node(env: Mapping[str, str]) -> LaunchInfo:
    """RANK and WORLD_SIZE without LOCAL_RANK: one process per node
    (a PyTorchJob v1 pod), so local rank 0 of 1 on node RANK."""
    rank, world_size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if _int(env, "LOCAL_WORLD_SIZE", 1) != 1:
        raise UserError(
            f"RANK and WORLD_SIZE are set, and LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']}, but "
            "LOCAL_RANK is not; set LOCAL_RANK too, or start the processes with torchrun"
        )
    addr, port = _master(env, world_size, "a launcher of one process per node")
    return LaunchInfo("one-per-node", rank, 0, world_size, 1, rank, addr, port)


def _is_srun_step(env: Mapping[str, str]) -> bool:
    """True in a task of a step started by srun; False in the sbatch
    batch step or a salloc shell."""
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
                raise UserError(
                    f"SLURM_NODEID={node_rank} is out of range for {name}={env[name]!r}"
                )
            return counts[node_rank]
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int(env, "SLURM_NTASKS_PER_NODE")
    raise UserError(
        "cannot tell how many Slurm tasks run on this node: SLURM_STEP_TASKS_PER_NODE is not set"
    )


def _slurm_master_addr(env: Mapping[str, str]) -> str:
    if "MASTER_ADDR" in env:
        return env["MASTER_ADDR"]
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if name in env:
            try:
                return parse_hostlist(env[name])[0]
            except UserError:
                # A hostlist form we do not parse: ask Slurm itself (the
                # only impure path here).
                try:
                    out = subprocess.run(
                        ["scontrol", "show", "hostnames", env[name]],
                        capture_output=True,
                        text=True,
                        check=True,
                        timeout=30,
                    )
                    return out.stdout.split()[0]
                except (OSError, subprocess.SubprocessError, IndexError):
                    raise UserError(
                        f"cannot read the master host from {name}={env[name]!r}; set MASTER_ADDR"
                    ) from None
    raise UserError(
        "cannot find the master host: no SLURM_STEP_NODELIST / SLURM_JOB_NODELIST; set MASTER_ADDR"
    )


def _from_slurm(env: Mapping[str, str]) -> LaunchInfo:
    rank = _int(env, "SLURM_PROCID")
    world_size = (
        _int(env, "SLURM_STEP_NUM_TASKS")
        if "SLURM_STEP_NUM_TASKS" in env
        else _int(env, "SLURM_NTASKS")
    )
    local_rank, node_rank = _int(env, "SLURM_LOCALID"), _int(env, "SLURM_NODEID")
    local_world_size = _slurm_local_world_size(env, node_rank)
    addr = _slurm_master_addr(env)
    if "MASTER_PORT" in env:
        port = _int(env, "MASTER_PORT")
    else:
        job = env.get("SLURM_JOB_ID", env.get("SLURM_JOBID"))
        if job is None:
            raise UserError(
                "SLURM_JOB_ID is not set, so no master port can be derived; set MASTER_PORT"
            )
        port = 10000 + _int({"SLURM_JOB_ID": job}, "SLURM_JOB_ID") % 20000
    return LaunchInfo(
        "slurm", rank, local_rank, world_size, local_world_size, node_rank, addr, port
    )


def _validate(info: LaunchInfo) -> LaunchInfo:
    """Catch inconsistent launcher variables here, not as a hang in
    init_process_group."""
    names = {  # the variable each field came from, for the message
        "slurm": (
            "SLURM_PROCID",
            "SLURM_LOCALID",
            "SLURM_STEP_NUM_TASKS",
            "SLURM_STEP_TASKS_PER_NODE",
            "SLURM_NODEID",
        ),
    }.get(info.launcher, ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"))
    rank_n, local_n, world_n, local_world_n, node_n = names
    checks = [
        (info.world_size >= 1, f"{world_n}={info.world_size} must be >= 1"),
        (
            0 <= info.rank < info.world_size,
            f"{rank_n}={info.rank} must be in [0, {world_n}={info.world_size})",
        ),
        (info.local_world_size >= 1, f"{local_world_n}={info.local_world_size} must be >= 1"),
        (
            0 <= info.local_rank < info.local_world_size,
            f"{local_n}={info.local_rank} must be in [0, {local_world_n}={info.local_world_size})",
        ),
        (
            info.local_world_size <= info.world_size,
            f"{local_world_n}={info.local_world_size} exceeds {world_n}={info.world_size}",
        ),
        (info.node_rank >= 0, f"{node_n}={info.node_rank} must be >= 0"),
        (0 <= info.master_port < 65536, f"MASTER_PORT={info.master_port} must be in [0, 65535]"),
    ]
    for ok, msg in checks:
        if not ok:
            raise UserError(f"bad {info.launcher} launch: {msg}")
    return info


def detect(
    environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None
) -> LaunchInfo:
    """Who started this process, and where it sits (rules in the module
    docstring)."""
    env = os.environ if environ is None else environ
    argv = sys.argv if argv is None else argv
    has_rank_env = "RANK" in env and "WORLD_SIZE" in env
    argv_local_rank = _argv_local_rank(argv)
    if argv_local_rank is not None and has_rank_env:
        info = _from_rank_env("launch", env, local_rank=argv_local_rank)
    elif env.get("DISTRIBUUUU_LAUNCHER") in NAMED_LAUNCHERS:
        info = _from_rank_env(env["DISTRIBUUUU_LAUNCHER"], env)
    elif has_rank_env and "LOCAL_RANK" not in env:
        info = _one_per_node(env)
    elif has_rank_env:
        info = _from_rank_env("torchrun", env)
    elif "SLURM_PROCID" in env and _is_srun_step(env):
        info = _from_slurm(env)
    else:
        info = LaunchInfo("plain", 0, 0, 1, 1, 0, SPAWN_MASTER_ADDR, 0)
    return _validate(info)


# ---------------------------------------------------------------------------------------------
# Single variables, for the modules that need one fact and no full
# detect()
# ---------------------------------------------------------------------------------------------


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def rank_label(environ: Mapping[str, str] | None = None) -> str:
    """RANK as the launcher exported it, "0" when unset: for prefixing
    error messages.

    Unchecked on purpose: it runs inside error handlers, where a second
    UserError would hide the first.
    """
    return _env(environ).get("RANK", "0")


def master_port(environ: Mapping[str, str] | None = None) -> int:
    """MASTER_PORT, or 0 (let the OS choose) when unset; a non-integer
    is a UserError."""
    return _int(_env(environ), "MASTER_PORT", 0)


def slurm_gpus_per_task(environ: Mapping[str, str] | None = None) -> bool:
    """True when srun gave each task its own GPUs (--gpus-per-task)."""
    return bool(_env(environ).get("SLURM_GPUS_PER_TASK"))


def slurm_cpus_per_task(environ: Mapping[str, str] | None = None) -> int | None:
    """SLURM_CPUS_PER_TASK when it is a plain number, else None."""
    value = _env(environ).get("SLURM_CPUS_PER_TASK", "")
    return int(value) if value.isdigit() else None


def slurm_job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """SLURM_JOB_ID, or None outside a Slurm job."""
    return _env(environ).get("SLURM_JOB_ID") or None


def restart_count(environ: Mapping[str, str] | None = None) -> str:
    """TORCHELASTIC_RESTART_COUNT: how often torchrun restarted the
    workers ("0" otherwise)."""
    return _env(environ).get("TORCHELASTIC_RESTART_COUNT", "0")


def job_and_attempt(environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """The launcher's job that this process belongs to ("slurm:ID",
    "torchelastic:ID" or ""), and its restart count: a job's next
    attempt starts only after the last one ended."""
    env = _env(environ)
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}", int(env.get("SLURM_RESTART_COUNT") or 0)
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":  # "none" is torchrun's default, shared by unrelated jobs
        return f"torchelastic:{run_id}", int(env.get("TORCHELASTIC_RESTART_COUNT") or 0)
    return "", 0

"""Module-level workers for tests/test_distributed.py (spawn pickles them by name).

Kept apart from the test module so that a child process imports only this small file.
"""

from __future__ import annotations

import os
import time

import torch


def _cfg():
    """Not tests.conftest.make_cfg: a child imports this file alone (conftest would bring pytest)."""
    from distribuuuu.config import load_config

    return load_config(None, ["DEVICE", "cpu", "NUM_THREADS", "1"])


def _write(out_dir: str, name: str, text: str) -> None:
    # Write then rename, so the test never reads a half-written file.
    path = os.path.join(out_dir, name)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _wait_for(path: str, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.05)


def all_reduce_worker(out_dir: str) -> None:
    """Each rank contributes rank + 1 and writes the sum and its launch facts."""
    from distribuuuu.launch import comm

    torch.set_num_threads(1)
    ctx = comm.setup(_cfg())
    t = comm.all_reduce_sum(torch.tensor([float(ctx.rank + 1)]))
    obj = comm.broadcast_object({"from": ctx.rank} if ctx.is_main else None)
    comm.barrier()
    facts = (f"{t.item()} {ctx.launcher} {ctx.rank} {ctx.world_size} {ctx.local_rank} "
             f"{torch.distributed.get_rank()} {comm.get_world_size()} {int(ctx.is_main)} {obj['from']} {ctx.backend}")
    comm.teardown()
    comm.teardown()  # safe twice
    _write(out_dir, f"rank{ctx.rank}.txt", facts)
    session_worker(out_dir)  # one spawn for both: a child's start-up costs seconds


def exit_on_rank1_worker(out_dir: str) -> None:
    """Rank 1 exits with status 2 while rank 0 would go on forever: spawn must stop rank 0."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    _write(out_dir, f"pid{rank}", str(os.getpid()))
    if rank == 1:
        _wait_for(os.path.join(out_dir, "pid0"))
        raise SystemExit(2)
    time.sleep(120)


def raise_on_rank1_worker(out_dir: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    _write(out_dir, f"pid{rank}", str(os.getpid()))
    if rank == 1:
        _wait_for(os.path.join(out_dir, "pid0"))
        raise ValueError("boom from rank 1")
    time.sleep(120)


def user_error_worker(out_dir: str) -> None:
    from distribuuuu.errors import UserError

    raise UserError(f"bad thing in rank {os.environ['RANK']}")


def session_worker(out_dir: str) -> None:
    """The body raises (ValueError, then KeyboardInterrupt); the group must be gone each time."""
    import torch.distributed as dist

    from distribuuuu.launch import comm

    torch.set_num_threads(1)
    results = []
    for exc in (ValueError("body failed"), KeyboardInterrupt()):
        try:
            with comm.session(_cfg()) as ctx:
                assert dist.is_initialized() and ctx.distributed
                raise exc
        except (ValueError, KeyboardInterrupt) as e:
            results.append(f"{type(e).__name__}:{int(dist.is_initialized())}")
    _write(out_dir, f"session{os.environ['RANK']}.txt", " ".join(results))


def setup_worker(out_dir: str) -> None:
    """Only joins the group (used with a master port that is taken)."""
    from distribuuuu.launch import comm

    torch.set_num_threads(1)
    with comm.session(_cfg()):
        pass


def sleep_worker(out_dir: str) -> None:
    torch.set_num_threads(1)
    _write(out_dir, f"pid{os.environ['RANK']}", str(os.getpid()))
    time.sleep(120)

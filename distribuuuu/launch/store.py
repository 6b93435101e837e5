"""The key-value store of this process's group: keys private to one
restart and one group, and the stop announcements that let a rank tell a
stop signal from a crash of its peer.

After torchrun --max-restarts restarts the workers, the store still
holds the dead workers' gloo addresses, and connecting to those fails
("connectFullMesh ... Connection refused"). The same holds for a second
group in one process when the store outlives the first (torchrun's and
our spawner's store live in the launcher): hence a prefix with the
restart count and the count of groups made.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from distribuuuu.launch import launcher, signals

_groups_made = 0  # process groups this process has created (all ranks create them in step)
_store: Any = (
    None  # the store of this process's group (announce_stop / stopped_peer), None without one
)
_STOP_KEY = "stopped"  # "<rank> <signal number>" of a rank that a stop signal ended (announce_stop)


def private_store(rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    """The env:// store, with keys private to this restart and this
    group (module docstring)."""
    global _groups_made, _store
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    prefix = f"distribuuuu/restart{launcher.restart_count()}/group{_groups_made}"
    _groups_made += 1
    _store = dist.PrefixStore(prefix, store)
    return _store


def forget() -> None:
    """The group is gone (launch.comm.teardown): no store to announce to
    or ask."""
    global _store
    _store = None


def announce_stop(rank: int, stop: KeyboardInterrupt) -> None:
    """Tell the other ranks, through the group's store, that this one is
    ending for a stop signal.

    Called before the group is torn down: the peers' collectives fail
    only once this rank's connections close, so a peer that fails that
    way finds the key (stopped_peer) and ends as stopped too, with one
    line, instead of a gloo traceback. Best effort: a store that is gone
    (its host ended first) changes nothing."""
    if _store is None:
        return
    try:
        _store.set(_STOP_KEY, f"{rank} {signals.stop_status(stop) - 128}")
    except Exception:  # noqa: BLE001 (the store's host may be gone; the stop goes on regardless)
        pass


def stopped_peer(error: BaseException) -> signals.PeerStopped | None:
    """The stop of another rank that broke this rank's collective
    (error), if one announced it."""
    if _store is None or not isinstance(error, RuntimeError):
        return None
    try:
        if not _store.check([_STOP_KEY]):
            return None
        rank, signum = _store.get(_STOP_KEY).decode().split()
    except Exception:  # noqa: BLE001 (no store to ask: a crash as before, with its traceback)
        return None
    return signals.follow_peer(int(signum), int(rank))

"""What a DataLoader's batches go through on their way to the step: the
worker processes (seeded, deaf to stop signals, ended by stop_workers),
evaluation batches without their unreadable images, and uint8 batches
normalized on the device. Each wrapper has the DataLoader's len() and
passes every other attribute (dataset, sampler) through."""

from __future__ import annotations

import ctypes
import multiprocessing.util
import os
import random
import signal
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate

from distribuuuu.data.transforms import BatchRandomErasing, Stats

# Signals a loader worker never acts on: a stop or preemption sent to
# the whole process group (Slurm, systemd, Kubernetes, a terminal, the
# shell's SIGHUP when it closes) reaches the workers too. Had they died
# of it, the main process would fail reading its next batch and could
# not write its step checkpoint. The main process stops, checkpoints,
# then ends its workers (stop_workers); a worker whose main process is
# gone, even by SIGKILL, is killed by the kernel (_die_with_parent).
WORKER_IGNORED_SIGNALS = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_loaders: weakref.WeakSet[DataLoader] = weakref.WeakSet()  # loaders with worker processes
_exit_hooks: list[multiprocessing.util.Finalize] = []


def quiet_worker(worker_id: int) -> None:
    """worker_init_fn of every loader with workers: the stop signals are
    the main process's business, and the worker dies with it."""
    for signum in WORKER_IGNORED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    _die_with_parent()


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker (SIGKILL) when the process
    that started it ends, however it ends (SIGKILL, the OOM killer).
    torch's watchdog notices a dead parent only within 5 s, and a worker
    blocked elsewhere (a full queue) not at all: after kill -9, workers
    lived on for minutes. The signal comes when the thread that started
    the worker ends: the loops start theirs in the main thread."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def seed_worker(worker_id: int) -> None:
    """torch seeds each worker itself (base seed + worker id); numpy and
    random need it too (torch's reproducibility notes). Also
    quiet_worker."""
    quiet_worker(worker_id)
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def track_workers(loader: DataLoader) -> DataLoader:
    """Remember loader (if it has workers) so that stop_workers() can
    end them; returns it. The first one arms _end_left_workers, run by
    multiprocessing's exit function before it terminates children."""
    if loader.num_workers > 0:
        _loaders.add(loader)
        if not _exit_hooks:
            _exit_hooks.append(
                multiprocessing.util.Finalize(
                    None, _end_left_workers, args=(os.getpid(),), exitpriority=100
                )
            )
    return loader


def stop_workers() -> None:
    """End the worker processes of every tracked loader now, while the
    interpreter still runs.

    Needed on a stop: the workers ignore SIGTERM (quiet_worker),
    persistent workers live as long as their loader, and a traceback can
    keep the loader alive until exit, where torch skips its own shutdown
    and multiprocessing would wait on workers that ignore its SIGTERM."""
    for loader in list(_loaders):
        stop_loader_workers(loader)


def stop_loader_workers(loader: DataLoader) -> None:
    """End one loader's worker processes now. Also for a loader whose
    iteration failed: its persistent workers would otherwise live until
    the garbage collector frees it (a traceback keeps it in a reference
    cycle), and torch's shutdown then waits out its join timeouts (about
    20 s)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    loader._iterator = None
    _loaders.discard(loader)


def _end_left_workers(owner: int) -> None:
    """At exit, before multiprocessing ends its daemonic children with
    SIGTERM and waits for them: a loader worker still running (its
    iterator kept alive by a traceback, an API user's loader) ignores
    that SIGTERM (quiet_worker), so the wait would never end. torch
    skips its own shutdown by then; such a worker holds nothing that
    needs a clean end: SIGKILL."""
    if os.getpid() != owner:
        return
    for child in multiprocessing.active_children():
        if child.daemon and child.pid and _ignores_sigterm(child.pid):
            os.kill(child.pid, signal.SIGKILL)
            child.join(5)


def _ignores_sigterm(pid: int) -> bool:
    """Whether process pid ignores SIGTERM (Linux: /proc/PID/status,
    SigIgn); False if unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next((line.split()[1] for line in f if line.startswith("SigIgn:")), "0")
    except OSError:
        return False
    return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)


def collate_readable(items: list[Any]) -> Any:
    """default_collate of the items that are not None (the unreadable
    images of an evaluation set); None when none is left
    (ReadableBatches drops that batch)."""
    kept = [item for item in items if item is not None]
    return default_collate(kept) if kept else None


class ReadableBatches:
    """An evaluation DataLoader (collate_readable) without its empty
    batches; the rest is the loader's."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        return (batch for batch in self.loader if batch is not None)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)


# ---------------------------------------------------------------------------------------------
# uint8 batches normalized on the device (the fast image path's second
# half)
# ---------------------------------------------------------------------------------------------
class BatchNormalize:
    """uint8 [B, C, H, W] -> float32 (x / 255 - mean) / std, for a whole
    batch on its device."""

    def __init__(self, stats: Stats, device: torch.device | str = "cpu") -> None:
        mean, std = (
            torch.tensor(s, dtype=torch.float32, device=device).view(1, -1, 1, 1) for s in stats
        )
        self.scale, self.shift = 1.0 / (255.0 * std), mean / std

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        # One pass converts the dtype and the layout (workers' crops
        # come in channels-last strides).
        return (
            images.to(dtype=torch.float32, memory_format=torch.contiguous_format)
            .mul_(self.scale)
            .sub_(self.shift)
        )


class NormalizedBatches:
    """A DataLoader of uint8 batches, moved to the device and normalized
    there (and randomly erased: it needs the normalized floats, which
    exist only here), one batch at a time. Everything else (dataset,
    sampler, len ...) is the DataLoader's."""

    def __init__(
        self, loader: DataLoader, stats: Stats, device: torch.device, erase: float = 0.0
    ) -> None:
        self.loader, self.device = loader, device
        self.normalize, self.erase = (
            BatchNormalize(stats, device),
            BatchRandomErasing(erase) if erase > 0 else None,
        )

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, target in self.loader:
            images = self.normalize(images.to(self.device, non_blocking=True))
            if self.erase is not None:
                images = self.erase(images)
            yield images, target.to(self.device, non_blocking=True)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)

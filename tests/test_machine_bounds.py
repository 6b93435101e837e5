"""Numeric settings bounded by what the machine has. TRAIN.WORKERS and NUM_THREADS set
above the cores this process may use are clamped, with one warning each (inferred/machine.py); the run started
with TRAIN.WORKERS 1000 is watched process by process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from distribuuuu import inferred
from distribuuuu.inferred import machine
from tests.conftest import ROOT, TINY, env, make_cfg, process_tree, write_image_tree


def _decided(cfg) -> dict[str, inferred.Decision]:
    return {d.key: d for d in inferred.decisions(cfg)}


def test_workers_and_threads_above_the_cores_are_clamped_with_a_warning(monkeypatch):
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    cfg = make_cfg({"TRAIN.WORKERS": 1000, "NUM_THREADS": 64})
    assert (cfg.TRAIN.WORKERS, cfg.NUM_THREADS) == (8, 4)  # workers: up to the cores, or 8 on a small machine
    decided = _decided(cfg)
    assert decided["TRAIN.WORKERS"].line() == "TRAIN.WORKERS 8 (clamped from 1000: at most this process's 4 cores, or 8)"
    assert decided["NUM_THREADS"].line() == "NUM_THREADS 4 (clamped from 64: this process may use 4 cores)"
    assert decided["TRAIN.WORKERS"].warn and decided["NUM_THREADS"].warn
    kept = make_cfg({"TRAIN.WORKERS": 8, "NUM_THREADS": 4})  # within the bounds: as given, no warning
    assert (kept.TRAIN.WORKERS, kept.NUM_THREADS) == (8, 4) and "NUM_THREADS" not in _decided(kept)
    assert _decided(kept)["TRAIN.WORKERS"].line() == "TRAIN.WORKERS 8 (config)"
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert make_cfg({"TRAIN.WORKERS": 1000}).TRAIN.WORKERS == 64


@pytest.mark.e2e
def test_workers_1000_do_not_start_1000_processes(tmp_path):
    """Before: ~1,000 loader processes per loader (an epoch of 300 images took 94.5 s instead of 0.9 s).
    Now: the run's process tree never holds more than its two loaders' clamped workers, and it says so."""
    data, out = str(tmp_path / "data"), tmp_path / "run"
    write_image_tree(data, "train", {"a": 8, "b": 8}, size=(8, 8))
    write_image_tree(data, "val", {"a": 4, "b": 4}, size=(9, 9))
    bound = max(8, len(os.sched_getaffinity(0)))
    argv = [sys.executable, "-m", "distribuuuu", "train", "--cfg", TINY, "TRAIN.DATASET", data, "TEST.DATASET", data,
            "MODEL.NUM_CLASSES", "0", "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8", "TRAIN.BATCH_SIZE", "4",
            "TEST.BATCH_SIZE", "4", "TRAIN.DATA_PIPELINE", "loader", "OPTIM.MAX_EPOCH", "1", "TRAIN.WORKERS", "1000",
            "OUT_DIR", str(out)]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    most, deadline = 0, time.monotonic() + 240
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            most = max(most, len(process_tree(proc.pid)))
            if most > 2 * bound + 4:  # the main process, two loaders' workers, a helper or two
                break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole session: workers included
        output = proc.communicate()[0]
    assert most <= 2 * bound + 4, f"{most} processes at once"
    assert proc.returncode == 0, output[-3000:]
    assert f"setup: TRAIN.WORKERS {bound} (clamped from 1000: at most this process's" in output, output[-3000:]

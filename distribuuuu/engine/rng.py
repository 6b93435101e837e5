"""Seeding, in one place: the run's one seed, every RNG seeded from it,
and each process's RNG streams as plain values for the checkpoint (every
rank's) and a resume.

The seed is RNG_SEED, else the seed a resumed run started with, else a
fresh one drawn by rank 0 and logged. Everything seeded from it
(python/numpy/torch here; the sampler's shuffle and the loader workers
through ``seeded_cfg``) uses this one value, so the logged seed repeats
the run as RNG_SEED. The streams are plain Python values (bytes, ints,
lists): they pickle for all_gather_object and load with
torch.load(weights_only=True).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch
from yacs.config import CfgNode

from distribuuuu.launch import comm

log = logging.getLogger("distribuuuu")

EVAL_SEED = 0  # an evaluation's seed when RNG_SEED is None (seed_evaluation)


def seed_everything(cfg: CfgNode, rank: int, previous: int | None = None) -> int:
    """Seed python/numpy/torch with the run's seed + rank (augmentations
    differ per rank); return the seed: RNG_SEED, else ``previous`` (the
    seed of the run being resumed), else a fresh one (collective)."""
    seed = cfg.RNG_SEED
    if seed is None:
        seed = comm.broadcast_object(
            previous if previous is not None else random.SystemRandom().randrange(2**31)
        )
        how = "the seed of the run being resumed" if previous is not None else "using seed"
        log.info("RNG_SEED is None: %s %d (pass RNG_SEED %d to repeat this run)", how, seed, seed)
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)
    return seed


def seed_evaluation(cfg: CfgNode, rank: int) -> None:
    """An evaluation (the eval command) draws nothing that changes its
    result (no augmentation, no dropout, no shuffle): seeded with
    RNG_SEED, else EVAL_SEED, with no line to repeat it by and no
    collective."""
    if cfg.RNG_SEED is None:
        cfg = seeded_cfg(cfg, EVAL_SEED)
    seed_everything(cfg, rank)


def seeded_cfg(cfg: CfgNode, seed: int) -> CfgNode:
    """cfg with RNG_SEED set to the run's seed, for what draws from it
    (the data's shuffle and workers); the run's own cfg keeps None, so
    config.yaml and resume checks see what the user gave."""
    if cfg.RNG_SEED == seed:
        return cfg
    seeded = cfg.clone()
    seeded.defrost()
    seeded.RNG_SEED = seed
    seeded.freeze()
    return seeded


def rng_state() -> dict[str, Any]:
    """This process's RNG states as plain Python values (bytes, ints,
    lists): they pickle for all_gather_object and load with
    weights_only=True."""
    name, key, *rest = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [name, key.tobytes(), *rest],
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    if torch.cuda.is_available():  # this process's GPU only: a resumed task may see fewer GPUs
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device()).numpy().tobytes()
    return state


def _byte_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    name, key, *rest = state["numpy"]
    np.random.set_state((name, np.frombuffer(key, dtype=np.uint32).copy(), *rest))
    torch.set_rng_state(_byte_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        _set_cuda_rng_state(state["cuda"])


def _set_cuda_rng_state(saved: bytes | list[bytes]) -> None:
    """Restore the CUDA RNG of this process's GPU from bytes, or from an
    older checkpoint's list of every visible GPU's state (by this GPU's
    index; skipped when that list is shorter, as after torchrun with 8
    visible GPUs resumed by srun with one GPU per task)."""
    device = torch.cuda.current_device()
    if isinstance(saved, (list, tuple)):
        if device >= len(saved):
            log.warning(
                "the checkpoint holds the CUDA RNG states of %d GPU(s), none for GPU %d: its CUDA "
                "RNG keeps the fresh seed",
                len(saved),
                device,
            )
            return
        saved = saved[device]
    torch.cuda.set_rng_state(_byte_tensor(saved), device)


def _as_tuple(x: Any) -> Any:
    """random.setstate wants tuples all the way down; pickling may give
    lists."""
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x

"""The state of a run: what the loop carries, and its save to / resume from a checkpoint.

A checkpoint is a plain dict (the files themselves: run_folder/checkpoint.py):
  model / optimizer (or ``sharded``: the .dcp folder of an FSDP run; the strategy's entries),
  scaler / ema (the stepper's), epoch (epochs completed), samples_in_epoch (position in the
  epoch in progress, all ranks together), global_step, best_metric, best_epoch, evals_since_best,
  cfg (YAML text), rng (python/numpy/torch[/its GPU's cuda] states of every rank), world_size,
  train_sums (metrics of the part-done epoch), facts (the data's sizes), seed (the run's seed:
  RNG_SEED, or the one drawn when it is None), card (model_card.ModelCard.to_dict(): the config,
  class names and preprocessing, for using the model from the file alone).
Saving is collective (every rank calls ``save_run``); only rank 0 writes the .pth file.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from yacs.config import CfgNode

from distribuuuu import model_card, models
from distribuuuu.errors import UserError
from distribuuuu.launch import comm

if TYPE_CHECKING:
    from distribuuuu.engine.trainer import Trainer

log = logging.getLogger("distribuuuu")


@dataclass
class TrainState:
    """Counters of the run (the model, optimizer, scaler and EMA hold the rest)."""

    epoch: int = 0  # epochs completed
    samples_in_epoch: int = 0  # samples of the epoch in progress consumed by all ranks together
    global_step: int = 0  # optimizer steps taken
    best_metric: float = float("-inf")  # TRAIN.BEST_METRIC's best value so far
    best_epoch: int = 0
    evals_since_best: int = 0  # for TRAIN.PATIENCE
    bad_steps: int = 0  # consecutive non-finite steps
    resumed_sums: list[float] | None = None  # train sums of a resumed, part-done epoch (all ranks)
    stop_signal: int = 0  # a preemption signal agreed at an epoch's last step: stop after its checkpoint
    facts: dict[str, Any] = field(default_factory=dict)  # the data's sizes (RunFolder.facts), checked on resume

    COUNTERS = ("epoch", "samples_in_epoch", "global_step", "best_metric", "best_epoch", "evals_since_best")


class CheckpointTimer:
    """Rank 0's clock for TRAIN.CKPT_PERIOD_MIN (the decision is then shared with any_rank)."""

    def __init__(self, minutes: float) -> None:
        self.period_s, self.last = minutes * 60.0, time.monotonic()

    def due(self) -> bool:
        return self.period_s > 0 and time.monotonic() - self.last >= self.period_s

    def reset(self) -> None:
        self.last = time.monotonic()


def seed_everything(cfg: CfgNode, rank: int, previous: int | None = None) -> int:
    """Seed python/numpy/torch with the run's seed + rank (augmentations differ per rank); return the seed.

    The seed is RNG_SEED, else ``previous`` (the seed a resumed run started with), else a fresh
    one drawn by rank 0 and broadcast. Everything seeded from it (the sampler's shuffle, the loader
    workers) uses this one value, so the seed that is logged repeats the run as RNG_SEED."""
    seed = cfg.RNG_SEED
    if seed is None:
        seed = comm.broadcast_object(previous if previous is not None else random.SystemRandom().randrange(2**31))
        how = "the seed of the run being resumed" if previous is not None else "using seed"
        log.info("RNG_SEED is None: %s %d (pass RNG_SEED %d to repeat this run)", how, seed, seed)
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)
    return seed


def seeded_cfg(cfg: CfgNode, seed: int) -> CfgNode:
    """cfg with RNG_SEED set to the run's seed, for what draws from it (the data's shuffle and
    workers); the run's own cfg keeps None, so config.yaml and resume checks see what the user gave."""
    if cfg.RNG_SEED == seed:
        return cfg
    seeded = cfg.clone()
    seeded.defrost()
    seeded.RNG_SEED = seed
    seeded.freeze()
    return seeded


def save_run(trainer: Trainer, is_best: bool = False, train_sums: torch.Tensor | None = None) -> None:
    """Collective: every rank calls it. Rank 0 writes everything that decides the rest of the run:
    the counters, every rank's RNG streams, the stepper's state (scaler, EMA) and the strategy's
    model/optimizer entries. ``train_sums``: the part-done epoch's metrics (a mid-epoch checkpoint)."""
    cfg, ctx, state = trainer.cfg, trainer.ctx, trainer.state
    rng = comm.all_gather_object(rng_state())  # each rank's own streams
    if train_sums is not None:
        train_sums = comm.all_reduce_sum(train_sums.clone()).tolist()
    counters = {k: getattr(state, k) for k in TrainState.COUNTERS}
    record = {**trainer.stepper.state_dict(), **counters, "cfg": cfg.dump(), "rng": rng,
              "world_size": ctx.world_size, "train_sums": train_sums, "facts": state.facts, "seed": trainer.seed,
              model_card.CARD_KEY: trainer.card.to_dict(), "shard_plan": _shard_plan(trainer)}
    entries, finite = trainer.strategy.checkpoint_state(trainer.model, trainer.optimizer, trainer.run.shards_path(counters))
    record.update(entries)
    if ctx.is_main:
        if not finite:
            log.error("not saving a checkpoint at step %d: the weights are not finite", state.global_step)
        else:
            path = trainer.run.save(record, is_best=is_best)
            log.info("saved %s%s", path, " (best)" if is_best else "")
        trainer.saves["written" if finite else "refused"] += 1  # read at the end (Trainer.require_saved)
        trainer.saves["last_refused"] = int(not finite)
    comm.barrier()  # nobody races ahead (or exits) while rank 0 writes


def _shard_plan(trainer: Trainer) -> dict[str, Any] | None:
    """What decides the batches of a shard set's epoch (data/shards/reader.describe_plan); None for other data."""
    plan = getattr(trainer.train_loader, "shard_plan", None)
    return plan() if plan is not None else None


def _require_same_shard_plan(trainer: Trainer, ckpt: dict[str, Any], path: str) -> None:
    """A mid-epoch position on shards means particular batches: refuse to resume it under another plan."""
    now, then = _shard_plan(trainer), ckpt.get("shard_plan")
    if now is None or trainer.state.samples_in_epoch == 0 or then == now:
        return
    changed = ", ".join(f"{k} {then.get(k)} -> {v}" for k, v in now.items() if then.get(k) != v) if then else "unknown"
    raise UserError(f"{path} stopped {trainer.state.samples_in_epoch} samples into an epoch of a shard set, whose "
                    f"batches depend on the world size, TRAIN.WORKERS, BATCH_SIZE, ACCUM_STEPS and SHARD_SHUFFLE "
                    f"({changed}); resume with the values it was written with, then change them at an epoch end")


def _keep_seed(trainer: Trainer, seed: int | None) -> None:
    """A resumed run shuffles with the seed it started with (RNG_SEED None: env.json normally hands
    it over before the data is built; this covers a run folder whose env.json is gone)."""
    if seed is None or seed == trainer.seed:
        return
    log.warning("resume: the checkpoint's run used seed %d, not %d: its shuffle continues", seed, trainer.seed)
    trainer.seed = seed
    trainer.train_loader.sampler.seed = seed  # env.json is written after the resume, with this seed


def resume_run(trainer: Trainer) -> dict[str, Any] | None:
    """Continue from OUT_DIR/checkpoints when TRAIN.AUTO_RESUME finds a checkpoint there; returns
    the checkpoint (the stepper's state is loaded from it too) or None. A checkpoint that does not
    fit this run (config, data, model or optimizer: resume_check) is refused before anything is loaded."""
    cfg, ctx, state, strategy = trainer.cfg, trainer.ctx, trainer.state, trainer.strategy
    if not cfg.TRAIN.AUTO_RESUME:
        return None
    ckpt, path = trainer.run.latest()
    if ckpt is None:
        return None
    net, opt = models.unwrap(trainer.model), trainer.optimizer if cfg.TRAIN.LOAD_OPT else None
    plain = strategy.checkable(ckpt)  # the shapes of sharded state: torch checks them while loading
    trainer.run.check_resume(ckpt, path, state.facts, net if plain else None, opt if plain else None)
    strategy.load_checkpoint(trainer.model, opt, ckpt, path, trainer.run.checkpoints)
    for key in TrainState.COUNTERS:
        setattr(state, key, ckpt.get(key, getattr(state, key)))
    _require_same_shard_plan(trainer, ckpt, path)
    state.resumed_sums = ckpt.get("train_sums")
    # A checkpoint of an older version has no seed: its RNG_SEED None run shuffled with seed 0
    _keep_seed(trainer, ckpt.get("seed", 0 if cfg.RNG_SEED is None else None))
    saved_world = ckpt.get("world_size", ctx.world_size)
    if saved_world == ctx.world_size:
        set_rng_state(ckpt["rng"][ctx.rank])
    else:
        # The sampler position is counted in samples, so the epoch goes on with the next unseen
        # samples; each rank's RNG streams cannot be carried over and keep their fresh seeds.
        log.warning("resuming %d processes from a checkpoint of %d: the global batch and the LR are "
                    "recomputed (see the line above); the epoch continues at sample %d; RNG streams "
                    "are re-seeded", ctx.world_size, saved_world, state.samples_in_epoch)
    log.info("resumed from %s: %d epochs done, %d samples into epoch %d, step %d, best %s %.2f",
             path, state.epoch, state.samples_in_epoch, state.epoch + 1, state.global_step,
             cfg.TRAIN.BEST_METRIC, state.best_metric)
    trainer.stepper.load_state_dict(ckpt)
    return ckpt


def rng_state() -> dict[str, Any]:
    """This process's RNG states as plain Python values (bytes, ints, lists): they pickle for
    all_gather_object and load with weights_only=True."""
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
    """Restore the CUDA RNG of this process's GPU from bytes, or from an older checkpoint's list of
    every visible GPU's state (by this GPU's index; skipped when that list is shorter, as after
    torchrun with 8 visible GPUs resumed by srun with one GPU per task)."""
    device = torch.cuda.current_device()
    if isinstance(saved, (list, tuple)):
        if device >= len(saved):
            log.warning("the checkpoint holds the CUDA RNG states of %d GPU(s), none for GPU %d: its CUDA "
                        "RNG keeps the fresh seed", len(saved), device)
            return
        saved = saved[device]
    torch.cuda.set_rng_state(_byte_tensor(saved), device)


def _as_tuple(x: Any) -> Any:
    """random.setstate wants tuples all the way down; pickling may give lists."""
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x

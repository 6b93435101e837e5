"""Checkpoints: atomic writes, keep-k pruning, auto-resume, safe loading.

Layout under OUT_DIR/checkpoints/: ``epoch_0007.pth`` at epoch ends, ``step_00001234.pth``
mid-epoch (the newest TRAIN.CKPT_KEEP of each kind are kept), ``last.pth`` (the newest of all)
and ``best.pth``. A checkpoint is a plain dict of tensors and Python values:
  model (state dict without any ``module.`` prefix), optimizer, epoch (epochs completed),
  samples_in_epoch (position in the epoch in progress, all ranks together), global_step,
  best_top1, best_epoch, cfg (YAML text), rng (python/numpy/torch[/its GPU's cuda] states of every rank),
  world_size, train_sums (metrics of the part-done epoch).
Only rank 0 writes. Every read uses ``torch.load(weights_only=True)``.
Under DIST.STRATEGY fsdp the whole state is gathered on rank 0 into the same file (FSDP_STATE_DICT
full; its optimizer state is keyed by parameter name), or (sharded) each rank writes its shards into
``<name>.dcp/`` with torch.distributed.checkpoint and the .pth holds the rest plus ``sharded``.

Integrity: every checkpoint written by ``save`` holds ``integrity``, a SHA-256 of each other
top-level entry (tensors' dtype, shape and bytes, and every other value), and ``load`` verifies
it before anything uses the file. torch.load does not check the zip archive's CRC-32s: measured
with torch 2.14 on a ResNet-18 checkpoint (47 MB) and on a 2 kB one, one flipped bit inside a
tensor's data record loads without a word, with and without mmap (only damage to data.pkl or to
the zip directories is noticed, as an unpickling or archive error). The digest lives inside the
file, not in a sidecar, so it travels with copies of best.pth and with the hard links last.pth
and best.pth; it costs about one SHA-256 pass over the state per save and per load (~0.05 s for
ResNet-18's 47 MB here). Files without it (older checkpoints, bare state dicts) load unchecked.
A file whose digest does not match raises DamagedCheckpoint: auto-resume skips it with a warning
naming it and uses the next older intact checkpoint; eval, predict and export refuse it (exit 2).
Sharded .dcp folders are not covered (torch.distributed.checkpoint has its own metadata).
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import pickle
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from distribuuuu.errors import UserError

log = logging.getLogger("distribuuuu")

_NUMBERED = re.compile(r"(epoch|step)_(\d+)\.pth$")


def checkpoint_dir(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def _atomic_save(obj: Any, path: str) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over the target.

    A crash at any point leaves either the old file or the new one, never half of one; the
    temporary name does not match the patterns that resume looks for.
    """
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:  # torch wraps ENOSPC in a RuntimeError: say plainly what happened
        raise OSError(f"writing checkpoint {path} failed ({type(e).__name__}: {e}); "
                      "the previous checkpoint is intact") from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _atomic_link(src: str, dst: str) -> None:
    """Make dst the same content as src: a hard link when the filesystem allows, else a copy."""
    tmp = f"{dst}.tmp.{os.getpid()}"
    try:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def numbered_checkpoints(out_dir: str, kind: str) -> list[str]:
    """The epoch_*.pth (kind "epoch") or step_*.pth (kind "step") files, oldest first."""
    paths = glob.glob(os.path.join(checkpoint_dir(out_dir), f"{kind}_*.pth"))
    return sorted((p for p in paths if _NUMBERED.search(p)), key=lambda p: int(_NUMBERED.search(p).group(2)))


def checkpoint_path(out_dir: str, state: dict[str, Any]) -> str:
    """epoch_NNNN.pth at an epoch's end, step_NNNNNNNN.pth mid-epoch."""
    if state.get("samples_in_epoch"):
        return os.path.join(checkpoint_dir(out_dir), f"step_{state['global_step']:08d}.pth")
    return os.path.join(checkpoint_dir(out_dir), f"epoch_{state['epoch']:04d}.pth")


INTEGRITY_KEY = "integrity"  # {"algorithm": "sha256", "parts": {top-level key: hex digest}}


def _feed(h: Any, value: Any) -> None:
    """Hash one value of a checkpoint: type tags keep [1] from (1,) and 1 from 1.0 or True."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        h.update(f"T{t.dtype}{tuple(t.shape)};".encode())
        if t.numel():  # the raw bytes, without a copy for contiguous CPU tensors
            h.update(t.reshape(-1).contiguous().cpu().view(torch.uint8).numpy())
    elif isinstance(value, dict):
        h.update(b"D%d;" % len(value))
        for k, v in value.items():  # pickling keeps the insertion order
            _feed(h, k)
            _feed(h, v)
    elif isinstance(value, (list, tuple)):
        h.update(b"%s%d;" % (b"L" if isinstance(value, list) else b"U", len(value)))
        for v in value:
            _feed(h, v)
    elif isinstance(value, (bytes, bytearray)):
        h.update(b"B%d;" % len(value))
        h.update(value)
    else:  # str, int, float, bool, None, torch.Size/dtype: repr round-trips them exactly
        h.update(f"{type(value).__name__}:{value!r};".encode())


def integrity_digest(state: dict[str, Any]) -> dict[str, Any]:
    """The SHA-256 of every top-level entry but the digest itself (see the module docstring)."""
    parts = {}
    for key, value in state.items():
        if key != INTEGRITY_KEY:
            h = hashlib.sha256()
            _feed(h, value)
            parts[key] = h.hexdigest()
    return {"algorithm": "sha256", "parts": parts}


def verify_integrity(obj: Any, path: str, label: str = "checkpoint") -> None:
    """Raise DamagedCheckpoint when the file's stored digest does not match what was read."""
    if not isinstance(obj, dict) or not isinstance(obj.get(INTEGRITY_KEY), dict):
        return  # an older checkpoint or a bare state dict: nothing to check against
    stored = obj[INTEGRITY_KEY].get("parts", {})
    now = integrity_digest(obj)["parts"]
    bad = sorted(k for k in set(stored) | set(now) if stored.get(k) != now.get(k))
    if bad:
        raise DamagedCheckpoint(
            f"{label} {path} is damaged: its contents changed after it was written (SHA-256 mismatch in "
            f"{', '.join(map(str, bad))}; bit rot or a bad copy), so it is not used. Use an older checkpoint "
            "of the run (epoch_NNNN.pth) or an intact copy of this file")


def save(state: dict[str, Any], out_dir: str, is_best: bool, keep: int) -> str:
    """Write epoch_NNNN.pth (or step_NNNNNNNN.pth mid-epoch) with its integrity digest, point
    last.pth (and best.pth) at it, then prune the oldest files of that kind beyond ``keep``
    (with their .dcp shard folders)."""
    folder = checkpoint_dir(out_dir)
    os.makedirs(folder, exist_ok=True)
    kind = "step" if state.get("samples_in_epoch") else "epoch"
    path = checkpoint_path(out_dir, state)
    state = {**state, INTEGRITY_KEY: integrity_digest(state)}
    _atomic_save(state, path)
    _atomic_link(path, os.path.join(folder, "last.pth"))
    if is_best:
        _atomic_link(path, os.path.join(folder, "best.pth"))
    # Prune only now that the new checkpoint is complete.
    existing = numbered_checkpoints(out_dir, kind)
    pinned = {_sharded_folder(p) for p in (os.path.join(folder, "last.pth"), os.path.join(folder, "best.pth"))}
    for old in existing[:-keep] if keep > 0 else existing:
        if old != path:
            os.remove(old)
            shards = old[:-len(".pth")] + ".dcp"
            if os.path.isdir(shards) and shards not in pinned:  # best.pth may still need its shards
                shutil.rmtree(shards)
    return path


def _sharded_folder(pth: str) -> str | None:
    """The .dcp folder that a sharded checkpoint file (or link) refers to."""
    try:
        # mmap: only the small "sharded" entry is needed, not the tensors of the whole file
        ref = (torch.load(pth, map_location="cpu", weights_only=True, mmap=True).get("sharded")
               if os.path.isfile(pth) else None)
    except Exception:  # noqa: BLE001 - an unreadable file pins nothing
        return None
    return os.path.join(os.path.dirname(pth), ref) if ref else None


class UnreadableCheckpoint(UserError):
    """The file is not a torch.save file: truncated, corrupt, or something else entirely."""


class DamagedCheckpoint(UnreadableCheckpoint):
    """The file reads, but its integrity digest says its bytes changed after it was written."""


def load(path: str, label: str = "checkpoint") -> dict[str, Any]:
    """torch.load(weights_only=True): tensors and plain containers only, so loading runs no code.

    A file whose pickle names other Python objects is refused (UserError); a file that cannot be
    read at all raises UnreadableCheckpoint, and one whose integrity digest does not match raises
    DamagedCheckpoint (both UserErrors, which auto-resume skips).
    """
    if not os.path.isfile(path):
        raise UserError(f"{label} {path} does not exist")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch wraps the reason in boilerplate; the line naming a GLOBAL is a refusal.
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "GLOBAL" in ln), None)
        if why is None:
            raise UnreadableCheckpoint(f"{label} {path} cannot be read as a PyTorch file ({lines[-1] if lines else e})") from None
        raise UserError(
            f"refused to load {label} {path}: it holds Python objects besides tensors, and unpickling them "
            f"could run code, so torch.load(weights_only=True) refused it ({why}). If you trust the file, "
            "re-save its state dict: torch.save(model.state_dict(), 'clean.pth')"
        ) from None
    except Exception as e:  # noqa: BLE001 - truncated zip archives raise RuntimeError and others
        raise UnreadableCheckpoint(f"{label} {path} cannot be read as a PyTorch file ({type(e).__name__}: {e})") from None
    verify_integrity(obj, path, label)
    return obj


def resume_candidates(out_dir: str) -> list[str]:
    """The checkpoint files auto-resume tries, in order: last.pth, then epoch/step files, newest first."""
    numbered = numbered_checkpoints(out_dir, "epoch") + numbered_checkpoints(out_dir, "step")
    candidates = [os.path.join(checkpoint_dir(out_dir), "last.pth")]
    candidates += sorted(numbered, key=os.path.getmtime, reverse=True)
    return [p for p in candidates if os.path.isfile(p)]


def load_latest(out_dir: str) -> tuple[dict[str, Any] | None, str | None]:
    """The newest intact checkpoint: last.pth, else the newest epoch/step file that loads and
    passes its integrity check. (None, None) when there is none; a UserError when there are
    checkpoints but every one is unreadable or damaged (starting over would overwrite them)."""
    tried: set[tuple[int, int]] = set()  # last.pth and best.pth are hard links: read each file once
    failed: list[str] = []
    for path in resume_candidates(out_dir):
        inode = (os.stat(path).st_dev, os.stat(path).st_ino)
        if inode in tried:
            continue
        tried.add(inode)
        try:
            return load(path), path
        except UnreadableCheckpoint as e:  # a truncated, corrupt or damaged file: try an older one
            kind = "damaged" if isinstance(e, DamagedCheckpoint) else "unreadable"
            log.warning("skipping %s checkpoint %s (%s)", kind, path, e)
            failed.append(os.path.basename(path))
    if failed:
        raise UserError(f"no intact checkpoint to resume in {checkpoint_dir(out_dir)}: {', '.join(failed)} "
                        "cannot be used (see the warnings above). Starting over there would overwrite them: "
                        f"move them away (mv {out_dir} {out_dir.rstrip('/')}.damaged) or give another OUT_DIR")
    return None, None


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


# ---------------------------------------------------------------------------------------------
# The state of a run: what the loop carries and what a checkpoint restores
# ---------------------------------------------------------------------------------------------
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
    facts: dict[str, Any] = field(default_factory=dict)  # the data's sizes (resume_check.run_facts), checked on resume

    COUNTERS = ("epoch", "samples_in_epoch", "global_step", "best_metric", "best_epoch", "evals_since_best")


class CheckpointTimer:
    """Rank 0's clock for TRAIN.CKPT_PERIOD_MIN (the decision is then shared with any_rank)."""

    def __init__(self, minutes: float) -> None:
        self.period_s, self.last = minutes * 60.0, time.monotonic()

    def due(self) -> bool:
        return self.period_s > 0 and time.monotonic() - self.last >= self.period_s

    def reset(self) -> None:
        self.last = time.monotonic()


def _all_finite(state_dict: dict[str, torch.Tensor]) -> bool:
    floats = [t for t in state_dict.values() if t.is_floating_point()]
    return not floats or bool(torch.isfinite(torch.stack(torch._foreach_norm(floats))).all())


def save_run(cfg: Any, ctx: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             extra: dict[str, Any], state: TrainState, timer: CheckpointTimer, is_best: bool = False,
             train_sums: torch.Tensor | None = None) -> None:
    """Collective: every rank calls it. Rank 0 writes everything that decides the rest of the run;
    ``extra`` holds the state of other parts (grad scaler, EMA)."""
    from distribuuuu import distributed, models, sharding  # models imports this module

    rng = distributed.all_gather_object(rng_state())  # each rank's own streams
    if hasattr(optimizer, "consolidate_state_dict"):  # ZeRO: collect the shards on rank 0
        optimizer.consolidate_state_dict(to=0)
    if train_sums is not None:  # a mid-epoch checkpoint carries the epoch's metrics so far
        train_sums = distributed.all_reduce_sum(train_sums.clone()).tolist()
    timer.reset()
    counters = {k: getattr(state, k) for k in TrainState.COUNTERS}
    record = {**extra, **counters, "cfg": cfg.dump(), "rng": rng, "world_size": ctx.world_size,
              "train_sums": train_sums, "facts": state.facts}
    net = models.unwrap(model)
    if sharding.is_sharded(net) and cfg.DIST.FSDP_STATE_DICT == "sharded":
        # Every rank writes its shards; rank 0's .pth holds the rest and names the folder.
        finite = not distributed.any_rank([not _all_finite({k: sharding.local_tensor(v)
                                                            for k, v in net.state_dict().items()})])[0]
        if finite:
            shards = checkpoint_path(cfg.OUT_DIR, counters)[:-len(".pth")] + ".dcp"
            sharding.save_sharded(net, optimizer, shards)
            record["sharded"] = os.path.basename(shards)
    elif sharding.is_sharded(net):  # gathered whole on rank 0: the same file as ddp's
        record["model"], record["optimizer"] = sharding.full_state(net, optimizer)
        finite = not ctx.is_main or _all_finite(record["model"])
    elif ctx.is_main:
        record["model"], record["optimizer"] = models.state_dict_for_saving(model), optimizer.state_dict()
        finite = _all_finite(record["model"])
    else:
        finite = True
    if ctx.is_main:
        if not finite:
            log.error("not saving a checkpoint at step %d: the weights are not finite", state.global_step)
        else:
            path = save(record, cfg.OUT_DIR, is_best=is_best, keep=cfg.TRAIN.CKPT_KEEP)
            log.info("saved %s%s", path, " (best)" if is_best else "")
    distributed.barrier()  # nobody races ahead (or exits) while rank 0 writes


def resume_run(cfg: Any, ctx: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               state: TrainState) -> dict[str, Any] | None:
    """Continue from OUT_DIR/checkpoints when TRAIN.AUTO_RESUME finds a checkpoint there; returns
    the checkpoint (for the other parts' state) or None. A checkpoint that does not fit this run
    (config, data, model or optimizer: resume_check) is refused before anything is loaded."""
    from distribuuuu import models, resume_check, sharding

    if not cfg.TRAIN.AUTO_RESUME:
        return None
    ckpt, path = load_latest(cfg.OUT_DIR)
    if ckpt is None:
        return None
    net, opt = models.unwrap(model), optimizer if cfg.TRAIN.LOAD_OPT else None
    plain = not ckpt.get("sharded") and not sharding.is_sharded(net)  # shapes of sharded state: torch checks
    resume_check.check(ckpt, path, cfg, state.facts, net if plain else None, opt if plain else None)
    if ckpt.get("sharded"):
        if not sharding.is_sharded(net):
            raise UserError(f"{path} keeps its weights in FSDP shards ({ckpt['sharded']}); resume it with "
                            "DIST.STRATEGY fsdp and more than one process")
        sharding.load_sharded(net, opt, os.path.join(checkpoint_dir(cfg.OUT_DIR), ckpt["sharded"]))
    elif sharding.is_sharded(net):
        sharding.load_full_state(net, opt, ckpt["model"], ckpt.get("optimizer"))
    else:
        net.load_state_dict(ckpt["model"])
        if opt is not None and "optimizer" in ckpt:
            optimizer.load_state_dict(ckpt["optimizer"])
    for key in TrainState.COUNTERS:
        setattr(state, key, ckpt.get(key, getattr(state, key)))
    state.resumed_sums = ckpt.get("train_sums")
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
    return ckpt

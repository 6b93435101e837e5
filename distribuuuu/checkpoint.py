"""Checkpoints: atomic writes, keep-k pruning, auto-resume, safe loading.

Layout under OUT_DIR/checkpoints/: ``epoch_0007.pth`` (the newest TRAIN.CKPT_KEEP are kept),
``last.pth`` and ``best.pth``. A checkpoint is a plain dict of tensors and Python values:
  model (state dict without any ``module.`` prefix), optimizer, epoch (epochs completed),
  global_step, best_top1, best_epoch, cfg (YAML text), rng (python/numpy/torch[/cuda] of rank 0).
Only rank 0 writes. Every read uses ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import glob
import logging
import os
import pickle
import random
import re
import shutil
from typing import Any

import numpy as np
import torch

from distribuuuu.errors import UserError

log = logging.getLogger("distribuuuu")

_EPOCH_FILE = re.compile(r"epoch_(\d+)\.pth$")


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


def epoch_checkpoints(out_dir: str) -> list[str]:
    """Per-epoch checkpoint paths, oldest first."""
    paths = glob.glob(os.path.join(checkpoint_dir(out_dir), "epoch_*.pth"))
    return sorted((p for p in paths if _EPOCH_FILE.search(p)),
                  key=lambda p: int(_EPOCH_FILE.search(p).group(1)))


def save(state: dict[str, Any], out_dir: str, is_best: bool, keep: int) -> str:
    """Write epoch_NNNN.pth, point last.pth (and best.pth) at it, then prune old epoch files."""
    folder = checkpoint_dir(out_dir)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"epoch_{state['epoch']:04d}.pth")
    _atomic_save(state, path)
    _atomic_link(path, os.path.join(folder, "last.pth"))
    if is_best:
        _atomic_link(path, os.path.join(folder, "best.pth"))
    # Prune only now that the new checkpoint is complete.
    for old in epoch_checkpoints(out_dir)[:-keep] if keep > 0 else epoch_checkpoints(out_dir):
        if old != path:
            os.remove(old)
    return path


class UnreadableCheckpoint(UserError):
    """The file is not a torch.save file: truncated, corrupt, or something else entirely."""


def load(path: str, label: str = "checkpoint") -> dict[str, Any]:
    """torch.load(weights_only=True): tensors and plain containers only, so loading runs no code.

    A file whose pickle names other Python objects is refused (UserError); a file that cannot be
    read at all raises UnreadableCheckpoint (a UserError too, which auto-resume skips).
    """
    if not os.path.isfile(path):
        raise UserError(f"{label} {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
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


def load_latest(out_dir: str) -> tuple[dict[str, Any] | None, str | None]:
    """The newest readable checkpoint: last.pth, else the newest epoch file that loads."""
    candidates = [os.path.join(checkpoint_dir(out_dir), "last.pth")]
    candidates += list(reversed(epoch_checkpoints(out_dir)))
    for path in candidates:
        if not os.path.isfile(path):
            continue
        try:
            return load(path), path
        except UnreadableCheckpoint as e:  # a truncated or corrupt file: try an older one
            log.warning("skipping unreadable checkpoint %s (%s)", path, e)
    return None, None


def rng_state() -> dict[str, Any]:
    """RNG states as plain tensors/lists (loadable with weights_only=True)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    name, key, *rest = state["numpy"]
    np.random.set_state((name, key.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x: Any) -> Any:
    """random.setstate wants tuples all the way down; pickling may give lists."""
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x

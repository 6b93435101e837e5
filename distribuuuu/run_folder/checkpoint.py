"""Checkpoint files: atomic writes, keep-k pruning, finding the newest intact one, safe and
verified loading. Their names under OUT_DIR/checkpoints/ are layout.py's; what a checkpoint holds, and
resuming from one, is the training side's (engine/trainer.py, with the strategy's model and optimizer
entries). Only rank 0 writes. Every read uses ``torch.load(weights_only=True)``: no code runs.

Integrity: every checkpoint written by ``save`` holds ``integrity``, a SHA-256 of each other top-level
entry (tensors' dtype, shape and bytes, and every other value), which ``load`` verifies before anything
uses the file, because torch.load does not check the zip archive's CRC-32s (a flipped bit in a tensor
loads silently: docs/reliability.md, "Corrupt or unsafe files"). The digest lives inside the file, so it travels
with copies and with the hard links last.pth and best.pth. Files without it (older checkpoints, bare
state dicts) load unchecked. A file whose digest does not match raises DamagedCheckpoint: auto-resume
skips it with a warning and uses the next older intact checkpoint; eval, predict and export refuse it
(exit 2). Sharded .dcp folders (FSDP_STATE_DICT sharded) are not covered: torch.distributed.checkpoint
has its own metadata.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import logging
import os
import pickle
import re
import shutil
from typing import Any

import torch

from distribuuuu import files
from distribuuuu.errors import UserError
from distribuuuu.launch import signals
from distribuuuu.run_folder.layout import BEST, LAST, checkpoint_dir

log = logging.getLogger("distribuuuu")

_NUMBERED = re.compile(r"(epoch|step)_(\d+)\.pth$")


def best_or_last(out_dir: str) -> str | None:
    """The run's chosen checkpoint, the one eval, predict, export and the final test use: best.pth
    (best on the validation split), else last.pth (no finite evaluation yet), else None."""
    paths = (os.path.join(checkpoint_dir(out_dir), name) for name in (BEST, LAST))
    return next((p for p in paths if os.path.isfile(p)), None)


def _atomic_save(obj: Any, path: str) -> None:
    """torch.save through files.atomic_write: a crash at any point leaves either the old file or the
    new one, never half of one; the temporary name does not match the patterns resume looks for."""
    try:
        files.atomic_write(path, lambda f: torch.save(obj, f))
    except Exception as e:  # torch wraps ENOSPC in a RuntimeError: say plainly what happened
        interrupt = signals.interruption(e)
        if interrupt is not None:  # a stop signal mid-write; torch's zip writer then failed closing
            raise interrupt from None  # a stop (exit 130/143), not a write error
        if _disk_full(e):  # one line (exit 2): the cause, where, and what the run can go on from
            raise DiskFull(f"No space left on device writing checkpoint {os.path.basename(path)} in "
                           f"{os.path.dirname(path)}; {_what_is_kept(path)}; free space there (or give "
                           "another OUT_DIR) and run the same command again") from None
        raise OSError(f"writing checkpoint {path} failed ({type(e).__name__}: {e}); {_what_is_kept(path)}") from e


class DiskFull(UserError, OSError):
    """A checkpoint could not be written for lack of space: one line, exit 2 (docs/reliability.md).
    An OSError too, for callers that catch failed writes."""


def _disk_full(error: BaseException) -> bool:
    """Whether ENOSPC is anywhere in error's chain: torch's zip writer reports it as a RuntimeError
    ("unexpected pos ...") whose context holds the real OSError, or only in its message."""
    return any(getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e)
               for e in signals.chain(error))


def _what_is_kept(path: str) -> str:
    """What a failed write of path leaves to resume from: the checkpoint last.pth names, or nothing."""
    folder = os.path.dirname(path)
    last = os.path.join(folder, LAST)
    others = [p for p in glob.glob(os.path.join(folder, "*_*.pth")) if p != path and _NUMBERED.search(p)]
    if os.path.isfile(last):
        return "last.pth, the previous checkpoint, is intact"
    if others:
        return f"{len(others)} earlier checkpoint(s) are intact (the newest: {os.path.basename(max(others))})"
    return "no checkpoint of this run is kept yet (a re-run starts from the beginning)"


_atomic_link = files.atomic_link


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
    _atomic_link(path, os.path.join(folder, LAST))
    if is_best:
        _atomic_link(path, os.path.join(folder, BEST))
    # Prune only now that the new checkpoint is complete.
    existing = numbered_checkpoints(out_dir, kind)
    pinned = {_sharded_folder(os.path.join(folder, name)) for name in (LAST, BEST)}
    for old in existing[:-keep] if keep > 0 else existing:
        if old != path:
            os.remove(old)
            shards = old[:-len(".pth")] + ".dcp"
            if os.path.isdir(shards) and shards not in pinned:  # best.pth may still need its shards
                shutil.rmtree(shards)
    return path


def peek(path: str) -> dict[str, Any]:
    """The checkpoint's entries without reading its tensors (mmap) and without the integrity check:
    for a look at its counters or config, never for using its weights (``load`` is for that)."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _sharded_folder(pth: str) -> str | None:
    """The .dcp folder that a sharded checkpoint file (or link) refers to."""
    try:
        # mmap: only the small "sharded" entry is needed, not the tensors of the whole file
        ref = peek(pth).get("sharded") if os.path.isfile(pth) else None
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
    candidates = [os.path.join(checkpoint_dir(out_dir), LAST)]
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

"""Weights and checkpoint files: reading them safely, loading them into
a model checked name by name, and the checkpoint file format itself.
Every read uses ``torch.load(weights_only=True)``: tensors and plain
containers only, so loading runs no code.

Checkpoint files (``save_checkpoint``, ``load_checkpoint``): written
atomically (files.atomic_write) with ``integrity``, a SHA-256 of each
other top-level entry (tensors' dtype, shape and bytes, and every other
value), which ``load_checkpoint`` verifies before anything uses the
file, because torch.load does not check the zip archive's CRC-32s (a
flipped bit in a tensor loads silently: docs/reliability.md, "Corrupt or
unsafe files"). The digest lives inside the file, so it travels with
copies and hard links. Files without it (older checkpoints, bare state
dicts) load unchecked. A file whose digest does not match raises
DamagedCheckpoint: auto-resume skips it with a warning and uses the next
older intact checkpoint; eval, predict and export refuse it (exit 2).
Sharded .dcp folders (FSDP_STATE_DICT sharded) are not covered:
torch.distributed.checkpoint has its own metadata. Where checkpoints
live in a run folder, and which one a run resumes: run_folder/.

What a weights file may hold (``read_state_dict``): a distribuuuu
checkpoint (its ``model`` entry: the raw weights, not the EMA),
``{"state_dict": ...}`` or ``{"model": ...}`` as other trainers write, a
bare state dict (.pt / .pth), or .safetensors. DDP's ``module.`` and
torch.compile's ``_orig_mod.`` prefixes are dropped.

``load_file`` checks every tensor name and shape against the model
before anything is loaded; each problem is a ``UserError`` (exit 2)
naming the tensor. Two differences may be allowed:

  new_head     the classifier (heads.py) has another number of classes than the model: every other
               tensor is loaded, the head keeps the model's own initialisation, and ONE line says so
               (fine-tuning onto another class count: MODEL.WEIGHTS in training, MODEL.PRETRAINED)
  adapt_stem   the first conv has another kernel (MODEL.SMALL_STEM: kept as initialised):
               MODEL.PRETRAINED only. Other input channels (1 <-> 3: adapt_input_channels) are
               adapted whenever new_head or adapt_stem is allowed (training)

and ``fresh_head`` never loads the classifier, whatever its size
(MODEL.PRETRAINED PATH: a start for a new task, whose classes are not
the file's even when they are as many).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import pickle
from typing import Any

import safetensors.torch
import torch
import torch.nn as nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from distribuuuu import files, heads
from distribuuuu.errors import UserError

log = logging.getLogger("distribuuuu")

_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP/DataParallel, torch.compile


# ---------------------------------------------------------------------------------------------
# Checkpoint files (see the module docstring)
# ---------------------------------------------------------------------------------------------
CARD_KEY = "card"  # the checkpoint entry holding the model card (model_card.py)
INTEGRITY_KEY = "integrity"  # {"algorithm": "sha256", "parts": {top-level key: hex digest}}


class UnreadableCheckpoint(UserError):
    """The file is not a torch.save file: truncated, corrupt, or
    something else entirely."""


class DamagedCheckpoint(UnreadableCheckpoint):
    """The file reads, but its integrity digest says its bytes changed
    after it was written."""


def _feed(h: Any, value: Any) -> Any:
    """Hash one value of a checkpoint into h (returned): type tags keep
    [1] from (1,) and 1 from 1.0 or True."""
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
        h.update(b"B%d;%s" % (len(value), value))
    else:  # str, int, float, bool, None, torch.Size/dtype: repr round-trips them exactly
        h.update(f"{type(value).__name__}:{value!r};".encode())
    return h


def integrity_digest(state: dict[str, Any]) -> dict[str, Any]:
    """The SHA-256 of every top-level entry but the digest itself (see
    the module docstring)."""
    parts = {
        key: _feed(hashlib.sha256(), value).hexdigest()
        for key, value in state.items()
        if key != INTEGRITY_KEY
    }
    return {"algorithm": "sha256", "parts": parts}


def save_checkpoint(state: dict[str, Any], path: str) -> None:
    """torch.save of state with its integrity digest through
    files.atomic_write: a crash at any point leaves the old file or the
    new one, never half of one. Errors propagate (the caller says what
    the run keeps)."""
    state = {**state, INTEGRITY_KEY: integrity_digest(state)}
    files.atomic_write(path, lambda f: torch.save(state, f))


def peek_checkpoint(path: str) -> dict[str, Any]:
    """The checkpoint's entries without reading its tensors (mmap) and
    without the integrity check: for a look at its counters or config,
    never for using its weights (load_checkpoint is for that)."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def load_checkpoint(path: str, label: str = "checkpoint") -> Any:
    """The file's contents, its integrity digest verified. A file whose
    pickle names other Python objects is refused (UserError); one that
    cannot be read at all raises UnreadableCheckpoint, one whose digest
    does not match DamagedCheckpoint (both UserErrors, which auto-resume
    skips)."""
    if not os.path.isfile(path):
        raise UserError(f"{label} {path} does not exist")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - truncated zip archives raise RuntimeError and others
        raise _unreadable(path, label, e) from None
    stored = obj.get(INTEGRITY_KEY) if isinstance(obj, dict) else None
    if isinstance(
        stored, dict
    ):  # older checkpoints and bare state dicts have nothing to check against
        now, then = integrity_digest(obj)["parts"], stored.get("parts", {})
        bad = sorted(k for k in {*then, *now} if then.get(k) != now.get(k))
        if bad:
            raise DamagedCheckpoint(
                f"{label} {path} is damaged: its contents changed after it was written (SHA-256 "
                f"mismatch in {', '.join(map(str, bad))}; bit rot or a bad copy), so it is not "
                "used. Use an older checkpoint of the run (epoch_NNNN.pth) or an intact copy of "
                "this file"
            )
    return obj


def _unreadable(path: str, label: str, error: Exception) -> UserError:
    """Why torch.load(weights_only=True) failed: a refusal (the pickle
    names a GLOBAL: other Python objects, which could run code) or a
    file that is not a PyTorch file at all."""
    if not isinstance(error, pickle.UnpicklingError):
        return UnreadableCheckpoint(
            f"{label} {path} cannot be read as a PyTorch file ({type(error).__name__}: {error})"
        )
    lines = [
        ln.strip() for ln in str(error).splitlines() if ln.strip()
    ]  # torch wraps the reason in boilerplate
    why = next((ln for ln in lines if "GLOBAL" in ln), None)
    if why is None:
        return UnreadableCheckpoint(
            f"{label} {path} cannot be read as a PyTorch file ({lines[-1] if lines else error})"
        )
    return UserError(
        f"refused to load {label} {path}: it holds Python objects besides tensors, and unpickling "
        f"them could run code, so torch.load(weights_only=True) refused it ({why}). If you trust "
        "the file, re-save its state dict: torch.save(model.state_dict(), 'clean.pth')"
    )


# ---------------------------------------------------------------------------------------------
# Weights files into a model
# ---------------------------------------------------------------------------------------------


def first_conv(model: nn.Module) -> tuple[str, nn.Conv2d]:
    """The name and module of the model's first convolution (its stem)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            return name, module
    raise UserError(
        f"{type(model).__name__} has no convolution to take MODEL.IN_CHANS; use MODEL.IN_CHANS 3"
    )


def read_state_dict(path: str, label: str) -> dict[str, torch.Tensor]:
    """The state dict in a file (see the module docstring for the forms
    accepted)."""
    if os.path.isdir(path):
        raise UserError(
            f"{label} {path} is a folder; give a weights file (a run folder keeps its "
            "checkpoints in checkpoints/: best.pth, last.pth)"
        )
    if not os.path.isfile(path):
        raise UserError(
            f"{label} {path} does not exist; give the path of a weights file (a checkpoint such as "
            "OUT_DIR/checkpoints/best.pth, a state dict .pth, or .safetensors)"
        )
    if path.endswith(".safetensors"):
        try:
            return safetensors.torch.load_file(path, device="cpu")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise UserError(f"{label} {path} is not a readable safetensors file ({e})") from None
    obj = load_checkpoint(path, label)
    if isinstance(obj, dict) and obj.get("sharded") and "model" not in obj:
        folder = os.path.join(os.path.dirname(path), obj["sharded"])
        raise UserError(
            f"{label} {path} keeps its weights sharded in {folder} (DIST.FSDP_STATE_DICT sharded); "
            "make one file with `python -m torch.distributed.checkpoint.format_utils dcp_to_torch "
            f"{folder} full.pth` and pass full.pth, or train with DIST.FSDP_STATE_DICT full"
        )
    for key in ("model", "state_dict"):  # distribuuuu checkpoints, then most other trainers
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not (
        isinstance(obj, dict) and obj and any(isinstance(v, torch.Tensor) for v in obj.values())
    ):
        raise UserError(
            f"{label} {path} holds no state dict: expected a distribuuuu checkpoint (key 'model'), "
            "a dict with 'state_dict', or a dict of parameter name -> tensor"
        )
    return obj


def strip_wrapper_prefixes(state: dict[str, Any]) -> dict[str, Any]:
    """Drop 'module.' / '_orig_mod.' when every key has it: wrapper
    names, not part of the model. Only then: torch's helper alone would
    also strip a model's own layer named 'module'."""
    state = collections.OrderedDict(state)  # a copy: torch's helper renames in place
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if state and all(k.startswith(prefix) for k in state):
                consume_prefix_in_state_dict_if_present(state, prefix)
                stripped = True
    return dict(state)


def _fmt_shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _few(keys: list[str]) -> str:
    return ", ".join(keys[:5]) + (
        f", ... ({len(keys)} in all)" if len(keys) > 5 else f" ({len(keys)})"
    )


def adapt_input_channels(weight: torch.Tensor, chans: int) -> torch.Tensor:
    """A first conv's weight [out, c, kh, kw] made to take chans input
    channels. From or to 1 channel, a gray image answers as before (its
    value g on every channel of the old stem, once on the new one):

      to 1 channel    the sum over the c channels (a gray value g on every channel gave sum(w) * g)
      from 1 channel  the weight repeated chans times and divided by chans
      otherwise       the c channels repeated in turn up to chans, scaled by c / chans (only roughly
                      the same)

    Written here: timm's adapt_input_conv returns a 1-channel weight
    unchanged for 3 channels, which then failed in load_state_dict with
    a size-mismatch traceback (#27)."""
    have = weight.shape[1]
    if have == chans:
        return weight
    w = weight.float()
    if chans == 1:
        out = w.sum(dim=1, keepdim=True)
    else:
        index = torch.arange(chans) % have
        out = w[:, index] * (have / chans)
    return out.to(weight.dtype)


def _adapt_stem(
    model: nn.Module,
    state: dict,
    own: dict,
    mismatched: list[str],
    notes: list[str],
    keep_other_kernels: bool = True,
) -> set[str]:
    """Weights onto a stem of other input channels: adapted
    (adapt_input_channels). A stem of another kernel (MODEL.SMALL_STEM)
    is kept as initialised when keep_other_kernels (MODEL.PRETRAINED),
    else left to _check_shapes' error. Returns the stem tensors left as
    initialised."""
    stem = first_conv(model)[0] + ".weight"
    if stem not in mismatched:
        return set()
    w, want = state[stem], own[stem]
    if w.shape[0] == want.shape[0] and w.shape[2:] == want.shape[2:]:
        mismatched.remove(stem)
        state[stem] = adapt_input_channels(w, want.shape[1])
        notes.append(f"{stem} adapted from {w.shape[1]} to {want.shape[1]} input channels")
        return set()
    if not keep_other_kernels:
        return set()
    mismatched.remove(stem)
    del state[stem]
    notes.append(
        f"{stem} kept freshly initialised (the file's {_fmt_shape(w)} does not fit "
        f"{_fmt_shape(want)}, e.g. after MODEL.SMALL_STEM)"
    )
    return {stem}


def _head_classes(keys: list[str], state: dict, own: dict) -> tuple[str, int, int]:
    """(a head tensor, classes in the file, classes in the model), from
    the weight when it is there."""
    k = sorted(keys, key=lambda n: not n.endswith(".weight"))[0]
    return k, state[k].shape[0], own[k].shape[0]


def trained_as(path: str) -> str:
    """What a checkpoint's model card says its model is, as the keys
    that build it ('' when the file has no card): a fine-tune whose
    model does not fit the file names them instead of leaving them to
    guess."""
    try:
        card = load_checkpoint(path).get(CARD_KEY) if path.endswith(".pth") else None
    except (UserError, AttributeError):
        return ""
    if not isinstance(card, dict) or not {"arch", "in_chans", "num_classes"} <= set(card):
        return ""
    keys = f"MODEL.ARCH {card['arch']} MODEL.IN_CHANS {card['in_chans']}"
    keys += f" MODEL.NUM_CLASSES {card['num_classes']}"
    keys += " MODEL.SMALL_STEM True" if card.get("small_stem") else ""
    return f"; its model card says it was trained as {keys} (give those keys to build that model)"


def _check_shapes(
    model: nn.Module, path: str, where: str, state: dict, own: dict, mismatched: list[str]
) -> None:
    """Refuse shape mismatches outside the classifier (UserError naming
    the first)."""
    head = heads.head_state_keys(model)
    others = [k for k in mismatched if k not in head]
    if others:
        k = others[0]
        more = f" (and {len(others) - 1} more tensors)" if len(others) > 1 else ""
        raise UserError(
            f"{where}: layer {k} has shape {_fmt_shape(state[k])} in the file but "
            f"{_fmt_shape(own[k])} in the model{more}; the file was saved from another "
            "architecture or with other MODEL.IN_CHANS, MODEL.SMALL_STEM or TRAIN.IM_SIZE "
            f"settings{trained_as(path)}"
        )


def _drop_head(
    model: nn.Module,
    where: str,
    state: dict,
    own: dict,
    mismatched: list[str],
    new_head: bool,
    fresh_head: bool,
) -> tuple[set[str], str]:
    """The classifier's tensors to leave as initialised (removed from
    state) and the ONE line to log about them once the load succeeds:
    those of another class count when new_head (else a UserError), all
    of them when fresh_head."""
    head = heads.head_state_keys(model)
    bad = [k for k in mismatched if k in head]
    drop = [k for k in head if k in state] if fresh_head else bad
    if bad and not (new_head or fresh_head):
        k, theirs, _ = _head_classes(bad, state, own)
        raise UserError(
            f"{where}: {k} has shape {_fmt_shape(state[k])} in the file but {_fmt_shape(own[k])} "
            f"in the model; set MODEL.NUM_CLASSES {theirs} to match (training from these weights "
            "re-initialises the classifier instead)"
        )
    if not drop:
        return set(), ""
    _, theirs, mine = _head_classes(drop, state, own)
    why = "; a weights file given as MODEL.PRETRAINED starts a new task" if fresh_head else ""
    line = (
        f"{where}: the classifier {heads.describe(model)} is re-initialised ({theirs} classes in "
        f"the file, {mine} in the model{why}); every other tensor is loaded"
    )
    for key in drop:
        del state[key]
    return set(drop), line


def load_file(
    model: nn.Module,
    path: str,
    label: str,
    new_head: bool = False,
    adapt_stem: bool = False,
    fresh_head: bool = False,
) -> None:
    """Load a weights file into an unwrapped model after checking every
    name and shape (UserError on a problem). new_head / adapt_stem: the
    differences allowed; fresh_head: never load the classifier (module
    docstring)."""
    where = f"{label} {path}"
    state = strip_wrapper_prefixes(read_state_dict(path, label))
    own = model.state_dict()
    notes: list[str] = []
    mismatched = [k for k in own if k in state and state[k].shape != own[k].shape]
    fresh = set()
    if mismatched and (
        adapt_stem or new_head
    ):  # training: the stem takes the data's channels (1 <-> 3)
        fresh = _adapt_stem(model, state, own, mismatched, notes, keep_other_kernels=adapt_stem)
    _check_shapes(model, path, where, state, own, mismatched)
    new, head_line = _drop_head(model, where, state, own, mismatched, new_head, fresh_head)
    fresh |= new
    # Counters such as BatchNorm's num_batches_tracked are not weights;
    # old files lack them. A file without a classifier (a backbone saved
    # alone) is fine when a new head is allowed.
    head = heads.head_state_keys(model) if new_head or fresh_head else set()
    missing = [
        k
        for k in own
        if k not in state
        and k not in fresh
        and k not in head
        and not k.endswith("num_batches_tracked")
    ]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        parts = ([f"missing from the file: {_few(missing)}"] if missing else []) + (
            [f"not in the model: {_few(unexpected)}"] if unexpected else []
        )
        raise UserError(
            f"{where} does not fit the {type(model).__name__} built from MODEL.ARCH; tensors "
            + "; tensors ".join(parts)
            + trained_as(path)
        )
    model.load_state_dict(state, strict=False)  # every difference was checked above
    if head_line:
        log.warning(head_line)
    log.info("loaded %d tensors from %s%s", len(state), where, "".join(f"; {n}" for n in notes))

"""`distribuuuu export`: the trained model as files that load without
distribuuuu or its model code, each checked against the eager model.

    distribuuuu export [--cfg FILE] [--out DIR] [--format LIST]
        [--tol 1e-4] [--batch 4] --checkpoint PATH [KEY VALUE ...]

Without --cfg the config stored in the checkpoint is used
(inference.py). Writes into --out (default OUT_DIR/export; without
--cfg, the checkpoint's run folder/export) the formats of --format
(default pt2,onnx,safetensors), each file carrying the model card
(model_card.py: config, class names, preprocessing, temperature) as
JSON:
  model.pt2             torch.export of the eval-mode model, a dynamic
                        batch dimension; torch.export.load(path).module()
                        runs it, extra_files={"model_card.json": ""}
                        gives the card
  model.onnx            torch's dynamo ONNX exporter, a dynamic batch
                        dimension, checked by onnx.checker; the card in
                        metadata_props "model_card". Needs the onnx
                        extra: without it the default list skips it,
                        with a line saying so
  model.safetensors     the weights alone (MODEL.WEIGHTS takes it); the
                        card in its metadata "model_card"
  model.torchscript.pt  only when asked (torchscript): torch.jit.trace,
                        which torch deprecates; the card as for pt2
  export.json           input shape, files, the differences measured
                        below and the card ("card")
Every file outputs the model's logits, undivided: the probabilities are
softmax(logits / card["temperature"]) (calibration.py), as predict
computes them; docs/tour.md ("Use an exported model without
distribuuuu") shows a consumer's whole program.

Each file is written into a temporary folder inside --out, loaded back
and run on a random batch and on a batch of another size (which catches
shapes baked into a graph); only a file whose largest absolute
difference from the eager model's logits is within --tol is moved into
--out. A file that fails (or whose export raises) is not kept, an older
one of that name is removed, and the command exits with status 1.
Exports run on the CPU.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

from distribuuuu.errors import UserError
from distribuuuu.files import atomic_write, output_problem

# torch and models are imported inside the functions, after the checks
# of the arguments (see predict.py); onnx and onnxruntime too, being
# optional.

DEFAULT_TOL = 1e-4  # absolute, on logits: float32 reorderings stay around 1e-6
CARD_FILE = "model_card.json"  # the pt2 / TorchScript archive's extra file holding the model card
CARD_METADATA = "model_card"  # the safetensors metadata / ONNX metadata_props key holding it
FILES = {
    "pt2": "model.pt2",
    "onnx": "model.onnx",
    "safetensors": "model.safetensors",
    "torchscript": "model.torchscript.pt",
}
DEFAULT_FORMATS = ("pt2", "onnx", "safetensors")
ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")
TORCHSCRIPT_NOTE = (
    "TorchScript: torch.jit.trace and torch.jit.load are deprecated in this torch (its "
    "FutureWarnings are silenced here); model.pt2 is their successor"
)


def chosen_formats(text: str | None) -> tuple[list[str], str]:
    """--format's list (default: DEFAULT_FORMATS, ONNX left out with a
    note when its packages are missing) and the note; an unknown format,
    or ONNX asked for without its packages, is a UserError."""
    formats = list(DEFAULT_FORMATS) if text is None else text.split(",")
    unknown = [f for f in formats if f not in FILES]
    if unknown or not formats:
        raise UserError(
            f"--format {text!r}: unknown format {', '.join(unknown)}; give a comma-separated list "
            f"of {', '.join(FILES)}"
        )
    missing = [p for p in ONNX_PACKAGES if importlib.util.find_spec(p) is None]
    if "onnx" not in formats or not missing:
        return formats, ""
    needs = f"ONNX needs {', '.join(missing)}: pip install 'distribuuuu[onnx]'"
    if text is not None:
        raise UserError(f"--format onnx: {needs}")
    return [f for f in formats if f != "onnx"], f"ONNX skipped: {needs}"


def load_exported(path: str) -> tuple[Any, Callable[[Any], Any]]:
    """(model card, images -> logits) of a model.pt2 or model.onnx that
    export wrote (predict --model, and export's own check)."""
    from distribuuuu.model_card import ModelCard

    if not os.path.isfile(path):
        raise UserError(f"--model {path} does not exist; give a model.pt2 or model.onnx file")
    if not path.endswith((".pt2", ".onnx")):
        raise UserError(
            f"--model {path}: not a .pt2 or .onnx file; for a checkpoint or weights, use "
            f"--checkpoint {path}"
        )
    try:
        if path.endswith(".pt2"):
            card_json, run = _pt2_program(path)
        else:
            card_json, run = _onnx_session(path)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - torch, zipfile and onnxruntime raise their own types
        raise UserError(
            f"--model {path} cannot be loaded ({_first_line(e)}); give a model.pt2 or model.onnx "
            "that `distribuuuu export` wrote"
        ) from None
    if not card_json:
        raise UserError(
            f"--model {path} holds no model card: give a file that `distribuuuu export` wrote"
        )
    return ModelCard.from_dict(json.loads(card_json)), run


def _pt2_program(path: str) -> tuple[str, Callable[[Any], Any]]:
    """The card in a model.pt2 archive, and its program as a module."""
    import torch

    extra = {CARD_FILE: ""}
    logging.disable(logging.WARNING)  # torch logs a bad file's traceback: our one line says it
    try:
        program = torch.export.load(path, extra_files=extra)
    finally:
        logging.disable(logging.NOTSET)
    return extra[CARD_FILE], program.module()


def _onnx_session(path: str) -> tuple[str, Callable[[Any], Any]]:
    """The card in an ONNX file's metadata, and its onnxruntime
    session as a function."""
    import torch

    if importlib.util.find_spec("onnxruntime") is None:
        raise UserError(f"--model {path}: running ONNX needs onnxruntime: pip install onnxruntime")
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    card_json = session.get_modelmeta().custom_metadata_map.get(CARD_METADATA, "")

    def run(images: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(session.run(None, {"images": images.numpy()})[0])

    return card_json, run


def _save_pt2(model: Any, example: Any, path: str, card_json: str) -> None:
    import torch

    batch = torch.export.Dim("batch")
    program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    torch.export.save(program, path, extra_files={CARD_FILE: card_json})


def _save_onnx(model: Any, example: Any, path: str, card_json: str) -> None:
    import onnx
    import torch

    program = torch.onnx.export(
        model,
        (example,),
        input_names=["images"],
        output_names=["logits"],
        dynamic_shapes=({0: torch.export.Dim("batch")},),
        dynamo=True,
        verbose=False,
    )
    program.model.metadata_props[CARD_METADATA] = card_json
    program.save(path)  # weights beyond protobuf's 2 GB go beside it, in model.onnx.data
    onnx.checker.check_model(path)


def _save_safetensors(model: Any, example: Any, path: str, card_json: str) -> None:
    import safetensors.torch

    # save_model handles tensors shared between parameters; metadata is
    # str -> str
    safetensors.torch.save_model(model, path, metadata={CARD_METADATA: card_json})


def _save_torchscript(model: Any, example: Any, path: str, card_json: str) -> None:
    import torch

    with warnings.catch_warnings():  # said once, by TORCHSCRIPT_NOTE
        warnings.simplefilter("ignore", FutureWarning)
        with torch.no_grad():
            torch.jit.trace(model, example).save(path, _extra_files={CARD_FILE: card_json})


SAVERS = {
    "pt2": _save_pt2,
    "onnx": _save_onnx,
    "safetensors": _save_safetensors,
    "torchscript": _save_torchscript,
}


def _loaded_back(fmt: str, path: str, cfg: Any) -> Callable[[Any], Any]:
    """The written file as a function images -> logits, loaded as its
    users load it."""
    import torch

    if fmt == "safetensors":
        from distribuuuu import models

        fresh_cfg = cfg.clone()
        fresh_cfg.defrost()
        fresh_cfg.MODEL.WEIGHTS = None
        fresh_cfg.MODEL.PRETRAINED = False
        fresh = models.build_model(fresh_cfg)
        models.load_weights(fresh, path)  # the loader MODEL.WEIGHTS uses: names and shapes checked
        return fresh.eval()
    if fmt == "torchscript":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return torch.jit.load(path, map_location="cpu")
    return load_exported(path)[1]


def _checked(
    fmt: str, model: Any, batches: list[Any], expected: list[Any], path: str, cfg: Any, card: Any
) -> tuple[float | None, str]:
    """Write one format to path, load it back: (max |exported - eager|
    over the batches, or None, and what went wrong)."""
    import torch

    try:
        SAVERS[fmt](model, batches[0], path, card.to_json())
        run = _loaded_back(fmt, path, cfg)
        with torch.no_grad():
            diffs = [float((run(x).float() - y).abs().max()) for x, y in zip(batches, expected)]
    except Exception as e:  # noqa: BLE001 - an exporter's failure is reported, the rest still run
        return None, _first_line(e)
    return max(diffs), ""


def _move_or_drop(staging: str, out_dir: str, name: str, passed: bool) -> None:
    """A file that passed its check into out_dir (with the weights an
    ONNX file may keep beside it, name.data); for one that did not, an
    older file of that name is removed: none is left that looks
    current."""
    for part in (name, name + ".data"):
        new, old = os.path.join(staging, part), os.path.join(out_dir, part)
        if passed and os.path.exists(new):
            os.replace(new, old)
        elif os.path.exists(old):
            os.remove(old)


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def export(
    cfg: Any,
    card: Any,
    out_dir: str,
    formats: list[str],
    tol: float = DEFAULT_TOL,
    batch: int = 4,
) -> dict[str, Any]:
    """Write and check each format; returns what export.json holds. cfg
    and card: inference.prepared's (the weights resolved; the card is
    the model card each file carries)."""
    import torch  # after the checks, which need no torch

    from distribuuuu import inference

    # CPU: a graph made on a GPU would only run there
    model = inference.build(cfg, card, "cpu").model
    shape = (cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE, cfg.TRAIN.IM_SIZE)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn((b, *shape), generator=g) for b in (batch, batch + 1)]
    with torch.no_grad():
        expected = [model(x).float() for x in batches]
    os.makedirs(out_dir, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".export-", dir=out_dir)
    files, diffs, errors = {}, {}, {}
    try:
        for fmt in formats:
            name = FILES[fmt]
            diffs[fmt], errors[fmt] = _checked(
                fmt, model, batches, expected, os.path.join(staging, name), cfg, card
            )
            passed = diffs[fmt] is not None and diffs[fmt] <= tol
            _move_or_drop(staging, out_dir, name, passed)
            if passed:
                files[fmt] = os.path.join(out_dir, name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    record = {
        "arch": cfg.MODEL.ARCH,
        "num_classes": cfg.MODEL.NUM_CLASSES,
        "input_shape": ["batch", *shape],
        "outputs": "logits; probabilities: softmax(logits / card temperature)",
        "weights": cfg.MODEL.WEIGHTS,
        "files": files,
        "max_abs_diff": diffs,
        "errors": {fmt: e for fmt, e in errors.items() if e},
        "tol": tol,
        "torch": torch.__version__,
        "card": card.to_dict(),
    }
    text = json.dumps(record, indent=2).encode()
    atomic_write(os.path.join(out_dir, "export.json"), lambda f: f.write(text))
    return record


def main(
    cfg_file: str | None,
    opts: list[str],
    out: str | None,
    tol: float,
    batch: int,
    fmt: str | None = None,
) -> int:
    """`distribuuuu export`: print each file and its difference from the
    eager model."""
    if batch < 1 or not tol > 0:
        raise UserError(f"--batch must be at least 1 and --tol above 0, got {batch} and {tol}")
    formats, note = chosen_formats(fmt)
    if out and (problem := output_problem(out, folder=True)):  # before the checkpoint is read
        raise UserError(f"--out {problem}")
    from distribuuuu import inference  # imports torch: after the checks of the arguments

    cfg, card = inference.prepared(cfg_file, opts, "export")
    out = out or os.path.join(cfg.OUT_DIR, "export")
    if problem := output_problem(out, folder=True):  # before the export's work
        raise UserError(f"--out {problem}")
    if "torchscript" in formats:
        print(TORCHSCRIPT_NOTE)
    record = export(cfg, card, out, formats, tol, batch)
    print(
        f"exported {record['arch']} ({record['weights']}), input "
        f"{'x'.join(map(str, record['input_shape']))}, temperature {card.temperature:.4g}; "
        f"max |exported - eager| on batches of {batch} and {batch + 1} (tolerance {tol:g}):"
    )
    failed = []
    for fmt in formats:
        diff = record["max_abs_diff"][fmt]
        path = record["files"].get(fmt, f"{FILES[fmt]} not kept")
        if diff is None:
            status = f"failed: {record['errors'][fmt]}"
        else:
            status = f"{diff:.3g}" + ("" if diff <= tol else "  ABOVE TOLERANCE")
        print(f"  {fmt:<12} {path}  {status}")
        if fmt not in record["files"]:
            failed.append(fmt)
    if note:
        print(note)
    if failed:
        print(
            f"error: {', '.join(failed)} not exported: its output differs from the eager model by "
            f"more than {tol:g}, or its export failed (above)",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0

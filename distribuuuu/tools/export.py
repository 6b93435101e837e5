"""`distribuuuu export`: the trained model as TorchScript, ONNX and
safetensors, each checked.

    distribuuuu export [--cfg FILE] [--out DIR] [--tol 1e-4] [--batch 4] MODEL.WEIGHTS PATH [KEY
    VALUE ...]

Without --cfg the config stored in the checkpoint is used
(inference.py). Writes into --out (default OUT_DIR/export; without
--cfg, the checkpoint's run folder/export), each file carrying the model
card (model_card.py: config, class names, preprocessing) as JSON:
  model.torchscript.pt  torch.jit.trace of the eval-mode model (load: torch.jit.load; the card:
                        torch.jit.load(path, _extra_files={"model_card.json": ""}))
  model.onnx            ONNX with a dynamic batch dimension, when the onnx package is installed
                        (the card: metadata_props "model_card")
  model.safetensors     the weights alone (load: MODEL.WEIGHTS model.safetensors, or
                        safetensors.torch; the card: safe_open(path, "pt").metadata()["model_card"])
  export.json           input shape, files, the differences measured below and the card ("card")
Each file is loaded back and run on a random batch (and on a batch of
another size, which catches shapes baked into a trace); the largest
absolute difference from the eager model's logits is printed, and the
command exits with status 1 if one exceeds --tol. Exports run on the
CPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

from distribuuuu.errors import UserError
from distribuuuu.files import output_problem

# torch and models are imported inside the functions, after the checks
# of the arguments (see predict.py); onnx, onnxruntime and safetensors
# too, being optional.

DEFAULT_TOL = 1e-4  # absolute, on logits: float32 reorderings stay around 1e-6
CARD_FILE = "model_card.json"  # the TorchScript archive's extra file holding the model card
CARD_METADATA = "model_card"  # the safetensors metadata / ONNX metadata_props key holding it


def _max_diff(run: Callable[[Any], Any], batches: list[Any], expected: list[Any]) -> float:
    import torch

    with torch.no_grad():
        return max(
            float((torch.as_tensor(run(x)).float() - y).abs().max())
            for x, y in zip(batches, expected)
        )


def _torchscript(model: Any, batches: list[Any], expected: list[Any], path: str) -> float:
    import torch

    with warnings.catch_warnings():
        # torch 2.9+ marks torch.jit as deprecated in favour of
        # torch.export; TorchScript is still what C++ (libtorch) and
        # many serving tools load, so it is kept, without the noise.
        warnings.simplefilter("ignore", FutureWarning)
        with torch.no_grad():
            torch.jit.trace(model, batches[0]).save(path)
        loaded = torch.jit.load(path, map_location="cpu")
    return _max_diff(loaded, batches, expected)


def _card_into_torchscript(path: str, card_json: str) -> None:
    """Save the TorchScript file again with the card as its extra file
    model_card.json."""
    import torch

    if os.path.isfile(path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            torch.jit.load(path, map_location="cpu").save(path, _extra_files={CARD_FILE: card_json})


def _safetensors(
    cfg: Any, model: Any, batches: list[Any], expected: list[Any], path: str, card_json: str = ""
) -> float:
    import safetensors.torch

    from distribuuuu import models

    # save_model handles tensors shared between parameters; metadata is
    # str -> str
    safetensors.torch.save_model(model, path, metadata={CARD_METADATA: card_json})
    fresh_cfg = cfg.clone()
    fresh_cfg.defrost()
    fresh_cfg.MODEL.WEIGHTS = None
    fresh_cfg.MODEL.PRETRAINED = False
    fresh = models.build_model(fresh_cfg)
    models.load_weights(fresh, path)  # the loader MODEL.WEIGHTS uses: names and shapes checked
    return _max_diff(fresh.eval(), batches, expected)


def _onnx(
    model: Any, batches: list[Any], expected: list[Any], path: str, card_json: str = ""
) -> tuple[float | None, str]:
    """(max diff or None, note). Skipped, with the reason, when a
    package it needs is missing."""
    import torch

    if importlib.util.find_spec("onnx") is None:
        return None, "ONNX skipped: the onnx package is not installed"
    # One self-contained file; protobuf caps a file at 2 GB, so larger
    # weights go beside it (.data).
    big = sum(t.numel() * t.element_size() for t in model.state_dict().values()) > 1.5 * 2**30
    try:
        torch.onnx.export(
            model,
            (batches[0],),
            path,
            input_names=["images"],
            output_names=["logits"],
            dynamic_shapes=({0: torch.export.Dim("batch")},),
            dynamo=True,
            external_data=big,
            verbose=False,
        )
    except ImportError as e:  # the exporter also needs onnxscript
        return None, f"ONNX skipped: {e}"
    import onnx

    proto = onnx.load(
        path, load_external_data=False
    )  # the card as a metadata property of the model
    onnx.helper.set_model_props(proto, {CARD_METADATA: card_json})
    onnx.save(proto, path)
    onnx.checker.check_model(path)
    if importlib.util.find_spec("onnxruntime") is None:
        return (
            None,
            "ONNX written and checked by onnx.checker; outputs not compared: onnxruntime is not "
            "installed",
        )
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    return _max_diff(
        lambda x: session.run(None, {"images": x.numpy()})[0], batches, expected
    ), "onnxruntime"


def export(
    cfg: Any, card: Any, out_dir: str, tol: float = DEFAULT_TOL, batch: int = 4
) -> dict[str, Any]:
    """Write and check every format; returns what export.json holds. cfg
    and card: inference.prepared's (the weights resolved; the card is
    the model card each file carries)."""
    import torch  # after the checks, which need no torch

    from distribuuuu import inference

    card_json = card.to_json()
    model = inference.build(
        cfg, card, "cpu"
    ).model  # CPU: a trace made on a GPU would only run there
    shape = (cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE, cfg.TRAIN.IM_SIZE)
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randn((batch, *shape), generator=g),
        torch.randn((batch + 1, *shape), generator=g),
    ]
    with torch.no_grad():
        expected = [model(x).float() for x in batches]
    os.makedirs(out_dir, exist_ok=True)
    files = {
        "torchscript": os.path.join(out_dir, "model.torchscript.pt"),
        "safetensors": os.path.join(out_dir, "model.safetensors"),
        "onnx": os.path.join(out_dir, "model.onnx"),
    }
    diffs: dict[str, float | None] = {
        "torchscript": _torchscript(model, batches, expected, files["torchscript"]),
        "safetensors": _safetensors(cfg, model, batches, expected, files["safetensors"], card_json),
    }
    _card_into_torchscript(files["torchscript"], card_json)
    diffs["onnx"], onnx_note = _onnx(model, batches, expected, files["onnx"], card_json)
    if not os.path.isfile(files["onnx"]):
        del files["onnx"]
    record = {
        "arch": cfg.MODEL.ARCH,
        "num_classes": cfg.MODEL.NUM_CLASSES,
        "input_shape": ["batch", *shape],
        "weights": cfg.MODEL.WEIGHTS,
        "files": files,
        "max_abs_diff": diffs,
        "tol": tol,
        "onnx": onnx_note,
        "torch": torch.__version__,
        "card": card.to_dict(),
    }
    with open(os.path.join(out_dir, "export.json"), "w") as f:
        json.dump(record, f, indent=2)
    return record


def main(cfg_file: str | None, opts: list[str], out: str | None, tol: float, batch: int) -> int:
    """`distribuuuu export`: print each file and its difference from the
    eager model."""
    if batch < 1 or not tol > 0:
        raise UserError(f"--batch must be at least 1 and --tol above 0, got {batch} and {tol}")
    if out and (problem := output_problem(out, folder=True)):  # before the checkpoint is read
        raise UserError(f"--out {problem}")
    from distribuuuu import inference  # imports torch: after the checks of the arguments

    cfg, card = inference.prepared(cfg_file, opts, "export")
    out = out or os.path.join(cfg.OUT_DIR, "export")
    if problem := output_problem(out, folder=True):  # before the export's work
        raise UserError(f"--out {problem}")
    record = export(cfg, card, out, tol, batch)
    print(
        f"exported {record['arch']} ({record['weights']}), input "
        f"{'x'.join(map(str, record['input_shape']))}; max |exported - eager| on batches of "
        f"{batch} and {batch + 1} (tolerance {tol:g}):"
    )
    failed = []
    for fmt, path in record["files"].items():
        diff = record["max_abs_diff"][fmt]
        note = (
            "not compared"
            if diff is None
            else f"{diff:.3g}" + ("" if diff <= tol else "  ABOVE TOLERANCE")
        )
        print(f"  {fmt:<12} {path}  {note}")
        if diff is not None and diff > tol:
            failed.append(fmt)
    if record["onnx"] != "onnxruntime":
        print(record["onnx"])
    if failed:
        print(
            f"error: {', '.join(failed)} output differs from the eager model by more than {tol:g}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0

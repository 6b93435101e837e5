"""`distribuuuu predict`: the top-k classes of image files, with
probabilities.

    distribuuuu predict --checkpoint CKPT [KEY VALUE ...] INPUT [INPUT ...]
        [--topk 5] [--output preds.csv|.json]
    distribuuuu predict --cfg FILE --checkpoint PATH [KEY VALUE ...] INPUT ...
    distribuuuu predict --model model.pt2|model.onnx INPUT ...

An INPUT is an image file, a folder (its images, recursively: image
extensions only) or a glob in quotes ('photos/*.jpg', 'data/**/*.png'),
expanded here (predict_io.py). Without --cfg the checkpoint's model card
(model_card.py) prepares the images and names the classes, and its
stored config builds the model (inference.py). With --cfg, or for a
checkpoint of an older version without a card, both are described from
the config: images go through the validation transform of its data
source, class names come from the ImageFolder tree
TRAIN.DATASET/TRAIN.SPLIT when TRAIN.DATASET is a folder, else from the
built-in source (TEST.DATASET: mnist5k digits, CIFAR names, synthetic
class numbers). With --model, a file of `distribuuuu export` runs
instead (torch.export or onnxruntime: no model code), with the card it
carries. The probabilities are softmax(logits / the card's temperature)
(calibration.py) in every case. The top-k classes are printed per
image, or written with --output FILE (CSV or JSON from the suffix, or
--format; --format without --output writes to stdout).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from PIL import Image

from distribuuuu import config
from distribuuuu.errors import UserError
from distribuuuu.files import output_problem
from distribuuuu.tools import predict_io as outputs

EXPORTED_BATCH = 64  # images per run of an exported file (predict --model has no config)
# torch, and the modules that import it (checkpoint, data, models), are
# imported inside the functions, after the checks of the arguments and
# files: a mistyped path is reported at once, not after torch's start-up
# (seconds). predict and export both start this way.


def split_opts_and_images(tokens: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separate KEY VALUE pairs from image paths, in any order.

    A token is a key when it names a config key, or when it starts with
    a key group (MODEL., TRAIN., ...) and is not an existing file, so
    that a typo gets the config's "did you mean" message.
    """

    def flat(node: Any, prefix: str = "") -> set[str]:
        return set().union(
            *[
                flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}
                for k, v in node.items()
            ]
        )

    keys = flat(config.get_defaults())
    groups = {k.split(".")[0] for k in keys if "." in k}
    opts: list[str] = []
    images: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        looks_like_key = tok.split(".")[0] in groups and "." in tok
        if tok in keys or (looks_like_key and not os.path.exists(tok)):
            if i + 1 >= len(tokens):
                raise UserError(f"config key {tok} is given without a value")
            opts += [tok, tokens[i + 1]]
            i += 2
        else:
            images.append(tok)
            i += 1
    return opts, images


def _check_images(image_paths: Sequence[str]) -> None:
    """Every file is checked before the model is built."""
    for path in image_paths:
        if not os.path.isfile(path):
            raise UserError(f"image file {path!r} does not exist")
        try:
            Image.open(path).close()  # reads the header only
        except OSError:  # PIL's UnidentifiedImageError is an OSError
            hint = (
                f"; to predict with a checkpoint, pass it as --checkpoint {path} (MODEL.WEIGHTS)"
                if path.endswith((".pth", ".pt"))
                else ""
            )
            raise UserError(
                f"cannot read {path!r} as an image: its format is not one PIL can read; give PNG, "
                f"JPEG or another image file{hint}"
            ) from None


def predict(
    cfg: Any, card: Any, image_paths: Sequence[str], topk: int = 5
) -> list[list[tuple[str, float]]]:
    """The top-k (class name, probability) of each image; cfg and card:
    inference.prepared's (the weights resolved; the card prepares the
    images and names the classes)."""
    from distribuuuu import inference  # imports torch: after the checks (see above)

    if len(card.classes) > cfg.MODEL.NUM_CLASSES:
        raise UserError(
            f"the data source has {len(card.classes)} classes but MODEL.NUM_CLASSES is "
            f"{cfg.MODEL.NUM_CLASSES}; use the config the weights were trained with"
        )
    device = inference.device_for(cfg)
    model = inference.build(cfg, card, device).model

    def run(images: Any) -> Any:
        return model(images.to(device))

    return ranked(run, card, image_paths, topk, max(1, cfg.TEST.BATCH_SIZE))


def ranked(
    run: Any, card: Any, image_paths: Sequence[str], topk: int, batch: int
) -> list[list[tuple[str, float]]]:
    """The top-k (class name, probability) of each image, run: a batch
    of the card's inputs -> logits (the eager model, or an exported
    file's)."""
    import torch

    if card.in_chans not in (1, 3):
        raise UserError(
            f"MODEL.IN_CHANS is {card.in_chans}; image files become 1 (gray) or 3 (RGB) channels"
        )
    transform = card.transform()
    names = card.classes + [str(c) for c in range(len(card.classes), card.num_classes)]
    k = max(1, min(topk, card.num_classes))
    results = []
    for start in range(0, len(image_paths), batch):
        tensors = []
        for path in image_paths[start : start + batch]:
            try:
                tensors.append(transform(Image.open(path)))
            except OSError as e:  # a file whose header was fine but whose data is not (truncated)
                raise UserError(f"cannot read {path!r} as an image: {e}") from None
        with torch.no_grad():
            logits = run(torch.stack(tensors)).float()
        top_p, top_i = (logits / card.temperature).softmax(dim=1).topk(k, dim=1)
        results += [
            [(names[i], p) for p, i in zip(ps.tolist(), idx.tolist())]
            for ps, idx in zip(top_p, top_i)
        ]
    return results


def _from_exported(
    path: str, opts: list[str], images: list[str], topk: int
) -> list[list[tuple[str, float]]]:
    """predict --model: the exported file and the card it carries; no
    config, so no KEY VALUE pairs."""
    if opts:
        raise UserError(
            f"--model {path} takes no KEY VALUE pairs ({' '.join(opts[:2])}): the file's model "
            "card says how to prepare images; for a checkpoint, use --checkpoint PATH"
        )
    from distribuuuu.tools import export

    card, run = export.load_exported(path)
    return ranked(run, card, images, topk, EXPORTED_BATCH)


def main(
    cfg_file: str | None,
    tokens: Sequence[str],
    topk: int,
    output: str | None = None,
    fmt: str | None = None,
    model: str | None = None,
) -> int:
    """`distribuuuu predict`: each image's top-k classes, printed, or
    written as CSV / JSON."""
    if model is not None and cfg_file is not None:
        raise UserError(f"--model {model} runs with the card it carries; drop --cfg {cfg_file}")
    opts, inputs = split_opts_and_images(tokens)
    if not inputs:
        raise UserError(
            "give one or more image files, folders or quoted globs after the KEY VALUE pairs, "
            "e.g. `distribuuuu predict MODEL.WEIGHTS best.pth photos/`"
        )
    if topk < 1:
        raise UserError(f"--topk must be at least 1, got {topk}")
    fmt = outputs.output_format(output, fmt)
    if output is not None and (
        problem := output_problem(output, folder=False)
    ):  # before the model is loaded
        raise UserError(f"--output {problem}")
    images = outputs.expand_inputs(inputs)
    _check_images(images)  # before torch starts: a wrong path is reported at once
    if model is not None:
        results = _from_exported(model, opts, images, topk)
    else:
        from distribuuuu import inference

        cfg, card = inference.prepared(cfg_file, opts, "predict")
        results = predict(cfg, card, images, topk)
    notes = sys.stdout
    if fmt is None:
        outputs.print_table(images, results)
    elif output is None or output == "-":
        outputs.write(sys.stdout, fmt, images, results)
        notes = sys.stderr  # stdout holds the CSV / JSON only
    else:
        with open(output, "w", newline="", encoding="utf-8") as f:
            outputs.write(f, fmt, images, results)
        print(
            f"wrote the top-{len(results[0])} classes of {len(images)} image(s) to {output} ({fmt})"
        )
    if model is None:
        for line in eval_hints(inputs, cfg_file, cfg.MODEL.WEIGHTS, card.classes):
            print(line, file=notes)
    return 0


def eval_hints(
    inputs: Sequence[str], cfg_file: str | None, weights: str, classes: Sequence[str]
) -> list[str]:
    """A line per input folder whose sub-folders are classes of the
    model: labelled images, whose accuracy `eval` gives."""
    from distribuuuu.data.sources.folder import folder_classes

    lines = []
    for path in inputs:
        found = folder_classes(path) if os.path.isdir(path) else []
        if not found or not set(found) <= set(classes):
            continue
        command = ["distribuuuu", "eval", "--checkpoint", weights, "TEST.DATASET", path]
        if cfg_file:
            command[2:2] = ["--cfg", cfg_file]
        lines.append(
            f"{path} holds class folders, {len(found)} of the model's {len(classes)} classes: "
            f"`{shlex.join(command)}` gives its accuracy"
        )
    return lines

"""`distribuuuu predict`: the top-k classes of image files, with probabilities.

    distribuuuu predict --cfg FILE [--topk 5] MODEL.WEIGHTS PATH [KEY VALUE ...] IMAGE [IMAGE ...]

Images go through the validation transform of the config's data source (distribuuuu.data), so a
file is seen as evaluation sees it. Class names come from the ImageFolder tree
TRAIN.DATASET/TRAIN.SPLIT when TRAIN.DATASET is a folder, else from the built-in source
(TEST.DATASET: mnist5k digits, CIFAR names, synthetic class numbers).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from PIL import Image

from distribuuuu import config
from distribuuuu.errors import UserError

# torch, and the modules that import it (checkpoint, data, models), are imported inside the
# functions, after the checks of the arguments and files: a mistyped path is reported at once,
# not after torch's start-up (seconds). predict and export both start this way.


def split_opts_and_images(tokens: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separate KEY VALUE pairs from image paths, in any order.

    A token is a key when it names a config key, or when it starts with a key group (MODEL., TRAIN.,
    ...) and is not an existing file, so that a typo gets the config's "did you mean" message.
    """

    def flat(node: Any, prefix: str = "") -> set[str]:
        return set().union(*[flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}
                             for k, v in node.items()])

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


def resolve_weights(cfg: Any, command: str) -> Any:
    """cfg with MODEL.WEIGHTS set: as given, else OUT_DIR/checkpoints/best.pth or last.pth."""
    if cfg.MODEL.WEIGHTS:
        if not os.path.isfile(cfg.MODEL.WEIGHTS):
            raise UserError(f"MODEL.WEIGHTS {cfg.MODEL.WEIGHTS!r} does not exist; give the path of a checkpoint "
                            "(e.g. OUT_DIR/checkpoints/best.pth) or of a weights file")
        return cfg
    from distribuuuu import checkpoint

    for name in ("best.pth", "last.pth"):
        candidate = os.path.join(checkpoint.checkpoint_dir(cfg.OUT_DIR), name)
        if os.path.isfile(candidate):
            cfg = cfg.clone()
            cfg.defrost()
            cfg.MODEL.WEIGHTS = candidate
            cfg.freeze()
            return cfg
    raise UserError(f"{command} needs trained weights: pass MODEL.WEIGHTS PATH, or an OUT_DIR whose "
                    "checkpoints/ holds best.pth or last.pth")


def device_for(cfg: Any) -> Any:
    """One process, no process group: the GPU when DEVICE allows and one is there, else the CPU."""
    import torch

    if cfg.DEVICE == "cuda" and not torch.cuda.is_available():
        raise UserError("DEVICE is cuda but no CUDA GPU is visible; use DEVICE cpu or auto")
    return torch.device("cuda" if cfg.DEVICE != "cpu" and torch.cuda.is_available() else "cpu")


def classes_and_transform(cfg: Any) -> tuple[list[str], Callable[[str], Any]]:
    """(class names in label order, path -> input tensor [C, H, W]) for the config's data source."""
    import torch
    from torchvision.transforms import v2

    from distribuuuu.data import build_dataset, sources, transforms
    from distribuuuu.data.recipe import recipe_of

    chans = cfg.MODEL.IN_CHANS
    if chans not in (1, 3):
        raise UserError(f"MODEL.IN_CHANS is {chans}; image files become 1 (gray) or 3 (RGB) channels")
    mode = "L" if chans == 1 else "RGB"
    if sources.source_kind(cfg.TRAIN.DATASET) == "folder":
        train_dir = os.path.join(cfg.TRAIN.DATASET, cfg.TRAIN.SPLIT)
        if os.path.isdir(train_dir):
            classes = sources.folder_classes(train_dir)
        else:  # a machine without the training images: numbers instead of names
            classes = [str(c) for c in range(cfg.MODEL.NUM_CLASSES)]
        # The run's eval recipe (TEST.CROP_PCT, interpolation, mean/std), as evaluation uses it.
        tf = transforms.folder_transform(False, cfg.TRAIN.IM_SIZE, cfg.TEST.IM_SIZE, chans, recipe=recipe_of(cfg))
        return classes, lambda path: tf(sources.open_image(path, mode))
    dataset = build_dataset(cfg, train=False)
    tf = getattr(dataset, "transform", None)
    images = getattr(dataset, "images", None)
    if tf is None or images is None:
        # synthetic: its images are generated already normalized, so files get [0, 1] scaling only.
        size = cfg.TRAIN.IM_SIZE
        tf, native = v2.ToDtype(torch.float32, scale=True), size
    else:
        native = images.shape[-1]  # the source's own size (28 for digits, 32 for CIFAR)

    def prepare(path: str) -> Any:
        image = sources.open_image(path, mode)
        if image.size != (native, native):
            image = image.resize((native, native))
        return tf(v2.functional.pil_to_tensor(image))  # as the stored uint8 images go through it

    return list(dataset.classes), prepare


def predict(cfg: Any, image_paths: Sequence[str], topk: int = 5) -> list[list[tuple[str, float]]]:
    """The top-k (class name, probability) of each image."""
    for path in image_paths:  # every file is checked before the model is built
        if not os.path.isfile(path):
            raise UserError(f"image file {path!r} does not exist")
        try:
            Image.open(path).close()  # reads the header only
        except OSError:  # PIL's UnidentifiedImageError is an OSError
            raise UserError(f"cannot read {path!r} as an image: its format is not one PIL can read; "
                            "give PNG, JPEG or another image file") from None
    cfg = resolve_weights(cfg, "predict")
    import torch  # here, after the checks: a mistyped path is reported without torch's start-up time

    from distribuuuu import models

    classes, prepare = classes_and_transform(cfg)
    if len(classes) > cfg.MODEL.NUM_CLASSES:
        raise UserError(f"the data source has {len(classes)} classes but MODEL.NUM_CLASSES is "
                        f"{cfg.MODEL.NUM_CLASSES}; use the config the weights were trained with")
    device = device_for(cfg)
    model = models.build_model(cfg).to(device).eval()
    names = classes + [str(c) for c in range(len(classes), cfg.MODEL.NUM_CLASSES)]
    k = max(1, min(topk, cfg.MODEL.NUM_CLASSES))
    results = []
    batch = max(1, cfg.TEST.BATCH_SIZE)
    for start in range(0, len(image_paths), batch):
        tensors = []
        for path in image_paths[start: start + batch]:
            try:
                tensors.append(prepare(path))
            except OSError as e:  # a file whose header was fine but whose data is not (truncated)
                raise UserError(f"cannot read {path!r} as an image: {e}") from None
        with torch.no_grad():
            probs = model(torch.stack(tensors).to(device)).float().softmax(dim=1)
        top_p, top_i = probs.topk(k, dim=1)
        results += [[(names[i], p) for p, i in zip(ps.tolist(), idx.tolist())] for ps, idx in zip(top_p, top_i)]
    return results


def main(cfg_file: str | None, tokens: Sequence[str], topk: int) -> int:
    """`distribuuuu predict`: print each image's top-k classes."""
    opts, images = split_opts_and_images(tokens)
    if not images:
        raise UserError("give one or more image files after the KEY VALUE pairs, e.g. "
                        "`distribuuuu predict --cfg FILE MODEL.WEIGHTS best.pth cat.jpg`")
    if topk < 1:
        raise UserError(f"--topk must be at least 1, got {topk}")
    cfg = config.load_config(cfg_file, opts)
    results = predict(cfg, images, topk)
    width = max(len(name) for top in results for name, _ in top)
    for path, top in zip(images, results):
        print(path)
        for rank, (name, p) in enumerate(top, 1):
            print(f"  {rank}. {name:<{width}}  {p:.4f}")
    return 0

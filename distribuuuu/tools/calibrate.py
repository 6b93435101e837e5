"""`distribuuuu calibrate`: a checkpoint's temperature, fitted on the
validation split and written into its model card (calibration.py), as
training does at its end for the checkpoint it chose.

    distribuuuu calibrate [--cfg FILE] --checkpoint PATH [KEY VALUE ...]

The split is the one training evaluated on: TEST.DATASET / TEST.SPLIT,
or the part of the training folder that TRAIN.VAL_SPLIT held out (KEY
VALUE pairs may name other data). One process, on the GPU when DEVICE
allows. The checkpoint file is written again (atomically, with its hard
links: best.pth, last.pth and its epoch_NNNN.pth stay one file), and the
line training logs is printed.
"""

from __future__ import annotations

from distribuuuu.errors import UserError


def main(cfg_file: str | None, opts: list[str]) -> int:
    """Fit, write into the checkpoint, print the line."""
    from distribuuuu import calibration, data, inference  # torch: after the parsing
    from distribuuuu.weights import CARD_KEY

    cfg, card = inference.prepared(cfg_file, opts, "calibrate")
    path = cfg.MODEL.WEIGHTS
    ckpt = {}
    if path.endswith(".pth"):
        ckpt = inference.read(path, "MODEL.WEIGHTS", remember=True)
    if "model" not in ckpt:
        raise UserError(
            f"calibrate writes the temperature into a checkpoint of `distribuuuu train` that "
            f"holds its weights; {path} is not one (safetensors, a bare state dict or a sharded "
            "FSDP checkpoint)"
        )
    if CARD_KEY not in ckpt:  # an older checkpoint: the card described from its config
        ckpt = {**ckpt, CARD_KEY: card.to_dict()}
    device = inference.device_for(cfg)
    model = inference.build(cfg, card, device).model
    loader = data.build_val_loader(cfg, 0, 1, device)
    fit = calibration.calibrate(model, loader, device, cfg.MODEL.NUM_CLASSES)
    written = calibration.store(path, ckpt, fit)
    kept = "" if written else " (its card held this fit already: the file is unchanged)"
    print(f"calibrated {path} | {calibration.line(fit)}{kept}")
    return 0

"""The data recipe keys: TRAIN.CROP_SCALE / CROP_RATIO / FLIP_PROB / INTERPOLATION /
MEAN / STD and TEST.CROP_PCT, on every path that builds transforms (PIL folders, the fast decode,
tensor sources in memory and per sample, predict), timm's data config, and bad values. In process."""

from __future__ import annotations

import logging
import math
import os

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from torchvision.transforms import v2

from distribuuuu import data, inference
from distribuuuu.data import loading, transforms
from distribuuuu.data.decoding import cpu
from distribuuuu.data.loading import items
from distribuuuu.data.loading.memory import pad_crop_flip
from distribuuuu.data.sources import builtin
from distribuuuu.data.transforms import Recipe, log_recipe, recipe_of
from tests.conftest import (
    TINY,
    check,
    cli_main,
    make_cfg,
    pipeline_name,
    read_metrics,
    write_constant_image_tree,
)

torch.set_num_threads(1)
CPU = torch.device("cpu")
MNIST = {"TRAIN.DATASET": "mnist5k", "TEST.DATASET": "mnist5k", "MODEL.NUM_CLASSES": 10, "MODEL.IN_CHANS": 1,
         "TRAIN.IM_SIZE": 28, "TRAIN.WORKERS": 0, "TRAIN.BATCH_SIZE": 16, "RNG_SEED": 0}
BILINEAR, BICUBIC = v2.InterpolationMode.BILINEAR, v2.InterpolationMode.BICUBIC


def _photo(path: str, size: tuple[int, int] = (60, 40)) -> str:
    """A smooth RGB image (gradients: interpolation modes give different pixels), saved as PNG."""
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    rgb = np.stack([xx * 255 // w, yy * 255 // h, (xx * yy) % 256], axis=-1).astype(np.uint8)
    Image.fromarray(rgb).save(path)
    return path


def _resized_crop(image, top: int, left: int, height: int, width: int, size: int, flip: bool = False):
    """The fast decode's geometry, written out: the crop of a uint8 [C, H, W] image resized by torch's uint8
    antialiased bilinear kernel (channels-last), maybe mirrored."""
    crop = image[None, :, top:top + height, left:left + width].contiguous(memory_format=torch.channels_last)
    out = torch.nn.functional.interpolate(crop, size=(size, size), mode="bilinear", antialias=True,
                                          align_corners=False)[0]
    return out.flip(-1) if flip else out


def _seeded(tf, image, seed: int = 7):
    """tf(image) with torch seeded; a path is read as the datasets read it (its bytes)."""
    torch.manual_seed(seed)
    return tf(open(image, "rb").read() if isinstance(image, str) else image)


def _folder_cfg(root: str, **keys):
    write_constant_image_tree(root, "train", {"a": 2, "b": 2})
    write_constant_image_tree(root, "val", {"a": 1, "b": 1})
    return make_cfg({"TRAIN.DATASET": root, "TEST.DATASET": root, "MODEL.NUM_CLASSES": 2, "TRAIN.IM_SIZE": 8,
                     "TEST.IM_SIZE": 10, "TRAIN.WORKERS": 0, "TRAIN.BATCH_SIZE": 2, "TEST.BATCH_SIZE": 2,
                     "TRAIN.TOPK": 1, **keys})


# ---------------------------------------------------------------------------------------------
# Defaults: exactly the transforms of before the keys
# ---------------------------------------------------------------------------------------------
def test_default_recipe_is_the_unset_one():
    recipe = recipe_of(make_cfg({}))
    assert recipe == Recipe()
    assert (recipe.folder_scale(), recipe.ratio, recipe.interpolation) == ((0.08, 1.0), (0.75, 4 / 3), "bilinear")
    assert recipe.flip_prob(True) == 0.5 and recipe.flip_prob(False) == 0.0
    assert recipe.eval_resize(224, 256) == 256


def test_default_folder_transforms_equal_the_imagenet_recipe(tmp_path):
    image = Image.open(_photo(str(tmp_path / "a.png"))).convert("RGB")
    norm = [v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(list(transforms.IMAGENET_STATS[0]), list(transforms.IMAGENET_STATS[1]))]
    old_train = v2.Compose([v2.RandomResizedCrop(24, antialias=True), v2.RandomHorizontalFlip()] + norm)
    old_eval = v2.Compose([v2.Resize(28, antialias=True), v2.CenterCrop(24)] + norm)
    recipe = recipe_of(make_cfg({}))
    for seed in range(5):
        assert torch.equal(_seeded(transforms.folder_transform(True, 24, 28, 3, recipe=recipe), image, seed),
                           _seeded(old_train, image, seed))
    assert torch.equal(transforms.folder_transform(False, 24, 28, 3, recipe=recipe)(image), old_eval(image))


def test_default_fast_decode_draws_the_same_crops_as_before(tmp_path):
    path = _photo(str(tmp_path / "a.png"))
    data = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)
    for seed in range(5):
        torch.manual_seed(seed)
        top, left, h, w = v2.RandomResizedCrop.get_params(data, [0.08, 1.0], [3 / 4, 4 / 3])
        flip = bool(torch.rand(1) < 0.5)
        want = _resized_crop(data, top, left, h, w, 16, flip=flip)
        assert torch.equal(_seeded(cpu.FastTrainDecode(16, "RGB", recipe_of(make_cfg({}))), path, seed), want)


def test_default_mnist5k_keeps_pad_crop_without_flip():
    cfg = make_cfg(MNIST)
    ds = data.build_dataset(cfg, train=True)
    kinds = [type(t) for t in ds.transform.transforms]
    assert v2.RandomCrop in kinds and v2.RandomResizedCrop not in kinds and v2.RandomHorizontalFlip not in kinds
    assert pipeline_name(cfg, "TRAIN") == "memory"
    loader = loading.build_train_loader(cfg, 0, 1, CPU)
    assert (loader.pad, loader.flip) == (2, 0.0)


# ---------------------------------------------------------------------------------------------
# Each key changes the transform as it says
# ---------------------------------------------------------------------------------------------
def test_crop_scale_ratio_and_interpolation_reach_the_pil_transforms(tmp_path):
    image = Image.open(_photo(str(tmp_path / "a.png"))).convert("RGB")
    cfg = make_cfg({"TRAIN.CROP_SCALE": [0.8, 1.0], "TRAIN.CROP_RATIO": [0.9, 1.1],
                    "TRAIN.INTERPOLATION": "bicubic", "TRAIN.FLIP_PROB": 0.0})
    tf = transforms.folder_transform(True, 24, 28, 3, recipe=recipe_of(cfg))
    crop = tf.transforms[0]
    assert (crop.scale, crop.ratio, crop.interpolation) == ((0.8, 1.0), (0.9, 1.1), BICUBIC)
    assert not any(isinstance(t, v2.RandomHorizontalFlip) for t in tf.transforms)  # FLIP_PROB 0: no flip step
    want = v2.RandomResizedCrop(24, scale=(0.8, 1.0), ratio=(0.9, 1.1), interpolation=BICUBIC, antialias=True)
    for seed in range(3):
        assert torch.equal(_seeded(tf, image, seed), _seeded(
            v2.Compose([want, v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True),
                        v2.Normalize(*map(list, transforms.IMAGENET_STATS))]), image, seed))


def test_flip_probability_one_mirrors_every_fast_crop(tmp_path):
    """CROP_SCALE [1, 1] with the image's own aspect ratio makes the crop the whole image, so the
    output is exactly the resized image, mirrored when FLIP_PROB is 1."""
    path = _photo(str(tmp_path / "a.png"), (60, 40))
    data = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)
    keys = {"TRAIN.CROP_SCALE": [1.0, 1.0], "TRAIN.CROP_RATIO": [1.5, 1.5]}
    whole = _resized_crop(data, 0, 0, 40, 60, 16)
    for flip, want in ((1.0, whole.flip(-1)), (0.0, whole)):
        decode = cpu.FastTrainDecode(16, "RGB", recipe_of(make_cfg({**keys, "TRAIN.FLIP_PROB": flip})))
        for seed in range(4):
            assert torch.equal(_seeded(decode, path, seed), want)


def test_interpolation_changes_the_fast_and_pil_eval_resize(tmp_path):
    path = _photo(str(tmp_path / "a.png"), (60, 40))
    data = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)
    outputs = {}
    for name in ("bilinear", "bicubic", "nearest"):
        recipe = recipe_of(make_cfg({"TRAIN.INTERPOLATION": name}))
        out = cpu.FastEvalDecode(20, 16, "RGB", recipe)(open(path, "rb").read())
        mode = v2.InterpolationMode(name)
        want = v2.functional.center_crop(v2.functional.resize(data, 20, interpolation=mode,
                                                              antialias=name != "nearest"), [16, 16])
        assert torch.equal(out, want), name
        assert transforms.folder_transform(False, 16, 20, 3, recipe=recipe).transforms[0].interpolation == mode
        outputs[name] = out
    assert not torch.equal(outputs["bilinear"], outputs["bicubic"])
    assert not torch.equal(outputs["bilinear"], outputs["nearest"])


@pytest.mark.parametrize("decode", ["fast", "pil"])
def test_mean_std_and_crop_pct_reach_the_folder_loaders(tmp_path, decode):
    cfg = _folder_cfg(str(tmp_path / "d"), **{"TRAIN.IMAGE_DECODE": decode, "TRAIN.MEAN": [0.5, 0.4, 0.3],
                                              "TRAIN.STD": [0.2, 0.25, 0.5], "TEST.CROP_PCT": 0.5})
    images, _ = next(iter(loading.build_test_loader(cfg, 0, 1, CPU)))
    want = (torch.tensor([120 / 255] * 3) - torch.tensor([0.5, 0.4, 0.3])) / torch.tensor([0.2, 0.25, 0.5])
    assert images.shape == (2, 3, 8, 8)
    assert torch.allclose(images[0, :, 0, 0], want, atol=1e-5)
    dataset = items.split_dataset(cfg, "TEST", False, batched=decode == "fast")
    resize = dataset.decode.resize_to if decode == "fast" else dataset.transform.transforms[0].size[0]
    assert resize == 16  # floor(TRAIN.IM_SIZE 8 / CROP_PCT 0.5), not TEST.IM_SIZE 10


def test_tensor_source_keys_mean_std_flip_and_crop_scale():
    cfg = make_cfg({**MNIST, "TRAIN.MEAN": [0.5], "TRAIN.STD": [0.25], "TRAIN.FLIP_PROB": 1.0})
    loader = loading.build_val_loader(cfg, 0, 1, CPU)  # memory pipeline, no augmentation
    images, _ = next(iter(loader))
    raw, _ = builtin.load_mnist5k("val", "TEST")
    assert torch.allclose(images[0], (raw[0].float() / 255 - 0.5) / 0.25, atol=1e-5)
    assert loading.build_train_loader(cfg, 0, 1, CPU).flip == 1.0
    digits = raw[:4]
    assert torch.equal(pad_crop_flip(digits, torch.arange(4), 28, 0, 1.0), digits.flip(-1))  # p 1: every one
    assert torch.equal(pad_crop_flip(digits, torch.arange(4), 28, 0, 0.0), digits)
    cropped = make_cfg({**MNIST, "TRAIN.CROP_SCALE": [0.8, 1.0], "TRAIN.INTERPOLATION": "bicubic"})
    assert pipeline_name(cropped, "TRAIN") == "loader"  # the in-memory path only pads and crops
    assert pipeline_name(cropped, "TEST") == "memory"
    tf = data.build_dataset(cropped, train=True).transform
    want = v2.Compose([v2.RandomResizedCrop(28, scale=(0.8, 1.0), interpolation=BICUBIC, antialias=True),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.1307], [0.3081])])
    for seed in range(3):
        assert torch.equal(_seeded(tf, raw[0], seed), _seeded(want, raw[0], seed))


def test_predict_uses_the_eval_recipe(tmp_path):
    root = str(tmp_path / "d")
    cfg = _folder_cfg(root, **{"TRAIN.IMAGE_DECODE": "pil", "TRAIN.MEAN": [0.5, 0.5, 0.5],
                               "TRAIN.STD": [0.1, 0.2, 0.4], "TEST.CROP_PCT": 0.5, "TRAIN.INTERPOLATION": "bicubic"})
    path = _photo(os.path.join(root, "val", "a", "0.png"), (30, 24))
    prepare = _card_transform(cfg)
    evaluated = data.build_dataset(cfg, train=False)
    index = evaluated.files.paths.index(path)
    assert torch.equal(prepare(path), evaluated[index][0])
    plain = _folder_cfg(str(tmp_path / "e"), **{"TRAIN.IMAGE_DECODE": "pil"})
    assert not torch.allclose(_card_transform(plain)(path), prepare(path))


def _card_transform(cfg):
    """path -> input tensor, as predict with --cfg prepares an image (the card described from the config)."""
    tf = inference.card_from_config(cfg).transform()
    return lambda path: tf(Image.open(path))


# ---------------------------------------------------------------------------------------------
# timm's data config for pretrained timm models
# ---------------------------------------------------------------------------------------------
def test_timm_pretrained_model_takes_timm_data_config(caplog):
    arch = "vit_tiny_patch16_224"
    want = timm.data.resolve_model_data_config(timm.create_model(arch, pretrained=False))
    assert want["mean"] != transforms.IMAGENET_STATS[0]  # (0.5, 0.5, 0.5): the test can tell them apart
    cfg = make_cfg({"MODEL.ARCH": arch, "MODEL.PRETRAINED": True})
    recipe = recipe_of(cfg)
    assert recipe.stats == (tuple(want["mean"]), tuple(want["std"]))
    assert (recipe.interpolation, recipe.crop_pct) == (want["interpolation"], want["crop_pct"])
    assert recipe.eval_resize(224, 256) == math.floor(224 / want["crop_pct"])
    with caplog.at_level(logging.INFO, logger="distribuuuu"):
        log_recipe(cfg)
    assert f"from timm's data config of {arch}" in caplog.text
    mine = recipe_of(make_cfg({"MODEL.ARCH": arch, "MODEL.PRETRAINED": True, "TRAIN.INTERPOLATION": "bilinear",
                               "TRAIN.MEAN": [0.1, 0.2, 0.3], "TRAIN.STD": [1, 1, 1]}))
    assert (mine.interpolation, mine.stats, mine.crop_pct) == ("bilinear", ((0.1, 0.2, 0.3), (1, 1, 1)),
                                                               want["crop_pct"])  # set keys win
    assert recipe_of(make_cfg({"MODEL.ARCH": arch})) == Recipe()  # no pretrained weights: the defaults
    assert recipe_of(make_cfg({"MODEL.ARCH": "resnet18", "MODEL.PRETRAINED": True})) == Recipe()  # torchvision


# ---------------------------------------------------------------------------------------------
# Bad values: exit 2, one message
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,value,fragment", [
    ("TRAIN.CROP_SCALE", "[0.9, 0.5]", "TRAIN.CROP_SCALE is [min, max]"),
    ("TRAIN.CROP_SCALE", "[0.0, 1.0]", "0 < min <= max <= 1"),
    ("TRAIN.CROP_SCALE", "[0.5]", "TRAIN.CROP_SCALE"),
    ("TRAIN.CROP_RATIO", "[2.0, 1.0]", "TRAIN.CROP_RATIO is [min, max] aspect ratios"),
    ("TRAIN.FLIP_PROB", "1.5", "TRAIN.FLIP_PROB is a probability in [0, 1]"),
    ("TRAIN.INTERPOLATION", "lanczos", "TRAIN.INTERPOLATION must be one of nearest, bilinear, bicubic"),
    ("TRAIN.MEAN", "[0.5, 0.5]", "TRAIN.MEAN needs one number per channel"),
    ("TEST.CROP_PCT", "1.5", "TEST.CROP_PCT is the center-crop fraction"),
])
def test_bad_recipe_values_exit_2(key, value, fragment):
    proc = check(cli_main("config", "--cfg", TINY, key, value), 2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and fragment in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_mean_without_std_and_zero_std_exit_2():
    proc = check(cli_main("config", "--cfg", TINY, "TRAIN.MEAN", "[0.5, 0.5, 0.5]"), 2)
    assert "TRAIN.MEAN and TRAIN.STD go together" in proc.stderr
    proc = check(cli_main("config", "--cfg", TINY, "TRAIN.MEAN", "[0.5, 0.5, 0.5]", "TRAIN.STD", "[0, 1, 1]"), 2)
    assert "TRAIN.STD values must be positive" in proc.stderr


def test_memory_pipeline_with_crop_scale_is_a_user_error():
    from distribuuuu.errors import UserError

    cfg = make_cfg({**MNIST, "TRAIN.DATA_PIPELINE": "memory", "TRAIN.CROP_SCALE": [0.8, 1.0]})
    with pytest.raises(UserError, match="TRAIN.CROP_SCALE needs TRAIN.DATA_PIPELINE auto or loader"):
        pipeline_name(cfg, "TRAIN")


# ---------------------------------------------------------------------------------------------
# A real run with a non-default recipe
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow  # a real epoch of mnist5k checked for accuracy: 8 s, a sixth of test-fast
def test_mnist5k_training_with_a_digit_recipe(tmp_path):
    out = str(tmp_path / "run")
    proc = check(cli_main("train", "--cfg", TINY, "OUT_DIR", out, "TRAIN.DATASET", "mnist5k", "TEST.DATASET",
                          "mnist5k", "MODEL.NUM_CLASSES", "10", "MODEL.IN_CHANS", "1", "TRAIN.IM_SIZE", "14",
                          "TEST.IM_SIZE", "14", "TRAIN.BATCH_SIZE", "128", "TEST.BATCH_SIZE", "500",
                          "OPTIM.MAX_EPOCH", "1", "TRAIN.PRINT_FREQ", "100", "TRAIN.CROP_SCALE", "[0.8, 1.0]",
                          "TRAIN.FLIP_PROB", "0.0", "TRAIN.INTERPOLATION", "bicubic",
                          "TRAIN.MEAN", "[0.13]", "TRAIN.STD", "[0.31]"))
    log = open(os.path.join(out, "log.txt")).read()
    assert "data recipe: crop scale 0.8-1" in log and "bicubic" in log, log[-2000:]
    rows = read_metrics(out)
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    assert train[-1]["n"] == 4000 // 128 * 128 and val[-1]["n"] == 1000
    assert math.isfinite(train[-1]["loss"]) and val[-1]["top1"] > 10.0, (proc.stdout[-2000:], rows)

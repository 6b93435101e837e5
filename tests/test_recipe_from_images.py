"""The recipe follows the images (distribuuuu/inferred/): a folder's training images decide the model, the
input channels, the image size, the crop scale, the flips and the mean/std that the config leaves unset, each
with a setup line; a fine-tune takes them from its checkpoint's model card; NUM_THREADS from the free cores.
The e2e tests run the installed command from a folder outside the checkout, on scikit-learn's digits."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml
from PIL import Image

from distribuuuu import inferred, weights
from distribuuuu.data import transforms
from distribuuuu.model_card import CARD_KEY, ModelCard
from tests.conftest import ROOT, check, env, make_cfg, read_metrics, write_image_tree

BASELINE = os.path.join(ROOT, "config", "resnet18.yaml")


def decided(cfg) -> dict[str, inferred.Decision]:
    return {d.key: d for d in inferred.decisions(cfg)}


def flat_folder(root, mode: str, size: tuple[int, int], per_class: int = 6, ext: str = "png") -> str:
    """A folder of class folders (no train/ split) of random images."""
    write_image_tree(str(root), "", {"a": per_class, "b": per_class}, mode=mode, size=size, ext=ext)
    return str(root)


def pixel_stats(folder: str) -> tuple[float, float]:
    pixels = np.concatenate([np.asarray(Image.open(os.path.join(d, f)), dtype=np.float64).ravel() / 255
                             for d, _, files in os.walk(folder) for f in files])
    return float(pixels.mean()), float(pixels.std())


def test_small_gray_images_decide_model_channels_size_and_recipe(tmp_path):
    folder = flat_folder(tmp_path / "tiny", "glyph", (8, 8))
    cfg = make_cfg("TRAIN.DATASET", folder, "DEVICE", "cpu")
    assert (cfg.MODEL.ARCH, cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE) == ("resnet_tiny", 1, 32)
    assert (list(cfg.TRAIN.CROP_SCALE), cfg.TRAIN.FLIP_PROB) == ([0.8, 1.0], 0.0)
    mean, std = pixel_stats(folder)  # 12 images: the sample is all of them
    assert cfg.TRAIN.MEAN == [pytest.approx(mean, abs=1e-4)] and cfg.TRAIN.STD == [pytest.approx(std, abs=1e-4)]
    lines = decided(cfg)
    for key in ("MODEL.ARCH", "MODEL.IN_CHANS", "TRAIN.IM_SIZE", "TRAIN.CROP_SCALE", "TRAIN.FLIP_PROB",
                "TRAIN.MEAN/STD"):
        assert key in lines and "source's" not in lines[key].line(), key
    assert "median shorter side 8 px, raised to 32" in lines["TRAIN.IM_SIZE"].line()
    assert "12 of 12 sampled are gray" in lines["MODEL.IN_CHANS"].line()
    assert "glyphs" in lines["TRAIN.FLIP_PROB"].line()
    assert transforms.recipe_of(cfg).describe().startswith("crop scale 0.8-1, ratio 0.75-1.33, flip 0, bilinear")


def test_textures_and_small_photos_are_mirrored_and_glyphs_are_not(tmp_path):
    """FLIP_PROB follows what the images are, not their size: gray noise (a texture) and small RGB
    photos are mirrored, two-toned glyphs are not."""
    for mode, flip in (("L", 0.5), ("RGB", 0.5), ("glyph", 0.0)):
        cfg = make_cfg("TRAIN.DATASET", flat_folder(tmp_path / mode, mode, (24, 24)), "DEVICE", "cpu")
        line = decided(cfg)["TRAIN.FLIP_PROB"].line()
        assert cfg.TRAIN.FLIP_PROB == flip and ("glyphs" in line) == (flip == 0.0), (mode, line)


def test_photos_train_at_the_model_default_size_with_imagenet_recipe(tmp_path):
    folder = flat_folder(tmp_path / "photos", "RGB", (500, 375), per_class=3, ext="jpg")
    cfg = make_cfg("TRAIN.DATASET", folder, "DEVICE", "cpu")
    assert (cfg.MODEL.ARCH, cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE) == ("resnet18", 3, 224)
    assert (list(cfg.TRAIN.CROP_SCALE), cfg.TRAIN.FLIP_PROB) == ([0.08, 1.0], 0.5)
    assert (tuple(cfg.TRAIN.MEAN), tuple(cfg.TRAIN.STD)) == transforms.IMAGENET_STATS
    assert "lowered to resnet18's default size" in decided(cfg)["TRAIN.IM_SIZE"].line()


def test_a_baseline_config_on_photos_trains_as_before(tmp_path):
    """The Distribuuuu baseline configs set ARCH and IM_SIZE: on RGB photos the rest is the ImageNet recipe
    that an unset recipe meant before (recipe_of of the unset keys)."""
    folder = flat_folder(tmp_path / "photos", "RGB", (300, 260), per_class=2, ext="jpg")
    cfg = make_cfg("TRAIN.DATASET", folder, "TEST.DATASET", "", base=BASELINE)
    before = transforms.Recipe()
    now = transforms.recipe_of(cfg)
    assert (cfg.MODEL.ARCH, cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE) == ("resnet18", 3, 224)
    assert (now.folder_scale(), now.flip_prob(True)) == (before.folder_scale(), before.flip_prob(True))
    assert transforms.image_stats(cfg) == transforms.IMAGENET_STATS


def test_set_keys_win_and_other_data_keeps_the_fallback_defaults(tmp_path):
    folder = flat_folder(tmp_path / "tiny", "L", (8, 8))
    cfg = make_cfg("TRAIN.DATASET", folder, "DEVICE", "cpu", "MODEL.ARCH", "resnet18", "MODEL.IN_CHANS", 3,
                   "TRAIN.IM_SIZE", 16, "TRAIN.FLIP_PROB", 0.5, "TRAIN.MEAN", "[0.5, 0.5, 0.5]",
                   "TRAIN.STD", "[0.2, 0.2, 0.2]", "TRAIN.CROP_SCALE", "[0.5, 1.0]")
    assert (cfg.MODEL.ARCH, cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE, cfg.TRAIN.FLIP_PROB) == ("resnet18", 3, 16, 0.5)
    assert not {"MODEL.ARCH", "MODEL.IN_CHANS", "TRAIN.IM_SIZE", "TRAIN.MEAN/STD"} & set(decided(cfg))
    synthetic = make_cfg("TRAIN.DATASET", "synthetic")
    assert (synthetic.MODEL.ARCH, synthetic.MODEL.IN_CHANS, synthetic.TRAIN.IM_SIZE) == ("resnet18", 3, 224)
    assert (list(synthetic.TRAIN.CROP_SCALE), synthetic.TRAIN.FLIP_PROB, list(synthetic.TRAIN.MEAN)) == ([], -1, [])


def test_a_fine_tune_takes_model_and_recipe_from_the_checkpoint_card(tmp_path):
    card = ModelCard(arch="resnet_tiny", library="tiny", model_name="resnet_tiny", small_stem=False, num_classes=10,
                     in_chans=1, classes=[str(i) for i in range(10)], image_size=36, resize=36, mean=[0.1307],
                     std=[0.3081], config="TRAIN:\n  CROP_SCALE: []\n  FLIP_PROB: -1.0\n")
    ckpt = str(tmp_path / "best.pth")
    weights.save_checkpoint({CARD_KEY: card.to_dict()}, ckpt)
    folder = flat_folder(tmp_path / "faces", "glyph", (25, 25))
    cfg = make_cfg("TRAIN.DATASET", folder, "MODEL.WEIGHTS", ckpt, "DEVICE", "cpu")
    assert (cfg.MODEL.ARCH, cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE) == ("resnet_tiny", 1, 36)
    assert (cfg.TRAIN.MEAN, cfg.TRAIN.STD) == ([0.1307], [0.3081])
    assert decided(cfg)["MODEL.ARCH"].line() == f"MODEL.ARCH resnet_tiny (the model card of {ckpt})"
    assert (list(cfg.TRAIN.CROP_SCALE), cfg.TRAIN.FLIP_PROB) == ([0.8, 1.0], 0.0)  # the card's run left them unset
    own = make_cfg("TRAIN.DATASET", folder, "MODEL.WEIGHTS", ckpt, "TRAIN.IM_SIZE", 28, "DEVICE", "cpu")
    assert own.TRAIN.IM_SIZE == 28  # the config says otherwise


def test_a_resumed_run_keeps_the_recipe_it_started_with_though_the_folder_changed(tmp_path):
    """The keys decided from the images come from the run's checkpoint on resume: images added since
    would move the mean/std (a recipe change mid-run); the resume's data check names the change instead."""
    folder = flat_folder(tmp_path / "faces", "L", (25, 25))
    out = tmp_path / "run"
    first = make_cfg("TRAIN.DATASET", folder, "OUT_DIR", out, "DEVICE", "cpu")
    (out / "checkpoints").mkdir(parents=True)
    weights.save_checkpoint({"cfg": first.dump()}, str(out / "checkpoints" / "last.pth"))
    flat_folder(tmp_path / "faces", "RGB", (60, 60), per_class=12, ext="jpg")  # more, larger, coloured images
    again = make_cfg("TRAIN.DATASET", folder, "OUT_DIR", out, "DEVICE", "cpu")
    for key in ("MODEL.ARCH", "MODEL.IN_CHANS", "TRAIN.IM_SIZE", "TRAIN.MEAN", "TRAIN.STD"):
        section, name = key.split(".")
        assert again[section][name] == first[section][name], key
    assert decided(again)["TRAIN.MEAN"].line().endswith(f"(as the run started: {out}/checkpoints/last.pth)")
    fresh = make_cfg("TRAIN.DATASET", folder, "OUT_DIR", tmp_path / "other", "DEVICE", "cpu")
    assert fresh.TRAIN.MEAN != first.TRAIN.MEAN  # the folder did change what a new run decides


def test_num_threads_from_omp_or_the_free_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert decided(make_cfg("DEVICE", "cpu"))["NUM_THREADS"].line() == (
        "NUM_THREADS 1 (OMP_NUM_THREADS (torchrun sets 1 for several processes))")
    monkeypatch.delenv("OMP_NUM_THREADS")
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "getloadavg", lambda: (float(os.cpu_count()), 0.0, 0.0))
    alone = make_cfg("DEVICE", "cpu")  # one process: its cores, as torch's default, busy or not
    assert alone.NUM_THREADS == cores and "alone here" in decided(alone)["NUM_THREADS"].line()
    from distribuuuu.inferred import machine

    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    idle = machine.free_threads(2 * cores, 2)  # two processes on twice these cores, idle: a share each
    assert idle[0] == cores and "0.0 busy by the load average" in idle[1]
    monkeypatch.setattr(os, "getloadavg", lambda: (float(os.cpu_count()), 0.0, 0.0))
    assert machine.free_threads(2 * cores, 2)[0] == 1  # every core busy: one thread each, not threads that wait


@pytest.mark.e2e
def test_digits_folder_trains_by_default_from_outside_the_checkout(tmp_path):
    """`data export digits`, then a default 2-process run with TRAIN.TARGET_TOP1 95: it stops there."""
    pytest.importorskip("sklearn")
    exe = shutil.which("distribuuuu", path=os.path.dirname(sys.executable)) or "distribuuuu"
    e = {k: v for k, v in env().items() if k != "PYTHONPATH"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([exe, *args], cwd=tmp_path, env=e, capture_output=True, text=True, timeout=240)

    exported = check(run("data", "export", "digits", "digits_folder")).stdout
    assert "wrote digits to digits_folder: images 1797" in exported
    assert len(os.listdir(tmp_path / "digits_folder" / "7")) == 179
    proc = check(run("train", "TRAIN.DATASET", "digits_folder", "--nproc-per-node", "2", "TRAIN.TARGET_TOP1", "95",
                     "RNG_SEED", "0", "OUT_DIR", "run"))
    out = proc.stdout + proc.stderr
    assert "setup: MODEL.IN_CHANS 1 (from the images: 256 of 256 sampled are gray)" in out
    assert "source's" not in out
    cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert (cfg["MODEL"]["ARCH"], cfg["MODEL"]["IN_CHANS"], cfg["TRAIN"]["IM_SIZE"]) == ("resnet_tiny", 1, 32)
    assert cfg["TRAIN"]["MEAN"][0] == pytest.approx(0.306, abs=0.02) and cfg["TRAIN"]["FLIP_PROB"] == 0.0
    best = max(r["top1"] for r in read_metrics(str(tmp_path / "run")) if r.get("split") == "val")
    assert best >= 95.0


@pytest.mark.e2e
def test_faces_folder_trains_by_default_from_outside_the_checkout(tmp_path):
    """`data export faces` (scikit-image's 200 25x25 gray LFW crops, face / background), then the default
    2-process run as docs/recipes.md shows it, stopped at TRAIN.TARGET_TOP1 90 to keep the test short."""
    pytest.importorskip("skimage")
    exe = shutil.which("distribuuuu", path=os.path.dirname(sys.executable)) or "distribuuuu"
    e = {k: v for k, v in env().items() if k != "PYTHONPATH"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([exe, *args], cwd=tmp_path, env=e, capture_output=True, text=True, timeout=240)

    assert "wrote faces to faces: images 200" in check(run("data", "export", "faces", "faces")).stdout
    assert sorted(os.listdir(tmp_path / "faces")) == ["background", "face"]
    with Image.open(tmp_path / "faces" / "face" / "0000.png") as im:
        assert (im.mode, im.size) == ("L", (25, 25))
    proc = check(run("train", "TRAIN.DATASET", "faces", "--nproc-per-node", "2", "TRAIN.TARGET_TOP1", "90",
                     "RNG_SEED", "0", "OUT_DIR", "run"))
    out = proc.stdout + proc.stderr
    assert "setup: TRAIN.IM_SIZE 32 (from the images: 200 sampled, median shorter side 25 px" in out
    assert "acc@1" in out and "acc@2" not in out and "top-2" not in out  # TRAIN.TOPK clamped to 1
    cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert (cfg["MODEL"]["ARCH"], cfg["MODEL"]["IN_CHANS"], cfg["MODEL"]["NUM_CLASSES"]) == ("resnet_tiny", 1, 2)
    assert max(r["top1"] for r in read_metrics(str(tmp_path / "run")) if r.get("split") == "val") >= 90.0
    assert (tmp_path / "run" / "confusion.csv").read_text().splitlines()[0] == "true \\ predicted,background,face"


@pytest.mark.e2e
def test_fine_tune_from_the_demo_checkpoint_with_only_weights_and_a_folder(tmp_path):
    """The demo's config (mnist5k_fast: resnet_tiny, 1 channel, 36 px), one epoch; then a new folder of
    25x25 gray images and MODEL.WEIGHTS alone: the card supplies the architecture, channels and size."""
    check(subprocess.run([sys.executable, "-m", "distribuuuu", "train", "--cfg", "mnist5k_fast", "OPTIM.MAX_EPOCH",
                          "1", "OUT_DIR", str(tmp_path / "demo")], cwd=ROOT, env=env(), capture_output=True,
                         text=True, timeout=240))
    folder = flat_folder(tmp_path / "faces", "L", (25, 25), per_class=20)  # 36 training images: one batch
    proc = check(subprocess.run([sys.executable, "-m", "distribuuuu", "train", "TRAIN.DATASET", folder,
                                 "MODEL.WEIGHTS", str(tmp_path / "demo" / "checkpoints" / "best.pth"),
                                 "OPTIM.MAX_EPOCH", "1", "OUT_DIR", str(tmp_path / "tuned")],
                                cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=240))
    assert "setup: MODEL.ARCH resnet_tiny (the model card of" in proc.stdout + proc.stderr
    cfg = yaml.safe_load((tmp_path / "tuned" / "config.yaml").read_text())
    assert (cfg["MODEL"]["IN_CHANS"], cfg["TRAIN"]["IM_SIZE"], cfg["MODEL"]["NUM_CLASSES"]) == (1, 36, 2)

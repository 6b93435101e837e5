"""Your own images, first try right (README's "Train on your own images"). The keys left unset follow the data
(distribuuuu/inferred/), each decided value logged with its origin; a folder of class folders trains
as is, with a held-out val part. The e2e tests run the installed command from a folder outside the
checkout, as a user does, on real digits (mnist5k)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from distribuuuu import data, inferred, models, optim
from distribuuuu.errors import UserError
from distribuuuu.inferred import machine
from tests.conftest import (
    ROOT,
    check,
    cli_main,
    env,
    make_cfg,
    write_fake_cifar10,
    write_image_tree,
)

CPU = torch.device("cpu")
BASELINES = ["resnet18", "resnet50", "botnet50", "efficientnet_b0", "regnetx_160", "regnety_160", "regnety_320"]


def decisions(cfg) -> dict[str, inferred.Decision]:
    return {d.key: d for d in inferred.decisions(cfg)}


def three_classes(root, ext: str = "png", size=(12, 10)) -> str:
    write_image_tree(str(root), "train", {"ant": 4, "bee": 4, "cat": 4}, ext=ext, size=size)
    write_image_tree(str(root), "val", {"ant": 1, "bee": 1, "cat": 1}, ext=ext, size=size)
    return str(root)


# ---------------------------------------------------------------------------------------------
# MODEL.NUM_CLASSES, TEST.DATASET, TRAIN.TOPK
# ---------------------------------------------------------------------------------------------
def test_unset_keys_follow_a_folder_of_train_and_val(tmp_path):
    root = three_classes(tmp_path)
    cfg = make_cfg("TRAIN.DATASET", root, "TRAIN.BATCH_SIZE", "4")
    assert (cfg.MODEL.NUM_CLASSES, cfg.TEST.DATASET, cfg.TEST.SPLIT, cfg.TRAIN.TOPK) == (3, root, "val", 2)
    f = decisions(cfg)
    assert f["MODEL.NUM_CLASSES"].line() == "MODEL.NUM_CLASSES 3 (from the folder)"
    assert f["TEST.DATASET"].line() == f"TEST.DATASET {root} (TRAIN.DATASET, split 'val')"
    assert f["TRAIN.TOPK"].line() == "TRAIN.TOPK 2 (clamped from 5: top-5 of 3 classes would always be 100%, saying nothing)"
    data.check_datasets(cfg, 1)  # the data agrees
    assert models.build_model(cfg).fc.out_features == 3


def test_values_given_are_kept_and_said_to_come_from_the_config(tmp_path):
    root = three_classes(tmp_path)
    cfg = make_cfg("TRAIN.DATASET", root, "MODEL.NUM_CLASSES", "3", "TRAIN.TOPK", "2", "TEST.DATASET", root,
                   "TRAIN.WORKERS", "0")
    f = decisions(cfg)
    assert [f[k].line() for k in ("MODEL.NUM_CLASSES", "TRAIN.TOPK", "TRAIN.WORKERS")] == [
        "MODEL.NUM_CLASSES 3 (config)", "TRAIN.TOPK 2 (config)", "TRAIN.WORKERS 0 (config)"]
    assert "TEST.DATASET" not in f


def test_a_num_classes_that_differs_from_the_folder_exits_2_naming_both(tmp_path):
    root = three_classes(tmp_path)
    proc = cli_main("train", "TRAIN.DATASET", root, "MODEL.NUM_CLASSES", "4", "OUT_DIR", str(tmp_path / "run"))
    check(proc, 2)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(r"TRAIN\.DATASET .* has 3 classes but MODEL\.NUM_CLASSES is 4", lines[0]), lines[0]
    assert "leave MODEL.NUM_CLASSES unset (0)" in lines[0] and "set MODEL.NUM_CLASSES 3" in lines[0]
    assert not os.path.exists(tmp_path / "run")  # refused before anything was written


def test_num_classes_of_cifar_mnist5k_and_the_fallback(tmp_path):
    write_fake_cifar10(str(tmp_path))
    cfg = make_cfg("TRAIN.DATASET", str(tmp_path))
    assert cfg.MODEL.NUM_CLASSES == 10 and decisions(cfg)["MODEL.NUM_CLASSES"].origin == "from the CIFAR folder"
    cfg = make_cfg("TRAIN.DATASET", "mnist5k")
    assert (cfg.MODEL.NUM_CLASSES, cfg.TEST.DATASET) == (10, "mnist5k")
    cfg = make_cfg("TRAIN.DATASET", "synthetic")  # makes MODEL.NUM_CLASSES classes
    assert cfg.MODEL.NUM_CLASSES == 1000 and "the fallback" in decisions(cfg)["MODEL.NUM_CLASSES"].origin
    cfg = make_cfg("TRAIN.DATASET", str(tmp_path / "not_here"))  # preflight names it
    assert cfg.MODEL.NUM_CLASSES == 1000
    with pytest.raises(UserError, match="TRAIN.DATASET"):
        data.check_datasets(cfg, 1)


# ---------------------------------------------------------------------------------------------
# The eval size
# ---------------------------------------------------------------------------------------------
def test_eval_size_follows_train_im_size_and_an_explicit_one_wins(tmp_path):
    root = three_classes(tmp_path, size=(64, 48))
    cfg = make_cfg("TRAIN.DATASET", root, "TRAIN.IM_SIZE", "32", "TRAIN.WORKERS", "0")
    assert cfg.TEST.IM_SIZE == 36  # floor(32 / 0.875)
    assert decisions(cfg)["eval size"].line() == ("eval size resize to 36, center crop 32 px "
                                              "(TEST.IM_SIZE 36, follows TRAIN.IM_SIZE: 32 / 0.875)")
    x, _ = data.build_dataset(cfg, train=False)[0]
    assert tuple(x.shape[-2:]) == (32, 32)  # the whole digit at 32 px, not a 32 px crop of a 256 px resize
    assert make_cfg("TRAIN.IM_SIZE", "224").TEST.IM_SIZE == 256  # Distribuuuu's 256 for 224
    cfg = make_cfg("TRAIN.DATASET", root, "TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "40")
    assert cfg.TEST.IM_SIZE == 40 and decisions(cfg)["eval size"].origin == "TEST.IM_SIZE 40, config"
    cfg = make_cfg("TRAIN.DATASET", root, "TRAIN.IM_SIZE", "32", "TEST.CROP_PCT", "0.8")
    assert decisions(cfg)["eval size"].line() == "eval size resize to 40, center crop 32 px (TEST.CROP_PCT 0.8)"


# ---------------------------------------------------------------------------------------------
# Warmup, workers
# ---------------------------------------------------------------------------------------------
def test_a_warmup_longer_than_half_the_run_is_shortened_and_reaches_the_peak():
    cfg = make_cfg("OPTIM.MAX_EPOCH", "3")  # the default 5 warmup epochs
    assert cfg.OPTIM.WARMUP_EPOCHS == 5.0  # the key keeps its value: a resume with more epochs compares equal
    assert optim.warmup_epochs(cfg) == pytest.approx(0.6)
    fact = decisions(cfg)["OPTIM.WARMUP_EPOCHS"]
    assert fact.warn and fact.line().startswith("OPTIM.WARMUP_EPOCHS 0.6 in the schedule (shortened from 5")
    factors = [optim.Schedule(cfg, 1.0)(e / 100) for e in range(300)]
    assert max(factors) == pytest.approx(1.0) and factors[60] == pytest.approx(1.0)  # the peak, at 0.6
    assert factors[0] == pytest.approx(0.1) and factors[30] == pytest.approx(0.55)
    cfg = make_cfg("OPTIM.MAX_EPOCH", "10")  # 5 of 10 fits: as given
    assert optim.warmup_epochs(cfg) == 5.0 and "OPTIM.WARMUP_EPOCHS" not in decisions(cfg)
    assert optim.Schedule(cfg, 1.0)(5.0) == pytest.approx(1.0)


def test_warmup_epochs_is_a_float_and_an_int_in_yaml_still_loads(tmp_path):
    assert make_cfg("OPTIM.WARMUP_EPOCHS", "0.5").OPTIM.WARMUP_EPOCHS == 0.5
    path = tmp_path / "c.yaml"
    path.write_text("OPTIM:\n  WARMUP_EPOCHS: 2\n")
    value = make_cfg(base=str(path)).OPTIM.WARMUP_EPOCHS
    assert value == 2.0 and isinstance(value, float)


def test_workers_follow_the_cores_of_each_process(monkeypatch):
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    for procs, want in ((1, 7), (2, 3), (4, 1), (8, 0), (16, 0)):
        cfg = inferred.resolve(make_cfg(resolve=False), local_world_size=procs)
        assert cfg.TRAIN.WORKERS == want, procs
        assert decisions(cfg)["TRAIN.WORKERS"].origin.startswith(f"from the cores: {max(1, 8 // procs)} per process")
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert inferred.resolve(make_cfg(resolve=False), local_world_size=1).TRAIN.WORKERS == machine.MAX_AUTO_WORKERS
    assert inferred.resolve(make_cfg("TRAIN.WORKERS", "2", resolve=False), local_world_size=1).TRAIN.WORKERS == 2


def test_resolve_is_done_once():
    cfg = make_cfg()
    assert inferred.resolve(cfg) is cfg and cfg.is_frozen()
    assert cfg.MODEL.NUM_CLASSES and cfg.TEST.IM_SIZE and cfg.TEST.DATASET and cfg.TRAIN.WORKERS >= 0


# ---------------------------------------------------------------------------------------------
# A folder of class folders
# ---------------------------------------------------------------------------------------------
def test_a_folder_of_class_folders_holds_out_a_stratified_seeded_tenth(tmp_path):
    write_image_tree(str(tmp_path), "", {"ant": 20, "bee": 10, "cat": 30})
    opts = ["TRAIN.DATASET", str(tmp_path), "TRAIN.IM_SIZE", "8", "TRAIN.WORKERS", "0", "TEST.BATCH_SIZE", "64"]
    cfg = make_cfg(*opts)
    assert (cfg.TRAIN.SPLIT, cfg.TEST.DATASET, cfg.TEST.SPLIT, cfg.TRAIN.VAL_SPLIT) == ("", str(tmp_path), "", 0.1)
    assert cfg.MODEL.NUM_CLASSES == 3
    f = decisions(cfg)
    assert "holds 3 class folders and no train/" in f["TRAIN.SPLIT"].origin
    # A tenth, at least 5 of a class of 25 or more and a fifth of a smaller one: 20 -> 4, 10 -> 2, 30 -> 5
    held = f["TRAIN.VAL_SPLIT"]
    assert "11 of its 60 images are held out as the val set, chosen by a fixed seed" in held.origin
    assert held.origin.endswith("(a fifth of a smaller one); per class ant 4, bee 2, cat 5")
    data.check_datasets(cfg, 1)
    val = data.build_val_loader(cfg, 0, 1, CPU)
    train = data.build_train_loader(cfg, 0, 1, CPU)
    labels = sorted(int(y) for _, ys in val for y in ys)
    assert labels == [0] * 4 + [1] * 2 + [2] * 5
    assert len(train.dataset) == 49
    again = [int(y) for _, ys in data.build_val_loader(make_cfg(*opts), 0, 1, CPU) for y in ys]
    assert sorted(again) == labels
    # A TEST.DATASET given: the folder is the training split, nothing is held out unasked.
    other = three_classes(tmp_path / "other")
    cfg = make_cfg(*opts, "TEST.DATASET", other)
    assert (cfg.TRAIN.SPLIT, cfg.TRAIN.VAL_SPLIT, cfg.TEST.SPLIT) == ("", 0.0, "val")


def test_the_run_length_follows_the_training_set_and_a_given_length_is_kept(tmp_path):
    """OPTIM.MAX_EPOCH 0: about 20,000 training images seen, 10 to 100 epochs, and then TRAIN.PATIENCE -1 is
    5; a given OPTIM.MAX_EPOCH is kept, and TRAIN.PATIENCE -1 is 0 (no line: nothing was decided)."""
    write_image_tree(str(tmp_path), "", {"ant": 30, "bee": 30})  # 5 of each held out: 50 train
    cfg = make_cfg("TRAIN.DATASET", tmp_path)
    length = decisions(cfg)["OPTIM.MAX_EPOCH"]
    assert (cfg.OPTIM.MAX_EPOCH, cfg.TRAIN.PATIENCE) == (100, 5)  # 20,000 / 50 = 400: at most 100
    assert "about 20,000 of its 50 training images seen" in length.origin
    assert "second half of the run" in decisions(cfg)["TRAIN.PATIENCE"].origin
    for samples, epochs in ((1000, 20), (1500, 14), (5000, 10)):  # ceil(20,000 / n), at least 10
        cfg = make_cfg("TRAIN.DATASET", "synthetic", "TRAIN.SYNTHETIC_SAMPLES", samples)
        assert (cfg.OPTIM.MAX_EPOCH, cfg.TRAIN.PATIENCE) == (epochs, 5), samples
    cfg = make_cfg("TRAIN.DATASET", "synthetic", "TRAIN.SYNTHETIC_SAMPLES", 1000, "TRAIN.PATIENCE", 2)
    assert (cfg.OPTIM.MAX_EPOCH, cfg.TRAIN.PATIENCE) == (20, 2)  # the user's patience stays
    cfg = make_cfg("TRAIN.DATASET", tmp_path, "OPTIM.MAX_EPOCH", 7)
    assert (cfg.OPTIM.MAX_EPOCH, cfg.TRAIN.PATIENCE) == (7, 0)
    assert not {"OPTIM.MAX_EPOCH", "TRAIN.PATIENCE"} & set(decisions(cfg))
    cfg = make_cfg("TRAIN.DATASET", tmp_path / "missing")  # the preflight will say why
    assert cfg.OPTIM.MAX_EPOCH == 100 and "not readable" in decisions(cfg)["OPTIM.MAX_EPOCH"].origin


def test_a_split_layout_is_not_taken_for_a_folder_of_class_folders(tmp_path):
    write_image_tree(str(tmp_path), "training", {"a": 2})  # another split name: not class folders
    write_image_tree(str(tmp_path), "val", {"a": 1})
    cfg = make_cfg("TRAIN.DATASET", str(tmp_path))
    assert cfg.TRAIN.SPLIT == "train" and "TRAIN.SPLIT" not in decisions(cfg)
    with pytest.raises(UserError, match="TRAIN.DATASET"):
        data.check_datasets(cfg, 1)


# ---------------------------------------------------------------------------------------------
# MODEL.ZERO_INIT_RESIDUAL
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch, last", [("resnet18", "bn2"), ("resnet50", "bn3"), ("resnet_tiny", "bn2"),
                                        ("resnet18.a1_in1k", "bn2")])
def test_zero_init_residual_sets_the_last_batchnorm_of_each_block(arch, last):
    def last_bns(zero: bool) -> list[torch.Tensor]:
        cfg = make_cfg("MODEL.ARCH", arch, "MODEL.NUM_CLASSES", "10", "MODEL.ZERO_INIT_RESIDUAL", str(zero))
        model = models.build_model(cfg)
        return [getattr(m, last).weight for m in model.modules() if hasattr(m, last) and hasattr(m, "conv1")]

    on, off = last_bns(True), last_bns(False)
    assert on and len(on) == len(off)
    assert all(not w.any() for w in on)  # each block starts as the identity
    assert all(bool((w == 1).all()) for w in off)  # timm's own zeros undone too


# ---------------------------------------------------------------------------------------------
# The original Distribuuuu YAMLs state every key but the channels (3 for ImageNet, as before) and the threads
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", BASELINES)
def test_the_original_yamls_decide_nothing(arch):
    path = os.path.join(ROOT, "config", f"{arch}.yaml")
    cfg = make_cfg(base=path)
    stated = yaml.safe_load(open(path))
    assert cfg.MODEL.NUM_CLASSES == stated["MODEL"]["NUM_CLASSES"] == 1000
    assert (cfg.TEST.DATASET, cfg.TEST.IM_SIZE, cfg.TRAIN.WORKERS) == ("./data/ILSVRC/", 256, 4)
    assert optim.warmup_epochs(cfg) == stated["OPTIM"]["WARMUP_EPOCHS"] == 5
    lines = [f.line() for f in inferred.decisions(cfg) if f.key != "NUM_THREADS"]  # threads: the free cores
    assert lines == ["MODEL.NUM_CLASSES 1000 (config)", "TRAIN.TOPK 5 (config)",
                     "MODEL.IN_CHANS 3 (the fallback: no folder of images read here (./data/ILSVRC/))",
                     "eval size resize to 256, center crop 224 px (TEST.IM_SIZE 256, config)",
                     "TRAIN.WORKERS 4 (config)"], lines


# ---------------------------------------------------------------------------------------------
# e2e: the installed command, from a folder outside the checkout, on real digits
# ---------------------------------------------------------------------------------------------
PER_CLASS = {"train": 16, "val": 4}  # of mnist5k's 400 / 100 per digit: a small export, seconds to train


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> str:
    """`distribuuuu data export mnist5k`'s layout and files, the first PER_CLASS images of each digit
    (the export of all 5,000 takes half a minute on a loaded 2-core machine: made once, then cut)."""
    full = tmp_path_factory.mktemp("mnist5k_export")
    from distribuuuu.data.sources.export import mnist5k as export_mnist5k

    export_mnist5k(str(full))
    small = tmp_path_factory.mktemp("digits")
    for split, n in PER_CLASS.items():
        for digit in sorted(os.listdir(full / split)):
            os.makedirs(small / split / digit)
            for name in sorted(os.listdir(full / split / digit))[:n]:
                shutil.copy(full / split / digit / name, small / split / digit / name)
    shutil.rmtree(full)
    return str(small)


def user_command(*args: str, cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    """The installed console script (as `pip install` puts it on PATH), run from cwd."""
    exe = os.path.join(os.path.dirname(sys.executable), "distribuuuu")
    return subprocess.run([exe, *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.e2e
def test_the_first_run_on_a_folder_of_digits_follows_the_data(digits, tmp_path):
    proc = check(user_command("train", "TRAIN.DATASET", digits, "TRAIN.IM_SIZE", "32", "OPTIM.MAX_EPOCH", "2",
                              "TRAIN.WORKERS", "1", "TRAIN.PRINT_FREQ", "1", "NUM_THREADS", "1", "OUT_DIR", "run",
                              cwd=tmp_path))
    out, log = tmp_path / "run", proc.stdout + proc.stderr
    assert "setup: MODEL.NUM_CLASSES 10 (from the folder)" in log
    assert f"setup: TEST.DATASET {digits} (TRAIN.DATASET, split 'val')" in log
    assert "setup: eval size resize to 36, center crop 32 px (TEST.IM_SIZE 36, follows TRAIN.IM_SIZE" in log
    assert "setup: OPTIM.WARMUP_EPOCHS 0.4 in the schedule (shortened from 5" in log
    card = torch.load(out / "checkpoints" / "best.pth", map_location="cpu", weights_only=True)["card"]
    assert card["classes"] == [str(d) for d in range(10)] and card["num_classes"] == 10
    assert (card["image_size"], card["resize"]) == (32, 36)
    peak = float(re.search(r"peak LR ([0-9.e-]+)", log).group(1))
    step_lrs = [float(v) for v in re.findall(r"\[train\] epoch \d+/\d+ iter \d+/\d+ .*\| lr ([0-9.]+)", log)]
    steps = 10 * PER_CLASS["train"] // 32  # per epoch (the last, partial batch is dropped)
    assert len(step_lrs) == 2 * steps and max(step_lrs) >= 0.95 * peak, (peak, step_lrs)  # one step past its end
    records = [json.loads(ln) for ln in open(out / "metrics.jsonl")]
    assert [r["n"] for r in records if r["split"] == "val"] == [40, 40]  # the val folder, at 32 px
    assert all(r["lr"] <= peak for r in records if r["split"] == "train")


@pytest.mark.e2e
def test_the_same_digits_as_one_folder_of_class_folders_hold_out_a_val_part(digits, tmp_path):
    flat = tmp_path / "flat"
    for split in PER_CLASS:  # train/ and val/ merged: <digit>/<image>, as a user's own photos would be
        for digit in os.listdir(os.path.join(digits, split)):
            os.makedirs(flat / digit, exist_ok=True)
            for name in os.listdir(os.path.join(digits, split, digit)):
                shutil.copy(os.path.join(digits, split, digit, name), flat / digit / f"{split}_{name}")
    proc = check(user_command("train", "TRAIN.DATASET", "flat", "TRAIN.IM_SIZE", "32", "OPTIM.MAX_EPOCH", "1",
                              "TRAIN.WORKERS", "1", "NUM_THREADS", "1", "OUT_DIR", "run", cwd=tmp_path))
    log = proc.stdout + proc.stderr
    n, per_class = 10 * sum(PER_CLASS.values()), sum(PER_CLASS.values())
    held = 10 * max(round(0.1 * per_class), min(5, per_class // 5))  # a tenth, at least min(5, a fifth)
    assert f"setup: TRAIN.VAL_SPLIT 0.1 (from the folder: no val/ folder, so {held} of its {n} images are " \
           "held out as the val set, chosen by a fixed seed" in log, log
    records = [json.loads(ln) for ln in open(tmp_path / "run" / "metrics.jsonl")]
    assert [(r["split"], r["n"]) for r in records] == [("train", (n - held) // 32 * 32), ("val", held)]
    card = torch.load(tmp_path / "run" / "checkpoints" / "best.pth", map_location="cpu", weights_only=True)["card"]
    assert card["classes"] == [str(d) for d in range(10)]

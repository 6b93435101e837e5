"""The model card (distribuuuu/model_card.py): every checkpoint and export says what its model is
(config, class names, preprocessing), so eval, predict, export and load_model need the checkpoint
alone; predict's folders, globs, CSV and JSON; the plain-PyTorch loading code of docs/tour.md, run against a
real checkpoint."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from PIL import Image

from distribuuuu import api, data
from distribuuuu.data import transforms
from distribuuuu.errors import UserError
from distribuuuu.model_card import CARD_KEY, ModelCard
from distribuuuu.weights import INTEGRITY_KEY
from tests.conftest import ROOT, check, cli_main, env, make_cfg, process_state_restored

FAST = ["NUM_THREADS", "1", "DEVICE", "cpu", "TRAIN.PRINT_FREQ", "1000"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """(run folder, cfg, digits folder): one epoch of mnist5k_fast (36 px, resnet_tiny, small stem
    off) in process, and the digits as PNG files."""
    root = tmp_path_factory.mktemp("digits_run")
    cfg = make_cfg("OUT_DIR", root / "run", "OPTIM.MAX_EPOCH", "1", *FAST, base="mnist5k_fast")
    with process_state_restored():  # the run's log handlers must not outlive the fixture
        torch.set_num_threads(1)
        api.train(cfg)
    data.export("mnist5k", str(root / "digits"))
    return root / "run", cfg, root / "digits"


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory, digits_run):
    """A run on an image folder of 3 named classes with a recipe of its own (mean/std, crop_pct, bicubic)."""
    _, _, digits = digits_run
    root = tmp_path_factory.mktemp("folder_run")
    for split, count in (("train", 12), ("val", 4)):
        for label, name in (("1", "one"), ("4", "four"), ("7", "seven")):
            dest = root / "data" / split / name
            dest.mkdir(parents=True)
            for src in sorted((digits / split / label).iterdir())[:count]:
                shutil.copy(src, dest / src.name)
    opts = ["OUT_DIR", str(root / "run"), "MODEL.ARCH", "resnet_tiny", "MODEL.NUM_CLASSES", "3",
            "MODEL.IN_CHANS", "1", "TRAIN.DATASET", str(root / "data"), "TEST.DATASET", str(root / "data"),
            "TRAIN.IM_SIZE", "20", "TEST.IM_SIZE", "24", "TEST.CROP_PCT", "0.8", "TRAIN.INTERPOLATION", "bicubic",
            "TRAIN.MEAN", "[0.2]", "TRAIN.STD", "[0.25]", "TRAIN.BATCH_SIZE", "12", "TEST.BATCH_SIZE", "12",
            "TRAIN.WORKERS", "0", "TRAIN.TOPK", "2", "OPTIM.MAX_EPOCH", "1", "RNG_SEED", "0", *FAST]
    cfg = make_cfg(*opts)
    with process_state_restored():
        api.train(cfg)
    return root / "run", cfg, root / "data"


def _ckpt(run, name="best.pth"):
    return torch.load(run / "checkpoints" / name, map_location="cpu", weights_only=True)


def _val_top1(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r["split"] == "val"][-1]["top1"]


# ---------------------------------------------------------------------------------------------
# The record
# ---------------------------------------------------------------------------------------------
def test_card_round_trips_through_dict_json_and_a_weights_only_load(tmp_path):
    card = ModelCard(arch="resnet18", library="torchvision", model_name="resnet18", small_stem=False,
                     num_classes=2, in_chans=3, classes=["cat", "dog"], image_size=224, resize=256,
                     mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225], interpolation="bicubic",
                     crop_pct=0.875, config="MODEL:\n  ARCH: resnet18\n")
    assert ModelCard.from_dict(card.to_dict()) == card
    assert ModelCard.from_dict(json.loads(card.to_json())) == card
    torch.save({CARD_KEY: card.to_dict()}, tmp_path / "c.pth")
    assert ModelCard.from_dict(torch.load(tmp_path / "c.pth", weights_only=True)[CARD_KEY]) == card
    assert ModelCard.from_dict({**card.to_dict(), "added_later": 1}) == card  # newer fields are ignored
    partial = card.to_dict()
    del partial["classes"], partial["mean"]
    with pytest.raises(UserError, match="lacks classes, mean"):
        ModelCard.from_dict(partial)
    image = Image.new("RGB", (300, 260), (255, 0, 0))
    x = card.transform()(image)
    assert x.shape == (3, 224, 224) and x.dtype == torch.float32
    assert x[0].mean().item() == pytest.approx((1 - 0.485) / 0.229, abs=1e-4)


def test_every_checkpoint_of_a_run_carries_config_classes_and_preprocessing(digits_run):
    run, cfg, _ = digits_run
    names = sorted(os.listdir(run / "checkpoints"))
    assert "best.pth" in names and "last.pth" in names and any(n.startswith("epoch_") for n in names)
    for name in names:
        card = ModelCard.from_dict(_ckpt(run, name)[CARD_KEY])
        assert card.config == (run / "config.yaml").read_text()  # the full config the run was trained with
        assert card.classes == [str(d) for d in range(10)]  # mnist5k's digits
        assert (card.arch, card.library, card.model_name, card.num_classes, card.in_chans) == (
            "resnet_tiny", "tiny", "resnet_tiny", 10, 1)
        assert (card.image_size, card.resize) == (cfg.TRAIN.IM_SIZE, cfg.TRAIN.IM_SIZE)
        assert (card.mean, card.std) == (list(transforms.MNIST_STATS[0]), list(transforms.MNIST_STATS[1]))
        assert card.interpolation == "bilinear" and card.small_stem is bool(cfg.MODEL.SMALL_STEM)


def test_a_folder_run_records_its_class_folders_and_its_recipe(folder_run):
    run, cfg, _ = folder_run
    card = ModelCard.from_dict(_ckpt(run, "last.pth")[CARD_KEY])
    assert card.classes == ["four", "one", "seven"]  # ImageFolder's order: sorted folder names
    assert (card.mean, card.std, card.interpolation) == ([0.2], [0.25], "bicubic")
    assert (card.image_size, card.resize, card.crop_pct) == (20, int(20 / 0.8), 0.8)


# ---------------------------------------------------------------------------------------------
# load_model
# ---------------------------------------------------------------------------------------------
def test_load_model_gives_the_model_and_the_eval_pipelines_preprocessing(digits_run):
    run, cfg, digits = digits_run
    loaded = api.load_model(run / "checkpoints" / "best.pth")
    assert not loaded.model.training and next(loaded.model.parameters()).device.type == "cpu"
    assert loaded.classes == [str(d) for d in range(10)] and loaded.config.MODEL.ARCH == "resnet_tiny"
    dataset = data.build_dataset(cfg, train=False)  # val item i is digits/val/<label>/<i>.png
    for i in (0, 321, 999):
        image, label = dataset[i]
        x = loaded.transform(Image.open(digits / "val" / str(label) / f"{i:04d}.png"))
        assert torch.equal(x, image)  # the same tensor as evaluation's, bit for bit
        with torch.no_grad():
            assert torch.equal(loaded.model(x[None]), loaded.model(image[None]))


def test_load_model_transform_matches_the_fast_folder_pipeline(folder_run):
    run, cfg, folder = folder_run
    loaded = api.load_model(str(run / "checkpoints" / "best.pth"))
    batches = data.build_test_loader(cfg, 0, 1, torch.device("cpu"))  # TRAIN.IMAGE_DECODE fast
    images, _ = next(iter(batches))
    paths = batches.dataset.files.paths[:len(images)]
    mine = torch.stack([loaded.transform(Image.open(p)) for p in paths])
    assert mine.shape == images.shape == (len(paths), 1, 20, 20)
    assert torch.allclose(mine, images, atol=1e-5)  # normalized per batch there: rounding only


def test_load_model_of_an_older_checkpoint_and_of_a_bare_state_dict(digits_run, tmp_path):
    run, _, digits = digits_run
    ckpt = _ckpt(run)
    old = {k: v for k, v in ckpt.items() if k not in (CARD_KEY, INTEGRITY_KEY)}
    torch.save(old, tmp_path / "old.pth")  # as a version before the card wrote it
    loaded = api.load_model(tmp_path / "old.pth")  # the card described from the stored config
    assert loaded.classes == [str(d) for d in range(10)]
    assert loaded.card.mean == list(transforms.MNIST_STATS[0]) and loaded.card.resize == 36
    image = str(digits / "val" / "7" / "0700.png")
    older = check(cli_main("predict", "MODEL.WEIGHTS", str(tmp_path / "old.pth"), image, "--format", "json"))
    newer = check(cli_main("predict", "MODEL.WEIGHTS", str(run / "checkpoints" / "best.pth"), image, "--format", "json"))
    # the same answer, from its stored config (the probabilities differ: the older file has no temperature)
    assert [r["classes"] for r in json.loads(older.stdout)] == [r["classes"] for r in json.loads(newer.stdout)]
    bare_run = tmp_path / "bare"
    (bare_run / "checkpoints").mkdir(parents=True)
    torch.save(ckpt["model"], bare_run / "checkpoints" / "weights.pth")
    with pytest.raises(UserError, match="holds no run config"):
        api.load_model(bare_run / "checkpoints" / "weights.pth")
    shutil.copy(run / "config.yaml", bare_run / "config.yaml")  # the config beside it is used
    bare = api.load_model(bare_run / "checkpoints" / "weights.pth")
    x = bare.transform(Image.open(digits / "val" / "7" / "0700.png"))[None]
    with torch.no_grad():
        assert torch.equal(bare.model(x), loaded.model(x))


def test_load_model_keeps_timms_recipe_of_a_pretrained_timm_model(tmp_path):
    """The run took mean/std, interpolation and crop_pct from timm's data config (MODEL.PRETRAINED);
    load_model builds the model without pretrained weights, and still prepares images that way."""
    import timm

    from distribuuuu import model_card, models

    want = timm.models.get_pretrained_cfg("test_resnet")
    opts = ["MODEL.ARCH", "test_resnet", "MODEL.NUM_CLASSES", "3", "TRAIN.IM_SIZE", "32", "TEST.IM_SIZE", "40",
            "TRAIN.TOPK", "2"]
    trained = make_cfg(*opts, "MODEL.PRETRAINED", "True")
    state = models.build_model(make_cfg(*opts)).state_dict()
    card = model_card.describe(trained, None, ["a", "b", "c"])
    assert (card.mean, card.interpolation, card.crop_pct) == (list(want.mean), want.interpolation, want.crop_pct)
    assert card.resize == int(32 / want.crop_pct) != 40
    torch.save({"model": state, "cfg": trained.dump(), CARD_KEY: card.to_dict()}, tmp_path / "timm.pth")
    torch.save({"model": state, "cfg": trained.dump()}, tmp_path / "older.pth")  # no card: from its config
    for name in ("timm.pth", "older.pth"):
        loaded = api.load_model(tmp_path / name)
        assert not loaded.config.MODEL.PRETRAINED  # no weights looked up: they come from the file
        assert (loaded.card.mean, loaded.card.interpolation, loaded.card.resize) == (
            card.mean, card.interpolation, card.resize)
        assert loaded.transform(Image.new("RGB", (50, 45))).shape == (3, 32, 32)


# ---------------------------------------------------------------------------------------------
# eval, predict, export with only a checkpoint path (from a folder outside the repository)
# ---------------------------------------------------------------------------------------------
def test_eval_predict_and_export_need_only_the_checkpoint(digits_run, tmp_path):
    run, _, digits = digits_run
    best = str(run / "checkpoints" / "best.pth")
    ev = check(cli_main("eval", "MODEL.WEIGHTS", best, "OUT_DIR", str(tmp_path / "ev"), cwd=str(tmp_path)))
    record = json.loads((tmp_path / "ev" / "eval.jsonl").read_text().splitlines()[-1])
    assert record["n"] == 1000 and record["top1"] == pytest.approx(_val_top1(run), abs=1e-6), ev.stderr

    out = tmp_path / "preds.json"
    check(cli_main("predict", "MODEL.WEIGHTS", best, str(digits / "val" / "3"), "--topk", "2",
                   "--output", str(out), cwd=str(tmp_path)))
    rows = json.loads(out.read_text())
    assert [r["path"] for r in rows] == sorted(str(p) for p in (digits / "val" / "3").iterdir())
    assert all(len(r["classes"]) == 2 and r["probs"][0] >= r["probs"][1] for r in rows)
    assert sum(r["classes"][0] == "3" for r in rows) / len(rows) > 0.8  # the trained model's answers

    check(cli_main("export", "MODEL.WEIGHTS", best, "--out", str(tmp_path / "ex"), cwd=str(tmp_path)))
    card = _ckpt(run)[CARD_KEY]
    assert json.loads((tmp_path / "ex" / "export.json").read_text())["card"] == card
    extra = {"model_card.json": ""}
    torch.export.load(str(tmp_path / "ex" / "model.pt2"), extra_files=extra)
    assert json.loads(extra["model_card.json"]) == card
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ex" / "model.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["model_card"]) == card
    # The exported weights describe themselves too: predict needs nothing else
    again = check(cli_main("predict", "MODEL.WEIGHTS", str(tmp_path / "ex" / "model.safetensors"),
                           str(digits / "val" / "3"), "--topk", "2", "--format", "json", cwd=str(tmp_path)))
    assert json.loads(again.stdout) == rows


def test_export_without_out_writes_into_the_checkpoints_run_folder(digits_run, tmp_path):
    run, _, _ = digits_run
    copy = tmp_path / "elsewhere" / "checkpoints"
    copy.mkdir(parents=True)
    shutil.copy(run / "checkpoints" / "best.pth", copy / "best.pth")
    check(cli_main("export", "MODEL.WEIGHTS", "elsewhere/checkpoints/best.pth", cwd=str(tmp_path)))
    assert (tmp_path / "elsewhere" / "export" / "export.json").is_file()


def test_checkpoint_only_commands_refuse_what_is_not_a_checkpoint(digits_run, tmp_path):
    run, _, digits = digits_run
    png = str(digits / "val" / "7" / "0700.png")
    for command in ("eval", "export"):
        bad = check(cli_main(command, "MODEL.WEIGHTS", png, cwd=str(tmp_path)), 2)
        assert png in bad.stderr and "expected a checkpoint written by `distribuuuu train`" in bad.stderr
        assert "Traceback" not in bad.stderr
    torch.save(_ckpt(run)["model"], tmp_path / "bare.pth")
    bare = check(cli_main("predict", "MODEL.WEIGHTS", str(tmp_path / "bare.pth"), png, cwd=str(tmp_path)), 2)
    assert "holds no config" in bare.stderr and "--cfg FILE" in bare.stderr
    hint = check(cli_main("predict", str(run / "checkpoints" / "best.pth"), cwd=str(tmp_path)), 2)
    assert "cannot read" in hint.stderr and "MODEL.WEIGHTS" in hint.stderr


def test_overrides_and_cfg_still_win_over_the_stored_config(folder_run, tmp_path):
    run, cfg, folder = folder_run
    best = str(run / "checkpoints" / "best.pth")
    image = str(next((folder / "val" / "one").iterdir()))
    # TRAIN.IM_SIZE changes the preprocessing: the stored class names stay, the size follows the override
    from distribuuuu import inference

    opts = ["MODEL.WEIGHTS", best, "TRAIN.IM_SIZE", "28"]
    card = inference.card_for(inference.load_config(None, opts), None, opts)
    assert card.image_size == 28 and card.classes == ["four", "one", "seven"]
    renamed = tmp_path / "renamed"
    for name in ("a", "b", "c"):
        (renamed / "train" / name).mkdir(parents=True)
    proc = check(cli_main("predict", "MODEL.WEIGHTS", best, "TRAIN.DATASET", str(renamed), image, "--format", "json"))
    assert {c for c in json.loads(proc.stdout)[0]["classes"]} <= {"a", "b", "c"}  # the data's names now
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(yaml.safe_dump({"MODEL": {"ARCH": "resnet_mini"}}))
    other = check(cli_main("predict", "--cfg", str(cfg_file), "MODEL.WEIGHTS", best, image), 2)
    assert "MODEL.WEIGHTS" in other.stderr  # --cfg replaces the stored config: a resnet_mini does not fit


# ---------------------------------------------------------------------------------------------
# predict: inputs and outputs
# ---------------------------------------------------------------------------------------------
def test_predict_expands_folders_and_globs_and_writes_csv(digits_run, tmp_path):
    run, _, digits = digits_run
    best = str(run / "checkpoints" / "best.pth")
    pics = tmp_path / "pics"
    (pics / "deep" / ".hidden").mkdir(parents=True)
    shutil.copy(digits / "val" / "1" / "0100.png", pics / "a.png")
    shutil.copy(digits / "val" / "2" / "0200.png", pics / "deep" / "b.PNG")
    shutil.copy(digits / "val" / "2" / "0201.png", pics / "deep" / ".hidden" / "c.png")
    (pics / "notes.txt").write_text("not an image")
    out = tmp_path / "preds.csv"
    proc = check(cli_main("predict", "MODEL.WEIGHTS", best, "pics", "pics/*.png",
                          "--output", str(out), "--topk", "3", cwd=str(tmp_path)))
    assert "wrote the top-3 classes of 2 image(s)" in proc.stdout
    with open(out, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["path", "class_1", "prob_1", "class_2", "prob_2", "class_3", "prob_3"]
    assert [r[0] for r in rows[1:]] == ["pics/a.png", os.path.join("pics", "deep", "b.PNG")]
    assert all(float(r[2]) >= float(r[4]) >= float(r[6]) for r in rows[1:])
    globbed = check(cli_main("predict", "MODEL.WEIGHTS", best, "pics/**/*.PNG", "--format", "csv",
                             cwd=str(tmp_path)))
    assert [r[0] for r in csv.reader(globbed.stdout.splitlines())][1:] == ["pics/deep/b.PNG"]
    table = check(cli_main("predict", "MODEL.WEIGHTS", best, "pics/a.png", "--topk", "2", cwd=str(tmp_path)))
    assert re.fullmatch(r"pics/a\.png\n  1\. \d  [01]\.\d{4}\n  2\. \d  [01]\.\d{4}\n", table.stdout)


def test_predict_input_and_output_mistakes_exit_2(digits_run, tmp_path):
    run, _, _ = digits_run
    best = str(run / "checkpoints" / "best.pth")
    (tmp_path / "empty").mkdir()
    cases = [(["shots/*.jpg"], "the pattern 'shots/*.jpg' matches nothing"),
             (["empty"], "folder 'empty' holds no images"),
             (["missing.png"], "image file 'missing.png' does not exist"),
             (["empty", "--output", "preds.txt"], "name it .csv or .json")]
    for args, message in cases:
        proc = check(cli_main("predict", "MODEL.WEIGHTS", best, *args, cwd=str(tmp_path)), 2)
        assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# The plain-PyTorch code of docs/tour.md, run as written
# ---------------------------------------------------------------------------------------------
def _plain_pytorch_snippet() -> str:
    with open(os.path.join(ROOT, "docs", "tour.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Load a checkpoint without distribuuuu", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_tour_loads_the_checkpoint_without_distribuuuu(digits_run, tmp_path, capsys):
    run, _, digits = digits_run
    code = _plain_pytorch_snippet()
    # The files it opens (a run's best.pth, a digit), put where it looks for them, from tmp_path
    (checkpoint,) = re.findall(r'torch\.load\("([^"]+)"', code)
    (image,) = re.findall(r'Image\.open\("([^"]+)"\)', code)
    for src, dest in ((run / "checkpoints" / "best.pth", checkpoint), (digits / "val" / "7" / "0700.png", image)):
        (tmp_path / dest).parent.mkdir(parents=True)
        shutil.copy(src, tmp_path / dest)
    assert not re.search(r"^\s*(import|from) distribuuuu", code, re.M)  # plain PyTorch, timm, torchvision
    os.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "docs/tour.md", "exec"), scope)
    loaded = api.load_model(run / "checkpoints" / "best.pth")
    x = loaded.transform(Image.open(digits / "val" / "7" / "0700.png"))
    assert torch.equal(scope["x"], x[None])  # the page's preprocessing is distribuuuu's
    with torch.no_grad():
        assert torch.allclose(scope["model"](scope["x"]), loaded.model(x[None]), atol=1e-6)
    printed = capsys.readouterr().out.split()
    assert printed[0] == loaded.classes[int(loaded.model(x[None]).argmax())]


# ---------------------------------------------------------------------------------------------
# The installed command, from a folder outside the repository
# ---------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_installed_command_trains_fsdp_then_predicts_a_folder_from_the_checkpoint_alone(tmp_path):
    def run(*args):
        return check(subprocess.run([sys.executable, "-m", "distribuuuu", *args], cwd=tmp_path, env=env(),
                                    capture_output=True, text=True, timeout=240))

    # FSDP over 2 processes: the checkpoint is its gathered form, written by rank 0 with the card
    run("train", "--cfg", "synthetic_tiny", "--nproc-per-node", "2", "DIST.STRATEGY", "fsdp",
        "OUT_DIR", "runs/tiny", "OPTIM.MAX_EPOCH", "1", *FAST)
    pics = tmp_path / "pics" / "nested"
    pics.mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (40, 30), (80 * i, 40, 200 - 60 * i)).save(pics / f"{i}.png")
    run("predict", "MODEL.WEIGHTS", "runs/tiny/checkpoints/best.pth", "pics", "--topk", "2", "--output", "p.json")
    rows = json.loads((tmp_path / "p.json").read_text())
    card = torch.load(tmp_path / "runs/tiny/checkpoints/best.pth", weights_only=True)[CARD_KEY]
    assert "STRATEGY: fsdp" in card["config"] and card["classes"] == [str(c) for c in range(card["num_classes"])]
    assert [r["path"] for r in rows] == [f"pics/nested/{i}.png" for i in range(3)]
    assert all(set(r["classes"]) <= set(card["classes"]) and len(r["probs"]) == 2 for r in rows)
    assert all(0 <= r["probs"][1] <= r["probs"][0] <= 1 for r in rows)

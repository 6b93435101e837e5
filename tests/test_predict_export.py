"""`distribuuuu export`, `predict` (from a checkpoint and from an exported file) and `calibrate` on a
model trained for real: one epoch of the demo's config (config/mnist5k_fast.yaml, `make demo`'s) on two
processes, whose end fits the temperature of its best.pth."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from distribuuuu.weights import load_checkpoint
from tests.conftest import (
    ROOT,
    check,
    check_user_error,
    cli_main,
    distribuuuu,
    env,
    make_cfg,
    read_metrics,
)

pytestmark = pytest.mark.e2e  # every test here starts processes, or uses a module fixture that does

FAST = os.path.join(ROOT, "config", "mnist5k_fast.yaml")
OPTS = ["DEVICE", "cpu", "NUM_THREADS", "1"]
TOL = 1e-4


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(cfg, best.pth, the train command's output): resnet_tiny after one epoch on the 4,000 mnist5k
    training digits, two processes."""
    out = str(tmp_path_factory.mktemp("predict") / "run")
    proc = check(distribuuuu("train", "--cfg", FAST, "--nproc-per-node", "2", "OUT_DIR", out, "OPTIM.MAX_EPOCH", "1",
                             *OPTS))
    weights = os.path.join(out, "checkpoints", "best.pth")
    return make_cfg("MODEL.WEIGHTS", weights, *OPTS, base=FAST), weights, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The mnist5k digits as PNGs: val/<label>/<NNNN>.png is val item NNNN."""
    dest = str(tmp_path_factory.mktemp("digits"))
    check(distribuuuu("data", "export", "mnist5k", dest))
    return dest


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """(folder, export's output): the default formats, pt2, onnx and safetensors."""
    out = str(tmp_path_factory.mktemp("export") / "export")
    proc = check(cli_main("export", "--checkpoint", trained[1], "--out", out))
    return out, proc.stdout


def _val(cfg, digits):
    """(images as evaluation prepares them, labels, their PNG paths) of the 1,000 val digits."""
    from distribuuuu.data import build_dataset

    dataset = build_dataset(cfg, train=False)
    images = torch.stack([dataset[i][0] for i in range(len(dataset))])
    labels = [dataset[i][1] for i in range(len(dataset))]
    paths = [os.path.join(digits, "val", str(y), f"{i:04d}.png") for i, y in enumerate(labels)]
    return images, labels, paths


def _eager(cfg):
    from distribuuuu import models

    return models.build_model(cfg).eval()


def _parse(stdout):
    """{image path: [(class name, probability), ...]} from predict's output."""
    out, current = {}, None
    for line in stdout.splitlines():
        if line.startswith("  "):
            rank, name, prob = line.split()
            assert rank == f"{len(out[current]) + 1}."
            out[current].append((name, float(prob)))
        elif line.strip():
            current = line.strip()
            out[current] = []
    return out


# ---------------------------------------------------------------------------------------------
# calibration: at the end of training, and on demand
# ---------------------------------------------------------------------------------------------
def test_training_writes_the_temperature_into_the_chosen_checkpoint(trained):
    cfg, weights, output = trained
    folder = os.path.dirname(weights)
    card = load_checkpoint(weights)["card"]
    fit = card["calibration"]
    assert card["temperature"] == fit["temperature"] > 0
    assert fit["n"] == 1000 and fit["top1"] == fit["top1_calibrated"]  # every val digit once, over 2 ranks
    assert fit["nll_calibrated"] <= fit["nll"]
    val = [r for r in read_metrics(os.path.dirname(folder)) if r["split"] == "val"][-1]
    assert fit["top1"] == pytest.approx(val["top1"], abs=1e-9) and fit["nll"] == pytest.approx(val["loss"], rel=1e-5)
    line = next(line for line in output.splitlines() if "[calibration]" in line)
    assert f"{weights} (epoch 1) | temperature {fit['temperature']:.4f} | ECE" in line
    assert all(os.path.samefile(weights, os.path.join(folder, n)) for n in ("last.pth", "epoch_0001.pth"))


def test_calibrate_fits_the_same_temperature_in_one_process(trained, tmp_path):
    _, weights, _ = trained
    copy = str(tmp_path / "best.pth")
    shutil.copyfile(weights, copy)
    proc = check(cli_main("calibrate", "--checkpoint", copy))
    assert proc.stdout.startswith(f"calibrated {copy} | temperature ") and "(unchanged) | n 1000" in proc.stdout
    two_ranks, one = load_checkpoint(weights)["card"], load_checkpoint(copy)["card"]
    assert one["temperature"] == pytest.approx(two_ranks["temperature"], rel=1e-6)
    assert one["calibration"]["ece"] == pytest.approx(two_ranks["calibration"]["ece"], abs=1e-9)
    inode = os.stat(copy).st_ino
    again = check(cli_main("calibrate", "--checkpoint", copy))
    assert "(its card held this fit already: the file is unchanged)" in again.stdout and os.stat(copy).st_ino == inode


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------
def test_export_writes_pt2_onnx_and_safetensors_that_match_the_eager_model(trained, exported, digits):
    import onnx
    import onnxruntime
    import safetensors.torch

    cfg, weights, _ = trained
    out, stdout = exported
    assert f"input batchx1x36x36, temperature {load_checkpoint(weights)['card']['temperature']:.4g};" in stdout
    assert sorted(os.listdir(out)) == ["export.json", "model.onnx", "model.pt2", "model.safetensors"]  # no leftovers
    with open(os.path.join(out, "export.json")) as f:
        record = json.load(f)
    assert set(record["files"]) == {"pt2", "onnx", "safetensors"} and not record["errors"]
    assert all(0 <= d <= TOL for d in record["max_abs_diff"].values()), record["max_abs_diff"]
    card = load_checkpoint(weights)["card"]
    assert record["card"] == card

    onnx.checker.check_model(os.path.join(out, "model.onnx"))
    session = onnxruntime.InferenceSession(os.path.join(out, "model.onnx"), providers=["CPUExecutionProvider"])
    assert json.loads(session.get_modelmeta().custom_metadata_map["model_card"]) == card
    extra = {"model_card.json": ""}
    program = torch.export.load(os.path.join(out, "model.pt2"), extra_files=extra).module()
    assert json.loads(extra["model_card.json"]) == card

    images = _val(cfg, digits)[0][:20]  # real digits, on two batch sizes
    with torch.no_grad():
        expected = _eager(cfg)(images)
        for batch in (images, images[:3]):
            n = len(batch)
            assert (program(batch) - expected[:n]).abs().max() < 1e-5
            assert (torch.from_numpy(session.run(None, {"images": batch.numpy()})[0]) - expected[:n]).abs().max() < TOL
    state = safetensors.torch.load_file(os.path.join(out, "model.safetensors"))
    ckpt = load_checkpoint(weights)["model"]
    assert state.keys() == ckpt.keys() and all(torch.equal(state[k], ckpt[k]) for k in ckpt)


def test_torchscript_only_when_named_and_its_deprecation_said_once(trained, tmp_path, recwarn):
    _, weights, _ = trained
    proc = check(cli_main("export", "--checkpoint", weights, "--out", str(tmp_path), "--format", "torchscript"))
    assert proc.stdout.count("deprecated") == 1 and "torchscript  " in proc.stdout
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]  # said once, by the line
    assert sorted(os.listdir(tmp_path)) == ["export.json", "model.torchscript.pt"]


def test_an_export_that_fails_its_check_keeps_no_file_that_looks_complete(trained, tmp_path, monkeypatch, capsys):
    from distribuuuu.tools import export

    cfg, weights, _ = trained
    out = tmp_path / "export"
    out.mkdir()
    (out / "model.pt2").write_bytes(b"an older export")

    def wrong_pt2(model, example, path, card_json):  # a graph that computes something else
        model = _eager(cfg)
        model.fc.bias.data += 1.0
        export._save_pt2(model, example, path, card_json)

    def raising(model, example, path, card_json):
        raise RuntimeError("an operator the exporter cannot handle")

    monkeypatch.setitem(export.SAVERS, "pt2", wrong_pt2)
    monkeypatch.setitem(export.SAVERS, "torchscript", raising)
    status = export.main(None, ["MODEL.WEIGHTS", weights], str(out), TOL, 2, "pt2,torchscript,safetensors")
    captured = capsys.readouterr()
    assert status == 1
    assert re.search(r"pt2 +model.pt2 not kept  [\d.]+  ABOVE TOLERANCE", captured.out), captured.out
    assert "torchscript  model.torchscript.pt not kept  failed: RuntimeError: an operator" in captured.out
    assert "error: pt2, torchscript not exported" in captured.err
    assert sorted(os.listdir(out)) == ["export.json", "model.safetensors"]  # nor a staging folder
    assert set(json.loads((out / "export.json").read_text())["files"]) == {"safetensors"}


# ---------------------------------------------------------------------------------------------
# Without distribuuuu: the docs' consumer program, in a Python that cannot import it
# ---------------------------------------------------------------------------------------------
def _docs_program(path: str) -> None:
    """docs/tour.md's classify.py (the block written to that file when the docs run), to path."""
    with open(os.path.join(ROOT, "docs", "tour.md")) as f:
        text = f.read()
    block = re.search(r"<!-- readme:file path=classify.py -->\n```python\n(.*?)```", text, re.S)
    with open(path, "w") as f:
        f.write(block.group(1))


def _without_distribuuuu(program: str, *args: str, cwd: str):
    """python PROGRAM ARGS in a new interpreter in which `import distribuuuu` and `import timm` fail."""
    blocked = os.path.join(cwd, "blocked.py")
    with open(blocked, "w") as f:
        f.write("import runpy, sys\n"
                "sys.modules['distribuuuu'] = sys.modules['timm'] = None  # any import of them fails\n"
                "sys.argv = sys.argv[1:]\n"
                "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    return check(subprocess.run([sys.executable, blocked, program, *args], cwd=cwd, env=env(), capture_output=True,
                                text=True, timeout=240))


def test_exported_files_score_the_val_split_as_eval_does_without_distribuuuu(trained, exported, digits, tmp_path):
    cfg, weights, _ = trained
    out, _ = exported
    proc = check(distribuuuu("eval", "--checkpoint", weights))
    evaluated = json.loads(open(os.path.join(os.path.dirname(os.path.dirname(weights)), "eval.jsonl")).readlines()[-1])
    fit = load_checkpoint(weights)["card"]["calibration"]  # fitted on the same 1,000 val digits
    assert evaluated["temperature"] == fit["temperature"]
    assert evaluated["ece"] == pytest.approx(fit["ece"], abs=1e-6)
    assert evaluated["ece_calibrated"] == pytest.approx(fit["ece_calibrated"], abs=1e-6)
    ece = f"ECE {100 * evaluated['ece']:.2f}% -> {100 * evaluated['ece_calibrated']:.2f}% at temperature "
    assert ece + f"{fit['temperature']:.4g} | n 1000" in proc.stdout + proc.stderr
    images, labels, paths = _val(cfg, digits)
    with torch.no_grad():
        eager = _eager(cfg)(images).argmax(1).tolist()  # what eval counts, image by image
    assert evaluated["n"] == 1000 and 100.0 * sum(p == y for p, y in zip(eager, labels)) / 1000 == evaluated["top1"]
    program = str(tmp_path / "classify.py")
    _docs_program(program)
    for name in ("model.onnx", "model.pt2"):
        proc = _without_distribuuuu(program, os.path.join(out, name), *paths, cwd=str(tmp_path))
        rows = [line.split() for line in proc.stdout.splitlines()]
        assert [r[0] for r in rows] == paths
        assert [int(r[1]) for r in rows] == eager, name  # to the last image
        assert 100.0 * sum(int(r[1]) == y for r, y in zip(rows, labels)) / 1000 == evaluated["top1"]


# ---------------------------------------------------------------------------------------------
# predict
# ---------------------------------------------------------------------------------------------
def test_predict_from_an_exported_file_prints_what_predict_prints_from_the_checkpoint(trained, exported, digits):
    cfg, weights, _ = trained
    out, _ = exported
    images, labels, paths = _val(cfg, digits)
    chosen = [3, 120, 250, 480, 777, 999]
    files = [paths[i] for i in chosen]
    from_checkpoint = check(cli_main("predict", "--checkpoint", weights, *files)).stdout
    for name in ("model.pt2", "model.onnx"):
        assert check(cli_main("predict", "--model", os.path.join(out, name), *files)).stdout == from_checkpoint, name
    temperature = load_checkpoint(weights)["card"]["temperature"]
    with torch.no_grad():
        calibrated = (_eager(cfg)(images[chosen]) / temperature).softmax(1)
    for path, probs in zip(files, calibrated):
        top = _parse(from_checkpoint)[path]
        assert len(top) == 5 and top[0][0] == str(int(probs.argmax()))
        for name, q in top:
            assert q == pytest.approx(float(probs[int(name)]), abs=1e-4)  # softmax(logits / temperature)


def test_predict_with_a_config_file_keeps_the_checkpoints_temperature(trained, digits):
    cfg, weights, _ = trained
    images, _, paths = _val(cfg, digits)
    proc = check(cli_main("predict", "--cfg", FAST, "MODEL.WEIGHTS", weights, *OPTS, paths[5], "--topk", "10"))
    top = dict(_parse(proc.stdout)[paths[5]])
    with torch.no_grad():
        logits = _eager(cfg)(images[5:6])[0]
    temperature = load_checkpoint(weights)["card"]["temperature"]
    assert all(q == pytest.approx(float(p), abs=1e-4) for q, p in zip([top[str(c)] for c in range(10)],
                                                                       (logits / temperature).softmax(0)))


def test_predict_names_classes_from_the_imagefolder_tree(trained, digits, tmp_path):
    from PIL import Image

    from distribuuuu import inference

    cfg, weights, _ = trained
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    tree = tmp_path / "tree"
    for w in words:
        (tree / "train" / w).mkdir(parents=True)
    path = os.path.join(digits, "val", "4", "0400.png")
    data = ["TRAIN.DATASET", str(tree), "TEST.DATASET", str(tree)]
    proc = check(cli_main("predict", "--cfg", FAST, "MODEL.WEIGHTS", weights, *OPTS, *data, "--topk", "3", path))
    top = _parse(proc.stdout)[path]
    assert len(top) == 3 and {n for n, _ in top} <= set(words)
    # Label i is the i-th class folder in sorted order; the folder's (ImageNet-style) val transform.
    card = inference.card_from_config(make_cfg("MODEL.WEIGHTS", weights, *OPTS, *data, base=FAST))
    assert card.classes == sorted(words)
    with torch.no_grad():
        logits = _eager(cfg)(card.transform()(Image.open(path))[None])
    assert top[0][0] == sorted(words)[int(logits.argmax())]


def test_predict_export_and_calibrate_refuse_bad_input_with_exit_2(trained, exported, tmp_path):
    from PIL import Image

    _, weights, _ = trained
    out, _ = exported
    image = str(tmp_path / "blank.png")
    Image.new("L", (28, 28)).save(image)
    (tmp_path / "a_file").write_text("")
    garbage = tmp_path / "model.pt2"
    garbage.write_text("not an archive")
    empty = tmp_path / "run"
    empty.mkdir()
    cases = [
        (("predict", "--cfg", FAST, "MODEL.WEIGHTS", "w.pth", str(tmp_path / "cat.png")), ["cat.png", "does not exist"]),
        (("predict", "--cfg", FAST, "OUT_DIR", str(empty), image), ["predict needs trained weights"]),
        (("predict", "--cfg", FAST, "MODEL.WEIGHTS", "w.pth"), ["give one or more image files"]),
        (("predict", "--model", str(tmp_path / "model.onnx"), image), ["--model", "does not exist"]),
        (("predict", "--model", weights, image), ["not a .pt2 or .onnx file", f"--checkpoint {weights}"]),
        (("predict", "--model", str(garbage), image), ["cannot be loaded (BadZipFile", "`distribuuuu export` wrote"]),
        (("predict", "--model", os.path.join(out, "model.pt2"), "TEST.BATCH_SIZE", "2", image),
         ["takes no KEY VALUE pairs"]),
        (("export", "--cfg", FAST, "MODEL.WEIGHTS", str(tmp_path / "nope.pth")), ["MODEL.WEIGHTS", "does not exist"]),
        (("export", "OUT_DIR", str(empty)), ["export needs trained weights"]),
        (("export", "--checkpoint", weights, "--format", "pt2,pt3"), ["unknown format pt3", "pt2, onnx, safetensors"]),
        (("export", "--checkpoint", weights, "--out", str(tmp_path / "a_file")), ["--out", "is a file"]),
        (("calibrate", "--checkpoint", os.path.join(out, "model.safetensors")), ["checkpoint of `distribuuuu train`"]),
        (("calibrate", "OUT_DIR", str(empty)), ["calibrate needs trained weights"]),
    ]
    for args, fragments in cases:
        check_user_error(cli_main(*args), *fragments)
    assert sorted(os.listdir(empty)) == []  # nothing written by a refusal


def test_without_the_onnx_packages_the_default_export_says_it_skips_onnx(monkeypatch):
    import importlib.util

    from distribuuuu.errors import UserError
    from distribuuuu.tools import export

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "onnxruntime" else find_spec(name))
    assert export.chosen_formats(None) == (
        ["pt2", "safetensors"], "ONNX skipped: ONNX needs onnxruntime: pip install 'distribuuuu[onnx]'")
    with pytest.raises(UserError, match=r"--format onnx: ONNX needs onnxruntime"):
        export.chosen_formats("pt2,onnx")

"""`distribuuuu predict` and `distribuuuu export` on a model trained for real (one epoch of mnist5k)."""

import importlib.util
import json
import os

import pytest
import torch

from tests.conftest import ROOT, check, distribuuuu, make_cfg

pytestmark = pytest.mark.e2e  # every test here starts processes

MNIST = os.path.join(ROOT, "config", "mnist5k_demo.yaml")
OPTS = ["DEVICE", "cpu", "NUM_THREADS", "1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(cfg, weights): resnet_tiny after one epoch on the 4,000 mnist5k training digits."""

    out = str(tmp_path_factory.mktemp("predict") / "run")
    check(distribuuuu("train", "--cfg", MNIST, "OUT_DIR", out, "OPTIM.MAX_EPOCH", "1", *OPTS))
    weights = os.path.join(out, "checkpoints", "best.pth")
    return make_cfg("MODEL.WEIGHTS", weights, *OPTS, base=MNIST), weights


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    dest = str(tmp_path_factory.mktemp("digits"))
    check(distribuuuu("data", "export", "mnist5k", dest))
    return dest


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
# export
# ---------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")
def test_export_writes_torchscript_and_safetensors_that_match_the_eager_model(trained, tmp_path):
    import safetensors.torch

    from distribuuuu import data, models

    cfg, weights = trained
    out = str(tmp_path / "export")
    proc = check(distribuuuu("export", "--cfg", MNIST, "MODEL.WEIGHTS", weights, *OPTS, "--out", out))
    assert "max |exported - eager|" in proc.stdout and "tolerance 0.0001" in proc.stdout
    if importlib.util.find_spec("onnx") is None:
        assert "ONNX skipped: the onnx package is not installed" in proc.stdout
        assert not os.path.exists(os.path.join(out, "model.onnx"))
    else:
        assert os.path.isfile(os.path.join(out, "model.onnx"))
    with open(os.path.join(out, "export.json")) as f:
        record = json.load(f)
    assert record["input_shape"] == ["batch", 1, 28, 28]
    assert record["max_abs_diff"]["torchscript"] <= 1e-4 and record["max_abs_diff"]["safetensors"] <= 1e-4

    # Reload both files here and compare with the eager model on real validation digits.
    dataset = data.build_dataset(cfg, train=False)
    images = torch.stack([dataset[i][0] for i in range(0, 1000, 50)])  # 20 digits
    eager = _eager(cfg)
    with torch.no_grad():
        expected = eager(images)
        scripted = torch.jit.load(os.path.join(out, "model.torchscript.pt"))
        assert (scripted(images) - expected).abs().max() < 1e-5
        assert (scripted(images[:3]) - expected[:3]).abs().max() < 1e-5  # another batch size
        state = safetensors.torch.load_file(os.path.join(out, "model.safetensors"))
        ckpt = torch.load(weights, map_location="cpu", weights_only=True)["model"]
        assert state.keys() == ckpt.keys() and all(torch.equal(state[k], ckpt[k]) for k in ckpt)
        fresh = models.build_model(_no_weights(cfg))
        fresh.load_state_dict(state)
        assert torch.equal(fresh.eval()(images), expected)
    assert (expected.argmax(1) == torch.tensor([dataset[i][1] for i in range(0, 1000, 50)])).float().mean() > 0.5


def _no_weights(cfg):
    c = cfg.clone()
    c.defrost()
    c.MODEL.WEIGHTS = None
    return c


def test_export_fails_when_an_output_differs_beyond_the_tolerance(trained, tmp_path, monkeypatch, capsys):
    from distribuuuu.tools import export

    cfg, weights = trained
    # A TorchScript file that computes something else: the check must catch it.
    monkeypatch.setattr(export, "_torchscript", lambda model, batches, expected, path: 0.5)
    status = export.main(MNIST, ["MODEL.WEIGHTS", weights, *OPTS], str(tmp_path / "e"), 1e-4, 2)
    captured = capsys.readouterr()
    assert status == 1
    assert "ABOVE TOLERANCE" in captured.out and "torchscript output differs" in captured.err


# ---------------------------------------------------------------------------------------------
# predict
# ---------------------------------------------------------------------------------------------
def test_predict_prints_the_top5_of_the_eager_model(trained, digits):
    from distribuuuu.data import build_dataset

    cfg, weights = trained
    dataset = build_dataset(cfg, train=False)
    positions = [3, 120, 250, 480, 777, 999]  # val/<label>/<position>.png is val item <position>
    paths = [os.path.join(digits, "val", str(dataset[p][1]), f"{p:04d}.png") for p in positions]
    proc = check(distribuuuu("predict", "--cfg", MNIST, "MODEL.WEIGHTS", weights, *OPTS, *paths))
    printed = _parse(proc.stdout)
    assert list(printed) == paths
    eager = _eager(cfg)
    for path, p in zip(paths, positions):
        top = printed[path]
        names, probs = [n for n, _ in top], [q for _, q in top]
        assert len(top) == 5 and len(set(names)) == 5 and set(names) <= set("0123456789")
        assert probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-3
        with torch.no_grad():
            softmax = eager(dataset[p][0][None]).softmax(1)[0]
        assert names[0] == str(int(softmax.argmax()))  # the eager model's prediction
        for name, q in top:
            assert q == pytest.approx(float(softmax[int(name)]), abs=1e-4)


def test_predict_names_classes_from_the_imagefolder_tree(trained, digits, tmp_path):
    from PIL import Image

    from distribuuuu.data import transforms

    cfg, weights = trained
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    tree = tmp_path / "tree"
    for w in words:
        (tree / "train" / w).mkdir(parents=True)
    path = os.path.join(digits, "val", "4", "0400.png")
    proc = check(distribuuuu("predict", "--cfg", MNIST, "MODEL.WEIGHTS", weights, *OPTS, "TRAIN.DATASET",
                             str(tree), "TEST.DATASET", str(tree), "--topk", "3", path))
    top = _parse(proc.stdout)[path]
    assert len(top) == 3 and {n for n, _ in top} <= set(words)
    # Label i is the i-th class folder in sorted order; the folder (ImageNet-style) val transform.
    tf = transforms.folder_transform(False, 28, 28, 1)
    with torch.no_grad():
        logits = _eager(cfg)(tf(Image.open(path).convert("L"))[None])
    assert top[0][0] == sorted(words)[int(logits.argmax())]


def test_predict_and_export_bad_input_exit_2(tmp_path):
    missing = check(distribuuuu("predict", "--cfg", MNIST, "MODEL.WEIGHTS", "w.pth", str(tmp_path / "cat.png")), 2)
    assert "image file" in missing.stderr and "cat.png" in missing.stderr and "does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr and len(missing.stderr.strip().splitlines()) == 1
    (tmp_path / "cat.png").write_bytes(b"not an image")
    garbage = check(distribuuuu("predict", "--cfg", MNIST, "MODEL.WEIGHTS", "w.pth", str(tmp_path / "cat.png")), 2)
    assert "cannot read" in garbage.stderr and "as an image" in garbage.stderr
    from PIL import Image

    Image.new("L", (28, 28)).save(tmp_path / "blank.png")
    no_weights = check(distribuuuu("predict", "--cfg", MNIST, "OUT_DIR", str(tmp_path), str(tmp_path / "blank.png")), 2)
    assert "predict needs trained weights" in no_weights.stderr
    none = check(distribuuuu("predict", "--cfg", MNIST, "MODEL.WEIGHTS", "w.pth"), 2)
    assert "give one or more image files" in none.stderr
    export = check(distribuuuu("export", "--cfg", MNIST, "MODEL.WEIGHTS", str(tmp_path / "nope.pth")), 2)
    assert "MODEL.WEIGHTS" in export.stderr and "does not exist" in export.stderr

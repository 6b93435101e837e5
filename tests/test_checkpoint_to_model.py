"""Which checkpoint of a run becomes the model: eval, predict, export and load_model take the
same file of a run (run_folder.best_or_last, through inference.chosen_weights), with the same card
and the same weights. The run's best.pth and last.pth differ here (other weights, other class
names), so a command that chose its file by a rule of its own would show it."""

from __future__ import annotations

import json
import os

import pytest
import safetensors.torch
import torch
from PIL import Image

from distribuuuu import api, data, inference, run_folder
from distribuuuu.errors import UserError
from distribuuuu.tools import export, predict
from distribuuuu.weights import INTEGRITY_KEY, load_checkpoint
from tests.conftest import TINY, cli_main, make_cfg, process_state_restored

OPTS = ["OPTIM.MAX_EPOCH", "1", "TRAIN.SYNTHETIC_SAMPLES", "32", "TEST.SYNTHETIC_SAMPLES", "16", "NUM_THREADS", "1"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run whose best.pth is epoch 1 and whose last.pth is epoch 2, with shifted weights and the
    classes renamed, written by RunFolder.save as training writes it."""
    out = str(tmp_path_factory.mktemp("one_path") / "run")
    with process_state_restored():
        torch.set_num_threads(1)
        api.train(make_cfg("OUT_DIR", out, *OPTS, base=TINY))
    state = load_checkpoint(os.path.join(out, "checkpoints", "epoch_0001.pth"))
    del state[INTEGRITY_KEY]
    state["model"] = {k: v + 0.25 if v.is_floating_point() else v for k, v in state["model"].items()}
    state["card"] = {**state["card"], "classes": ["w", "x", "y", "z"]}
    state["epoch"] += 1
    run_folder.RunFolder(make_cfg("OUT_DIR", out, "TRAIN.CKPT_KEEP", "5", base=TINY)).save(state, is_best=False)
    return out


def _same_weights(state: dict[str, torch.Tensor], ckpt: dict) -> bool:
    return set(state) == set(ckpt["model"]) and all(torch.equal(state[k], v) for k, v in ckpt["model"].items())


def _assert_all_use(out: str, tmp: str, expected: str) -> None:
    """eval (API and CLI config), predict, export and load_model of the run out all use the file
    expected: its path, its card and its weights."""
    ckpt = load_checkpoint(expected)
    loaded = api.load_model(expected)
    assert loaded.card.to_dict() == ckpt["card"] and _same_weights(loaded.model.state_dict(), ckpt)

    evaluated = api.evaluate(make_cfg("OUT_DIR", out, *OPTS, base=TINY))  # no MODEL.WEIGHTS: run_eval chooses
    assert os.path.samefile(evaluated["weights"], expected)
    assert os.path.samefile(inference.load_config(None, ["OUT_DIR", out]).MODEL.WEIGHTS, expected)  # eval OUT_DIR run
    loader = data.build_test_loader(loaded.config, 0, 1, torch.device("cpu"))
    with torch.no_grad():
        correct = sum(int((loaded.model(x).argmax(1) == y).sum()) for x, y in loader)
    assert 100.0 * correct / evaluated["n"] == pytest.approx(evaluated["top1"], abs=1e-6)  # eval used those weights

    os.makedirs(tmp)
    image, preds = os.path.join(tmp, "photo.png"), os.path.join(tmp, "preds.json")
    Image.new("RGB", (20, 20), (200, 30, 90)).save(image)
    assert predict.main(None, ["OUT_DIR", out, image], 4, preds) == 0
    with open(preds) as f:
        row = json.load(f)[0]
    with torch.no_grad():
        logits = loaded.model(loaded.transform(Image.open(image))[None])
        top = (logits / loaded.card.temperature).softmax(1)[0].topk(4)  # calibrated
    assert row["classes"] == [ckpt["card"]["classes"][i] for i in top.indices.tolist()]  # the card's names
    assert row["probs"] == pytest.approx(top.values.tolist(), abs=1e-6)  # and weights

    # pt2 and safetensors: the shifted weights of last.pth make logits of about 1e16, which onnxruntime's
    # float32 kernels reproduce to 1e-6 of their size, far above export's absolute tolerance
    assert export.main(None, ["OUT_DIR", out], os.path.join(tmp, "export"), 1e-4, 2, "pt2,safetensors") == 0
    with open(os.path.join(tmp, "export", "export.json")) as f:
        exported = json.load(f)
    assert os.path.samefile(exported["weights"], expected) and exported["card"] == ckpt["card"]
    assert _same_weights(safetensors.torch.load_file(os.path.join(tmp, "export", "model.safetensors")), ckpt)


def test_eval_predict_export_and_load_model_use_the_runs_chosen_checkpoint(run, tmp_path, monkeypatch):
    folder = os.path.join(run, "checkpoints")
    best, last = os.path.join(folder, "best.pth"), os.path.join(folder, "last.pth")
    assert run_folder.best_or_last(run) == best and not os.path.samefile(best, last)
    _assert_all_use(run, str(tmp_path / "a"), best)  # best.pth, not the newer last.pth

    first = os.path.join(folder, "epoch_0001.pth")
    monkeypatch.setattr(run_folder, "best_or_last", lambda out_dir: first if out_dir == run else None)
    os.remove(best)  # by the rule, last.pth (epoch 2) now; through the one function, what it answers
    _assert_all_use(run, str(tmp_path / "b"), first)
    monkeypatch.undo()
    _assert_all_use(run, str(tmp_path / "c"), last)

    os.remove(last)
    assert run_folder.best_or_last(run) is None
    image = str(tmp_path / "a" / "photo.png")
    for command, call in (("eval", lambda: api.evaluate(make_cfg("OUT_DIR", run, *OPTS, base=TINY))),
                          ("predict", lambda: predict.main(TINY, ["OUT_DIR", run, image], 2)),
                          ("export", lambda: export.main(TINY, ["OUT_DIR", run], str(tmp_path / "x"), 1e-4, 2))):
        with pytest.raises(UserError, match=f"^{command} needs .*holds no best.pth or last.pth"):
            call()


@pytest.mark.parametrize("command", ["eval", "predict", "export"])
def test_a_run_folder_as_checkpoint_is_named_a_folder_without_cfg_too(tmp_path, command):
    """Before: without --cfg (the checkpoint's own config), "MODEL.WEIGHTS ... does not exist" for a
    folder that does; with --cfg it was named a folder (tests/test_cli.py)."""
    folder = tmp_path / "run"
    folder.mkdir()
    image = tmp_path / "photo.png"
    Image.new("RGB", (8, 8)).save(image)
    result = cli_main(command, "--checkpoint", str(folder), *([str(image)] if command == "predict" else []))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: MODEL.WEIGHTS {str(folder)!r} is a folder; give a checkpoint file (it holds no best.pth or "
        "last.pth, nor a checkpoints/ folder with one)"]


def test_a_folder_given_as_the_checkpoint_is_answered_with_a_file_that_exists(tmp_path):
    """The hint names the file the folder holds: a run folder's checkpoints/best.pth (last.pth when
    there is no best), the checkpoints folder's own best.pth. Before: `eval MODEL.WEIGHTS
    runs/x/checkpoints` suggested runs/x/checkpoints/checkpoints/best.pth."""
    checkpoints = tmp_path / "x" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "last.pth").write_bytes(b"")
    cases = {tmp_path / "x": checkpoints / "last.pth", checkpoints: checkpoints / "last.pth"}
    for given, named in cases.items():
        result = cli_main("eval", "MODEL.WEIGHTS", str(given))
        assert named.exists() and result.stderr.strip().splitlines() == [
            f"error: MODEL.WEIGHTS {str(given)!r} is a folder; give a checkpoint file (e.g. {named})"], result.stderr
    (checkpoints / "best.pth").write_bytes(b"")
    result = cli_main("eval", "MODEL.WEIGHTS", str(checkpoints))
    assert result.stderr.strip().endswith(f"(e.g. {checkpoints / 'best.pth'})"), result.stderr

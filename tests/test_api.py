"""The public Python API (distribuuuu/api.py), in process: train, evaluate, load_model, errors."""

from __future__ import annotations

import pytest
import torch

import distribuuuu
from distribuuuu import api, data, inferred
from distribuuuu.engine import HookBase
from distribuuuu.errors import UserError
from tests.conftest import TINY, make_cfg

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _cfg(out_dir, *opts):
    """TINY into out_dir, unresolved: what a user's load_config gives the API, which resolves it."""
    return make_cfg("OUT_DIR", out_dir, *opts, base=TINY, resolve=False)


class _Events(HookBase):
    """Records the events it sees, as a user's hook would."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def before_fit(self, trainer) -> None:
        self.seen.append("before_fit")

    def after_epoch(self, trainer, metrics) -> None:
        self.seen.append(f"after_epoch {trainer.state.epoch}")

    def after_fit(self, trainer, summary) -> None:
        self.seen.append("after_fit")


def test_train_evaluate_and_load_model_agree(tmp_path):
    cfg = _cfg(tmp_path / "run")
    events = _Events()
    summary = distribuuuu.train(cfg, hooks=[events])  # the package's lazy re-export of api.train
    assert isinstance(summary, dict) and summary["epochs"] == 2
    assert events.seen == ["before_fit", "after_epoch 1", "after_epoch 2", "after_fit"]
    best = tmp_path / "run" / "checkpoints" / "best.pth"
    assert best.is_file()
    assert not (tmp_path / "run" / "run.lock").exists()  # released at the end, as under the CLI
    assert (tmp_path / "run" / "config.yaml").is_file()

    record = api.evaluate(cfg)  # no MODEL.WEIGHTS: OUT_DIR's best.pth
    assert record["weights"] == str(best) and record["n"] == 50

    model = api.load_model(str(best)).model  # a LoadedModel: .model, .transform, .classes, .config, .card
    assert not model.training and next(model.parameters()).device.type == "cpu"
    loader = data.build_test_loader(inferred.resolve(cfg), 0, 1, torch.device("cpu"))
    correct = n = 0
    with torch.no_grad():
        for images, labels in loader:
            correct += int((model(images).argmax(dim=1) == labels).sum())
            n += len(labels)
    assert n == record["n"]
    assert 100.0 * correct / n == pytest.approx(record["top1"], abs=1e-6)


def test_load_model_refuses_what_is_not_a_checkpoint(tmp_path):
    cfg = make_cfg("OUT_DIR", tmp_path, base=TINY)  # resolved: a model is built from decided keys
    from distribuuuu import models

    plain = tmp_path / "weights.pth"
    torch.save(models.build_model(cfg).state_dict(), plain)
    with pytest.raises(UserError, match="holds no run config"):
        api.load_model(str(plain))
    with pytest.raises(UserError, match="does not exist"):
        api.load_model(str(tmp_path / "missing.pth"))


def test_user_errors_raise_instead_of_exiting(tmp_path):
    with pytest.raises(UserError):  # a key that does not exist
        api.train(_cfg(tmp_path, "TRAIN.NO_SUCH_KEY", "1"))
    with pytest.raises(UserError, match="MODEL.ARCH|no_such_net"):  # caught before any process group
        api.train(_cfg(tmp_path / "run", "MODEL.ARCH", "no_such_net"))
    assert not (tmp_path / "run" / "run.lock").exists()
    with pytest.raises(TypeError):
        api.train({"OUT_DIR": str(tmp_path)})

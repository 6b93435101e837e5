"""The Trainer's hooks, in process: the call order, stopping a run, TRAIN.HOOKS, the example hook."""

import os
import sys

import pytest

from distribuuuu import engine
from distribuuuu.errors import UserError
from distribuuuu.launch import comm
from tests.conftest import ROOT, TINY, fit, make_cfg, read_metrics

STEPS_PER_EPOCH = 8  # synthetic_tiny: 128 samples, batch 16, one process


def _cfg(tmp_path, *opts: str):
    """This module's runs: TINY into tmp_path/run, without progress lines."""
    return make_cfg("OUT_DIR", tmp_path / "run", "TRAIN.PRINT_FREQ", "100", *opts, base=TINY)


class Recorder(engine.HookBase):
    """Every event as (name, epochs completed, optimizer steps)."""

    def __init__(self):
        self.events = []

    def _add(self, name, trainer):
        self.events.append((name, trainer.state.epoch, trainer.state.global_step))

    def before_fit(self, trainer):
        self._add("before_fit", trainer)

    def before_epoch(self, trainer):
        self._add("before_epoch", trainer)

    def after_step(self, trainer, step, printed):
        self._add("after_step", trainer)

    def after_epoch(self, trainer, metrics):
        self._add("after_epoch", trainer)

    def after_eval(self, trainer, split, records):
        self._add(f"after_eval:{split}", trainer)

    def after_fit(self, trainer, summary):
        self._add("after_fit", trainer)


class StopAfterFirstEpoch(engine.HookBase):
    """Made by TRAIN.HOOKS (no arguments): ends the run after its first epoch."""

    def after_epoch(self, trainer, metrics):
        trainer.stop("stopped by a hook")


def test_hooks_see_the_documented_order(tmp_path):
    rec = Recorder()
    summary = fit(_cfg(tmp_path, "TRAIN.ACCUM_STEPS", "2"), hooks=[rec])
    names = [e[0] for e in rec.events]
    per_epoch = ["before_epoch", *["after_step"] * STEPS_PER_EPOCH, "after_eval:val", "after_epoch"]
    assert names == ["before_fit", *per_epoch, *per_epoch, "after_fit"]
    # after_step comes after every batch; the optimizer steps every second one (ACCUM_STEPS 2).
    steps = [e[2] for e in rec.events if e[0] == "after_step"][:4]
    assert steps == [0, 1, 1, 2]
    # after_epoch: the epoch is counted and its checkpoint (a built-in hook before this one) written.
    assert [e[1] for e in rec.events if e[0] == "after_epoch"] == [1, 2]
    assert os.path.isfile(tmp_path / "run" / "checkpoints" / "epoch_0001.pth")
    assert summary["epochs"] == 2


def test_a_hook_from_the_config_can_stop_training(tmp_path, caplog):
    cfg = _cfg(tmp_path, "TRAIN.HOOKS", "['tests.test_hooks:StopAfterFirstEpoch']", "OPTIM.MAX_EPOCH", "3")
    with caplog.at_level("INFO", logger="distribuuuu"):
        summary = fit(cfg)
    assert summary["epochs"] == 1
    assert [(r["epoch"], r["split"]) for r in read_metrics(cfg.OUT_DIR)] == [(1, "train"), (1, "val")]
    assert "done (stopped by a hook)" in caplog.text


def test_a_hook_that_cannot_be_imported_is_a_user_error_naming_it(tmp_path):
    cfg = _cfg(tmp_path, "TRAIN.HOOKS", "['no_such_package.hooks:Nothing']")
    with comm.session(cfg) as ctx, pytest.raises(UserError, match="no_such_package.hooks:Nothing"):
        engine.Trainer(cfg, ctx)
    cfg = _cfg(tmp_path, "TRAIN.HOOKS", "['tests.test_hooks:NoSuchClass']")
    with comm.session(cfg) as ctx, pytest.raises(UserError, match="tests.test_hooks:NoSuchClass"):
        engine.Trainer(cfg, ctx)


def test_the_example_plateau_hook_ends_a_run(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples", "hooks"))
    monkeypatch.delitem(sys.modules, "plateau", raising=False)
    from distribuuuu.engine.hooks import from_config

    # As the README runs it: named in TRAIN.HOOKS, made with its default settings.
    cfg = _cfg(tmp_path, "TRAIN.HOOKS", "['plateau:StopOnPlateau']", "OPTIM.MAX_EPOCH", "4")
    (made,) = from_config(cfg)
    assert (made.patience, made.min_delta) == (3, 1e-3)
    # From Python, with a min_delta no loss can beat: the second evaluation is "no improvement".
    summary = fit(_cfg(tmp_path, "OPTIM.MAX_EPOCH", "4"), hooks=[type(made)(patience=1, min_delta=1e9)])
    assert summary["epochs"] == 2

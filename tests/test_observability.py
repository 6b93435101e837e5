"""Observability (#16 item 5), in process: per-step TensorBoard scalars and top-k tags, eval.jsonl,
env.json's history of starts, a logged seed that repeats the run, and --help of every subcommand."""

from __future__ import annotations

import argparse
import csv
import json
import re

import pytest
import torch

from distribuuuu import api, cli, config
from distribuuuu.engine import HookBase
from distribuuuu.run_folder.metrics_files import read_jsonl
from tests.conftest import TINY, cli_main, read_metrics

# Fields of a record that do not depend on the seed's outcome but on the machine's speed.
TIMING = ("img_per_s", "time_s", "data_frac", "peak_mem_mb", "time_to_target_s")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _cfg(out_dir, *opts: str):
    """TINY (TRAIN.TOPK 2) with 64 samples, 4 iterations an epoch, a line every 2."""
    return config.load_config(TINY, ["OUT_DIR", str(out_dir), "TRAIN.SYNTHETIC_SAMPLES", "64",
                                     "TRAIN.PRINT_FREQ", "2", *opts])


def _numbers(out_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(out_dir)]


@pytest.fixture
def unseeded(tmp_path):
    """A run with RNG_SEED None: two epochs of 4 iterations (per test: conftest's autouse fixture
    restores the logging and signal handlers a run installs only around a function's fixtures)."""
    out = tmp_path / "none"
    api.train(_cfg(out, "RNG_SEED", "None"))
    return out


def test_rng_seed_none_logs_a_seed_that_repeats_the_run(unseeded, tmp_path):
    env = json.loads((unseeded / "env.json").read_text())
    seed = env["seed"]
    assert isinstance(seed, int) and env["rng_seed_given"] is False
    assert f"using seed {seed} (pass RNG_SEED {seed} to repeat this run)" in (unseeded / "log.txt").read_text()
    ckpt = torch.load(unseeded / "checkpoints" / "last.pth", weights_only=True)
    assert ckpt["seed"] == seed
    assert "RNG_SEED: null" in (unseeded / "config.yaml").read_text()  # the user's config, as given

    again = tmp_path / "again"
    api.train(_cfg(again, "RNG_SEED", str(seed)))
    assert json.loads((again / "env.json").read_text())["seed"] == seed
    assert _numbers(again) == _numbers(unseeded)  # the same losses and accuracies, epoch by epoch
    # The shuffle follows the seed: another seed trains on another order (so the check above can fail)
    other = tmp_path / "other"
    api.train(_cfg(other, "RNG_SEED", str(seed + 1)))
    assert _numbers(other) != _numbers(unseeded)


class _StopAfterFirstEpoch(HookBase):
    """Ends the run after its first epoch (and that epoch's checkpoint), as a stopped job would."""

    def after_epoch(self, trainer, metrics) -> None:
        trainer.stop("stopped by the test")


def test_a_resumed_run_keeps_its_seed_and_a_record_of_every_start(tmp_path):
    out = tmp_path / "run"
    api.train(_cfg(out, "RNG_SEED", "None"), hooks=[_StopAfterFirstEpoch()])  # as if killed after epoch 1
    first = json.loads((out / "env.json").read_text())["seed"]
    api.train(_cfg(out, "RNG_SEED", "None"))  # auto-resume: epoch 2
    starts = read_jsonl(str(out / "env_history.jsonl"))
    env = json.loads((out / "env.json").read_text())
    assert [s["seed"] for s in starts] == [first, first] and env == starts[-1]  # env.json: the latest start
    assert starts[0]["start_time"] <= starts[1]["start_time"]
    assert f"the seed of the run being resumed {first}" in (out / "log.txt").read_text()
    # One run with that seed from the start gives the same records
    straight = tmp_path / "straight"
    api.train(_cfg(straight, "RNG_SEED", str(first)))
    assert _numbers(out) == _numbers(straight)


def test_without_env_json_a_resume_takes_the_seed_from_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    api.train(_cfg(out, "RNG_SEED", "None"), hooks=[_StopAfterFirstEpoch()])
    first = json.loads((out / "env.json").read_text())["seed"]
    (out / "env.json").unlink()  # the hand-over before the data is built is gone: the checkpoint's seed rules
    api.train(_cfg(out, "RNG_SEED", "None"))
    assert f"the checkpoint's run used seed {first}" in (out / "log.txt").read_text()
    assert torch.load(out / "checkpoints" / "last.pth", weights_only=True)["seed"] == first
    assert json.loads((out / "env.json").read_text())["seed"] == first  # this start's record, corrected
    assert [s["seed"] for s in read_jsonl(str(out / "env_history.jsonl"))] == [first, first]  # both starts
    straight = tmp_path / "straight"
    api.train(_cfg(straight, "RNG_SEED", str(first)))
    assert _numbers(out) == _numbers(straight)


def test_tensorboard_has_step_scalars_and_names_the_real_k(unseeded):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(unseeded / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    step_tags = {f"train_step/{k}" for k in ("loss", "lr", "img_per_s", "top1", "top2")}
    assert step_tags <= tags and {"train/top2", "val/top2", "train/loss", "val/top1"} <= tags, sorted(tags)
    assert not any("top5" in t for t in tags), sorted(tags)  # TRAIN.TOPK 2
    # 4 iterations an epoch, a line every 2: global steps 2, 4, 6, 8
    assert [e.step for e in acc.Scalars("train_step/loss")] == [2, 4, 6, 8]
    assert all(e.value > 0 for e in acc.Scalars("train_step/img_per_s"))
    # The step line at the end of an epoch holds that epoch's running loss and last LR: the epoch record's
    train = [r for r in read_metrics(unseeded) if r["split"] == "train"]
    losses = {e.step: e.value for e in acc.Scalars("train_step/loss")}
    lrs = {e.step: e.value for e in acc.Scalars("train_step/lr")}
    assert losses[4] == pytest.approx(train[0]["loss"], rel=1e-5) and losses[8] == pytest.approx(train[1]["loss"], rel=1e-5)
    assert lrs[4] == pytest.approx(train[0]["lr"], rel=1e-6) and lrs[8] == pytest.approx(train[1]["lr"], rel=1e-6)
    assert {e.step: e.value for e in acc.Scalars("val/top2")}[2] == pytest.approx(
        [r for r in read_metrics(unseeded) if r["split"] == "val"][-1]["topk_acc"], rel=1e-6)
    # "topk_acc" holds top-TOPK and "topk" says k; the old name of the field ("top5") is not written
    assert all("topk_acc" in r and "top5" not in r for r in read_metrics(unseeded))


def test_eval_into_a_run_folder_writes_eval_jsonl_only(tmp_path):
    out = tmp_path / "run"
    cfg = _cfg(out, "OPTIM.MAX_EPOCH", "1")
    api.train(cfg)
    before = {name: (out / name).read_bytes() for name in ("metrics.jsonl", "metrics.csv")}
    record = api.evaluate(cfg)
    api.evaluate(cfg)
    assert {name: (out / name).read_bytes() for name in before} == before  # the run's records untouched
    evals = read_jsonl(str(out / "eval.jsonl"))
    assert len(evals) == 2 and evals[0] == json.loads(json.dumps(record))
    assert evals[0]["weights"].endswith("best.pth") and evals[0]["n"] == 50 and evals[0]["topk"] == 2
    with open(out / "metrics.csv", newline="") as f:
        assert all(row["epoch"] for row in csv.DictReader(f))  # no row without an epoch


def _subparsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, parser) of every command that has its own options, nested ones included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _subparsers(sub, (*path, name))


def test_help_of_every_subcommand_shows_its_options_and_defaults():
    commands = list(_subparsers(cli.build_parser()))
    assert {words for words, _ in commands} >= {("train",), ("eval",), ("config",), ("plot",), ("bench",),
                                                 ("predict",), ("export",), ("data", "export")}
    for words, parser in commands:
        proc = cli_main(*words, "--help")
        assert proc.returncode == 0, (words, proc.stderr)
        text = " ".join(proc.stdout.split())  # argparse wraps lines
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction,
                                                                        argparse._SubParsersAction)):
                continue
            name = action.option_strings[0] if action.option_strings else (action.metavar or action.dest)
            assert name in text, (words, name)
            if action.option_strings:  # every option says its default, in numbers or in words
                help_text = " ".join(cli._HelpFormatter("x")._get_help_string(action).split())
                assert re.search(r"default", help_text), (words, name, help_text)
                if action.default is not None and "%(default)" in help_text:
                    assert f"(default: {action.default})" in text, (words, name)

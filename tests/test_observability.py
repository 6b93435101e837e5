"""What users look at: TensorBoard events (per epoch and per step), metrics.jsonl and metrics.csv,
eval.jsonl, env.json and its history of starts (the seed that repeats a run), model.txt, the progress
display (a bar on a terminal, lines otherwise) and `distribuuuu plot`.

Real runs: two processes under the spawner for the records every rank contributes to (module-scoped,
shared), in process for the seed's and eval's records.
"""

from __future__ import annotations

import csv
import fcntl
import io
import json
import logging
import os
import pty
import socket
import struct
import subprocess
import sys
import termios

import pytest
import torch

from distribuuuu import api
from distribuuuu.engine import HookBase
from distribuuuu.run_folder.metrics_files import read_jsonl
from tests.conftest import ROOT, TINY, check, cli_main, distribuuuu, env, make_cfg, read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")  # the in-process runs (tests/conftest.py)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Fields of a record that do not depend on the seed's outcome but on the machine's speed.
TIMING = ("img_per_s", "time_s", "data_frac", "peak_mem_mb", "time_to_target_s")


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    """Two processes, two epochs, stdout a pipe (not a terminal)."""
    out = str(tmp_path_factory.mktemp("observe") / "run")
    proc = check(distribuuuu("train", "--cfg", TINY, "--nproc-per-node", "2", "OUT_DIR", out,
                             "TRAIN.SYNTHETIC_SAMPLES", "64", "TRAIN.PRINT_FREQ", "1"))
    return out, proc


def _cfg(out_dir, *opts: str):
    """The in-process runs here: TINY (TRAIN.TOPK 2) with 64 samples, 4 iterations an epoch, a line every 2."""
    return make_cfg("OUT_DIR", out_dir, "TRAIN.SYNTHETIC_SAMPLES", "64", "TRAIN.PRINT_FREQ", "2", *opts, base=TINY)


def _numbers(out_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(out_dir)]


@pytest.fixture
def unseeded(tmp_path):
    """A run in process with RNG_SEED None: two epochs of 4 iterations (per test: conftest's autouse
    fixture restores the logging and signal handlers a run installs only around a function's fixtures)."""
    out = tmp_path / "none"
    api.train(_cfg(out, "RNG_SEED", "None"))
    return out


# ---------------------------------------------------------------------------------------------
# TensorBoard and metrics.csv
# ---------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_tensorboard_events_hold_every_metric(run2):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = run2
    acc = EventAccumulator(os.path.join(out, "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    # TINY has TRAIN.TOPK 2: the "topk_acc" field of metrics.jsonl holds top-2, and its tag says so
    want = {f"train/{k}" for k in ("loss", "top1", "top2", "lr", "img_per_s", "data_frac", "peak_mem_mb")}
    want |= {f"val/{k}" for k in ("loss", "top1", "top2")}
    assert want <= tags and not any(t.endswith("/top5") for t in tags), sorted(tags)
    for m in read_metrics(out):
        for key in ("loss", "top1", "topk_acc") + (("lr", "img_per_s", "data_frac", "peak_mem_mb")
                                                if m["split"] == "train" else ()):
            tag = f"{m['split']}/{'top2' if key == 'topk_acc' else key}"
            events = {e.step: e.value for e in acc.Scalars(tag)}
            assert events[m["epoch"]] == pytest.approx(m[key], rel=1e-6), (m["split"], key)
    assert len(acc.Scalars("val/top1")) == 2


@pytest.mark.e2e
def test_metrics_csv_has_the_rows_of_metrics_jsonl(run2):
    out, _ = run2
    with open(os.path.join(out, "metrics.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    lines = read_metrics(out)
    assert len(rows) == len(lines) == 4
    assert any(isinstance(m.get("per_class_top1"), list) for m in lines)  # val rows carry it
    for row, m in zip(rows, lines):
        for key, value in m.items():
            if isinstance(value, list):  # per-class lists stay in metrics.jsonl: one column per row
                assert key not in row, key
            elif isinstance(value, float):
                assert float(row[key]) == pytest.approx(value, rel=1e-12), key
            else:
                assert row[key] == str(value), key


def test_tensorboard_has_step_scalars_and_names_the_real_k(unseeded):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(unseeded / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    step_tags = {f"train_step/{k}" for k in ("loss", "lr", "img_per_s", "top1", "top2")}
    assert step_tags <= tags and {"train/top2", "val/top2", "train/loss", "val/top1"} <= tags, sorted(tags)
    assert not any("top5" in t for t in tags), sorted(tags)  # TRAIN.TOPK 2
    # 4 iterations an epoch, a line every 2: global steps 2, 4, 6, 8
    assert [e.step for e in acc.Scalars("train_step/loss")] == [1, 2, 4, 6, 8]  # the first step, then every PRINT_FREQ 2
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


def test_csv_header_grows_with_a_new_key(tmp_path):
    from distribuuuu.run_folder.metrics_files import CSV_COLUMNS, MetricsWriter

    w = MetricsWriter(str(tmp_path), enabled=True, tensorboard=False)
    w.write({"epoch": 1, "split": "train", "loss": 1.5})
    w.write({"epoch": None, "split": "val", "loss": 0.5, "weights": "w.pth"})
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == CSV_COLUMNS + ["weights"]
    assert len(rows) == 3 and all(len(r) == len(rows[0]) for r in rows)
    assert rows[2][rows[0].index("weights")] == "w.pth" and rows[1][rows[0].index("weights")] == ""
    assert not (tmp_path / "tb").exists()  # tensorboard=False, and the eval line has no epoch
    assert not MetricsWriter(str(tmp_path / "other"), enabled=False).write({"epoch": 1})
    assert not (tmp_path / "other").exists()  # ranks other than 0 write nothing


def test_an_older_metrics_file_reads_with_todays_field_names(tmp_path):
    """metrics.jsonl's top-k field was named "top5" (it held top-TRAIN.TOPK): readers accept it as "topk_acc"."""
    from distribuuuu.run_folder.metrics_files import read_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"epoch": 1, "split": "val", "top1": 40.0, "top5": 70.0, "topk": 2, "n": 5}\n'
                    '{"epoch": 2, "split": "val", "top1": 50.0, "topk_acc": 80.0, "topk": 2, "n": 5}\n')
    old, new = read_jsonl(str(path))
    assert old == {"epoch": 1, "split": "val", "top1": 40.0, "topk_acc": 70.0, "topk": 2, "n": 5}
    assert new["topk_acc"] == 80.0 and "top5" not in new


# ---------------------------------------------------------------------------------------------
# eval.jsonl
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# env.json, its history of starts and the seed; model.txt
# ---------------------------------------------------------------------------------------------
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


@pytest.mark.e2e
def test_env_json_records_versions_commit_and_every_rank(run2):
    import timm
    import torchvision

    out, _ = run2
    with open(os.path.join(out, "env.json")) as f:
        rec = json.load(f)
    v = rec["versions"]
    assert (v["torch"], v["torchvision"], v["timm"]) == (torch.__version__, torchvision.__version__, timm.__version__)
    assert v["python"] == "{}.{}.{}".format(*sys.version_info[:3])
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # CI may test an exported tree without .git
        assert rec["git"]["commit"] == head.stdout.strip()
    assert rec["world_size"] == 2 and rec["backend"] == "gloo" and rec["launcher"] == "spawn"
    assert [r["rank"] for r in rec["ranks"]] == [0, 1]  # gathered from both processes
    assert len({r["pid"] for r in rec["ranks"]}) == 2
    assert rec["hosts"] == [socket.gethostname()] and rec["devices"] == ["cpu", "cpu"]
    assert "train --cfg" in rec["command"] and "--nproc-per-node 2" in rec["command"]
    assert rec["start_time"][:4].isdigit()


@pytest.mark.e2e
def test_model_txt_lists_every_parameter_with_totals_and_flops(run2):
    from distribuuuu import models

    out, _ = run2
    text = open(os.path.join(out, "model.txt")).read()
    model = models.build_model(make_cfg(base=TINY))
    for name, p in model.named_parameters():
        assert f"{p.numel():,}" in next(line for line in text.splitlines() if line.startswith(name + " "))
    total = sum(p.numel() for p in model.parameters())
    assert f"parameters: {total:,}" in text
    assert "MB" in text and "FLOPs:" in text and "per image of 3x16x16" in text


def test_flop_count_is_exact_and_leaves_the_model_unchanged():
    from distribuuuu.run_folder.records import count_flops

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                torch.nn.Flatten(), torch.nn.Dropout(0.5), torch.nn.Linear(8 * 6 * 6, 5))
    model.train()
    model[3].eval()  # a module in eval mode inside a training model keeps its own mode
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    flops = count_flops(model, (1, 3, 6, 6))
    # conv: 2 x (8 x 3 x 3 x 3) x 6 x 6 multiply-adds; linear: 2 x 288 x 5
    assert flops == 2 * 8 * 27 * 36 + 2 * 288 * 5
    assert [m.training for m in model] == [True, True, True, False, True]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BN statistics untouched
    assert torch.equal(rng, torch.get_rng_state())  # no random number drawn: the run stays reproducible


# ---------------------------------------------------------------------------------------------
# Progress: lines without a terminal, a tqdm bar on one
# ---------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_without_a_terminal_progress_is_plain_lines(run2):
    out, proc = run2
    assert "[train] epoch 1/2 iter 1/2" in proc.stdout and "[train] epoch 2/2 iter 2/2" in proc.stdout
    assert "%|" not in proc.stdout and "\r" not in proc.stdout and "it/s" not in proc.stdout
    log = open(os.path.join(out, "log.txt")).read()
    assert "[train] epoch 2/2 iter 2/2" in log and "%|" not in log


def _read_pty(cmd, cols=100):
    """Run cmd with stdout/stderr on a terminal of cols columns; return everything it wrote."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, cols, 0, 0))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=240), b"".join(chunks).decode(errors="replace")


@pytest.mark.e2e
def test_on_a_terminal_progress_is_a_bar_and_log_txt_stays_plain(tmp_path):
    out = str(tmp_path / "run")
    status, text = _read_pty([sys.executable, "-m", "distribuuuu", "train", "--cfg", TINY, "OUT_DIR", out,
                              "OPTIM.MAX_EPOCH", "1"])
    assert status == 0, text[-3000:]
    assert "epoch 1/1: 100%|" in text and "it/s" in text, text[-3000:]
    bar = [line for line in text.split("\r") if "100%|" in line][-1]
    assert "loss " in bar and "acc@1 " in bar and "img/s" in bar
    assert "[train] epoch 1/1 iter 4/8" not in text  # the bar replaces the periodic lines on screen ...
    log = open(os.path.join(out, "log.txt")).read()
    assert "[train] epoch 1/1 iter 4/8" in log and "[train] epoch 1/1 iter 8/8" in log  # ... not in the file
    assert "%|" not in log and "\r" not in log


def _progress_cfg(print_freq=2):
    return make_cfg("OPTIM.MAX_EPOCH", "3", "TRAIN.PRINT_FREQ", print_freq, "TRAIN.TOPK", "5", resolve=False)


@pytest.mark.parametrize("mode", ["bar", "lines"])
def test_progress_mode_can_be_forced(mode, monkeypatch, tmp_path):
    from distribuuuu import logger

    monkeypatch.setenv(logger.PROGRESS_ENV, mode)
    stream = io.StringIO()  # not a terminal: only the variable can ask for the bar
    monkeypatch.setattr(sys, "stdout", stream)
    logger.setup_logging(str(tmp_path), is_main=True)
    progress = logger.Progress(_progress_cfg(), True, 2, epoch=0, iters=4)
    for it in range(4):
        progress.step(it, 0.001, 8, 0.1, lambda: {"loss": 1.25, "top1": 50.0, "topk_acc": 75.0})
        if it == 1:
            logging.getLogger(logger.LOGGER_NAME).warning("a warning in mid-epoch")
    progress.close()
    logger.setup_logging(None, is_main=True)  # close log.txt
    text = stream.getvalue()
    log = (tmp_path / "log.txt").read_text()
    assert log.count("[train] epoch 1/3 iter") == 3  # iterations 1 (the run's first), 2 and 4, in log.txt in both modes
    assert "a warning in mid-epoch" in log and "a warning in mid-epoch\n" in text
    if mode == "bar":
        assert "epoch 1/3: 100%|" in text and "loss 1.2500, acc@1 50.00, acc@5 75.00" in text
        assert "[train] epoch 1/3 iter" not in text
        # printed above the bar (tqdm.write), on a line of its own
        assert any(line.startswith("[") and line.endswith("a warning in mid-epoch\n") for line in text.split("\r"))
    else:
        assert "%|" not in text and text.count("[train] epoch 1/3 iter") == 3


def test_progress_of_other_ranks_prints_nothing(monkeypatch):
    from distribuuuu import logger

    monkeypatch.setenv(logger.PROGRESS_ENV, "bar")
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stdout", stream)
    logger.setup_logging(None, is_main=False)
    progress = logger.Progress(_progress_cfg(1), False, 2, epoch=0, iters=2)
    for it in range(2):
        progress.step(it, 0.0, 8, 0.1, lambda: pytest.fail("rank 1 must not sync for metrics"))
    progress.close()
    assert stream.getvalue() == ""


# ---------------------------------------------------------------------------------------------
# distribuuuu plot
# ---------------------------------------------------------------------------------------------
def _fake_run(path, epochs, top1, topk=2):
    """A run folder with a hand-written metrics.jsonl of an older version (its top-k field was named
    "top5"; readers still accept it), and an eval line, which is not an epoch."""
    os.makedirs(path)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for e, acc in zip(epochs, top1):
            f.write(json.dumps({"epoch": e, "split": "train", "loss": 2.0 / e, "top1": acc - 5, "top5": acc,
                                "n": 10, "lr": 0.1 / e, "img_per_s": 100.0}) + "\n")
            f.write(json.dumps({"epoch": e, "split": "val", "loss": 1.0 / e, "top1": acc, "top5": acc + 1,
                                "n": 5, "topk": topk}) + "\n")
        f.write(json.dumps({"epoch": None, "split": "val", "loss": 9.0, "top1": 1.0, "top5": 2.0, "n": 5}) + "\n")


@pytest.mark.e2e
def test_plot_writes_pngs_of_the_series_in_metrics_jsonl(run2, tmp_path):
    import matplotlib.image

    from distribuuuu.tools import plot

    out, _ = run2
    other = str(tmp_path / "other")
    _fake_run(other, [1, 2, 3], [40.0, 60.0, 70.0])
    dest = str(tmp_path / "plots")
    proc = check(distribuuuu("plot", out, other, "--out", dest))
    names = ["learning_curves.png", "top1.png", "topk.png", "loss.png", "lr.png"]
    for name in names:
        path = os.path.join(dest, name)
        assert path in proc.stdout
        with open(path, "rb") as f:
            assert f.read(8) == PNG_MAGIC
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300
        assert os.path.getsize(path) < 150_000

    # What the figure draws is what metrics.jsonl holds, run by run (read back from the lines).
    drawn = plot.plot_runs([out, other], str(tmp_path / "again"))["drawn"]
    for label, folder in (("run", out), ("other", other)):
        lines = read_metrics(folder)
        for split in ("train", "val"):
            recs = [m for m in lines if m["split"] == split and m["epoch"] is not None]
            for panel, key in (("top1", "top1"), ("topk", "topk_acc"), ("loss", "loss")):
                values = [m[key] if key in m else m["top5"] for m in recs]  # "other" is an older file
                assert drawn[panel][f"{label} {split}"] == ([m["epoch"] for m in recs], values)
        train = [m for m in lines if m["split"] == "train"]
        assert drawn["lr"][f"{label} train"] == ([m["epoch"] for m in train], [m["lr"] for m in train])
    assert set(drawn["top1"]) == {"run train", "run val", "other train", "other val"}


def test_plot_bad_input_exits_2_with_one_message(tmp_path):
    missing = check(cli_main("plot", str(tmp_path / "nope")), 2)
    assert "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    no_metrics = check(cli_main("plot", str(empty)), 2)
    assert "has no metrics.jsonl" in no_metrics.stderr and "Traceback" not in no_metrics.stderr
    (empty / "metrics.jsonl").write_text("{not json\n")
    broken = check(cli_main("plot", str(empty)), 2)
    assert "line 1 is not JSON" in broken.stderr
    none = check(cli_main("plot"), 2)
    assert "RUN_DIR" in none.stderr and len(none.stderr.strip().splitlines()) == 1

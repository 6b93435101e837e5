"""`distribuuuu bench --compare`: single, dp, ddp and ddp+amp trained for real on the CPU, one table."""

import csv
import json
import math
import os

import pytest
import yaml

from distribuuuu.errors import UserError
from tests.conftest import TINY, check, cli_main, distribuuuu, make_cfg, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CORES = len(os.sched_getaffinity(0))


def _config(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "config.yaml")) as f:
        return yaml.safe_load(f)


@pytest.mark.e2e
def test_compare_runs_each_method_with_the_same_global_batch(tmp_path):
    out = str(tmp_path / "cmp")
    # 32 samples at a global batch of 16: 2 optimizer steps per epoch, 2 epochs, for every method.
    proc = check(distribuuuu("bench", "--cfg", TINY, "--compare", "single,ddp,ddp+amp,dp", "--out", out,
                             "TRAIN.SYNTHETIC_SAMPLES", "32", "TEST.SYNTHETIC_SAMPLES", "16", timeout=400))
    lines = proc.stdout.splitlines()
    header = next(ln for ln in lines if ln.startswith("compare:"))
    assert "global batch 16 (per process: 16 / processes)" in header and "epoch 2 of 2 timed" in header
    table = {ln.split()[0]: ln for ln in lines[lines.index(header) + 2:] if ln.split()[:1] and
             ln.split()[0] in ("single", "dp", "ddp", "ddp+amp")}
    assert list(table) == ["single", "dp", "ddp", "ddp+amp"]  # the canonical order, not the given one
    assert "n/a (needs >1 GPU)" in table["dp"] and table["ddp"].split()[1] == "2"
    assert not os.path.exists(os.path.join(out, "dp"))  # nothing ran for dp

    with open(os.path.join(out, "compare.csv"), newline="") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["single", "dp", "ddp", "ddp+amp"]
    dp = rows["dp"]
    assert dp["status"] == "n/a (needs >1 GPU)"
    assert all(dp[k] == "n/a" for k in ("processes", "epoch_s", "img_per_s", "speedup", "final_loss"))

    expect = {"single": (1, CORES, 16, "off"), "ddp": (2, max(1, CORES // 2), 8, "off"),
              "ddp+amp": (2, max(1, CORES // 2), 8, "bf16")}
    for method, (procs, threads, batch, amp) in expect.items():
        r = rows[method]
        run_dir = r["run_dir"]
        assert r["status"] == "ok" and int(r["global_batch"]) == 16, r
        with open(os.path.join(run_dir, "env.json")) as f:
            env = json.load(f)
        assert env["world_size"] == procs == int(r["processes"])  # really that many processes
        assert env["num_threads"] == threads == int(r["threads"])
        cfg = _config(run_dir)
        assert cfg["TRAIN"]["BATCH_SIZE"] == batch == int(r["batch_per_process"])
        assert cfg["TRAIN"]["AMP"] == amp == r["amp"] and cfg["RNG_SEED"] == 0
        train = [m for m in read_metrics(run_dir) if m["split"] == "train"]
        # the same job each way: 2 epochs of every sample once, 2 optimizer steps each
        assert [(m["epoch"], m["n"], m["step"]) for m in train] == [(1, 32, 2), (2, 32, 4)]
        # epoch 1 is warm-up: the figures are epoch 2's alone
        assert int(r["timed_epochs"]) == 1
        assert float(r["epoch_s"]) == pytest.approx(train[1]["time_s"])
        assert float(r["img_per_s"]) == pytest.approx(32 / train[1]["time_s"])
        assert float(r["final_loss"]) == pytest.approx(train[1]["loss"]) and math.isfinite(float(r["final_loss"]))
        assert f"{float(r['final_loss']):.4f}" in table[method]
    base = float(rows["single"]["img_per_s"])
    assert float(rows["single"]["speedup"]) == pytest.approx(1.0)
    for method in ("ddp", "ddp+amp"):
        assert float(rows[method]["speedup"]) == pytest.approx(float(rows[method]["img_per_s"]) / base)
    with open(os.path.join(out, "compare.png"), "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert 5_000 < os.path.getsize(os.path.join(out, "compare.png")) < 150_000


@pytest.mark.parametrize("text, wanted", [("ddp,single", ["single", "ddp"]), ("ddp+amp", ["ddp+amp"]),
                                          (" dp , ddp", ["dp", "ddp"])])
def test_methods_parse_in_canonical_order(text, wanted):
    from distribuuuu.tools.compare import parse_methods

    assert parse_methods(text) == wanted


@pytest.mark.parametrize("text", ["", "single,fsdp", "ddp,ddp", "single;ddp"])
def test_bad_method_lists_are_user_errors(text):
    from distribuuuu.tools.compare import parse_methods

    with pytest.raises(UserError, match="--compare"):
        parse_methods(text)


def test_compare_plans_split_the_global_batch_and_refuse_uneven_ones():
    from distribuuuu.tools.compare import plan_runs

    plans = {p.method: p for p in plan_runs(["single", "dp", "ddp", "ddp+amp"], 0, 4, 32, "auto", 8)}
    assert (plans["single"].processes, plans["single"].threads, plans["single"].batch) == (1, 8, 32)
    assert (plans["ddp"].processes, plans["ddp"].threads, plans["ddp"].batch) == (4, 2, 8)
    assert plans["ddp+amp"].amp == "bf16" and plans["ddp"].amp == "off"
    assert plans["dp"].skip == "n/a (needs >1 GPU)"
    assert not plan_runs(["dp"], 2, None, 32, "auto", 8)[0].skip  # two GPUs: dp runs
    with pytest.raises(UserError, match="does not split evenly over 3 DDP processes"):
        plan_runs(["ddp"], 0, 3, 32, "auto", 8)
    with pytest.raises(UserError, match="more DDP processes than the 2 GPU"):
        plan_runs(["ddp"], 2, 4, 32, "auto", 8)


def test_compare_runs_the_amp_variant_channels_last_on_a_gpu_only():
    """On CUDA the ddp+amp run is channels_last (NCHW made it look 1.20x where bench shows 2.2x);
    ddp, single and every CPU run keep the config's layout, and a user's TRAIN.CHANNELS_LAST wins."""
    from distribuuuu.tools.compare import plan_runs, run_opts

    def layout(gpus: int, method: str, *opts: str) -> bool:
        plan = {p.method: p for p in plan_runs(["single", "ddp", "ddp+amp"], gpus, 1, 32, "bf16", 8)}[method]
        return make_cfg(*run_opts(plan, list(opts), "/tmp/x", 2, 0), base=TINY).TRAIN.CHANNELS_LAST

    assert layout(1, "ddp+amp") is True
    assert layout(1, "ddp") is False and layout(1, "single") is False
    assert layout(0, "ddp+amp") is False  # the CPU: NCHW, where oneDNN's bf16 kernels are measured
    assert layout(1, "ddp+amp", "TRAIN.CHANNELS_LAST", "False") is False


def test_compare_unknown_method_exits_2_listing_the_valid_ones(tmp_path):
    out = str(tmp_path / "cmp")
    bad = check(cli_main("bench", "--cfg", TINY, "--compare", "single,ddp+fp8", "--out", out), 2)
    assert ("--compare takes a comma-separated list of methods from single, dp, ddp, ddp+amp; "
            "unknown: 'ddp+fp8'") in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert not os.path.exists(out)  # nothing started
    both = check(cli_main("bench", "--cfg", TINY, "--compare", "single", "--scaling", "1,2"), 2)
    assert "--compare and --scaling" in both.stderr

"""`distribuuuu bench`: the one-process measurements and the scaling sweep, run for real on CPU."""

import csv
import json
import os

import pytest

from distribuuuu.errors import UserError
from tests.conftest import TINY, check, cli_main, distribuuuu, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_a_slow_first_call_does_not_size_the_timed_stretch():
    """The first calls carry cuDNN's autotuning and compilation: sizing the timed stretch by them
    made ResNet-50's bench take minutes on an H100. Counted in calls, not seconds: a first call of
    0.3 s and later ones of 1 ms, 10 iterations -> about MIN_RUN_S of 1 ms calls, not 3 s of them."""
    import time

    import torch

    from distribuuuu.tools import bench

    calls = []

    def fn() -> None:
        calls.append(1)
        time.sleep(0.3 if len(calls) == 1 else 0.001)

    m = bench.time_call(fn, torch.device("cpu"), iters=10, warmup=1)
    assert m.median < 0.05
    # 3 s / 1 ms = ~3000 calls had the 0.3 s call sized it; MIN_RUN_S = 0.2 s gives ~200
    assert len(calls) < 1500, len(calls)


@pytest.mark.e2e
def test_bench_times_model_data_and_step(tmp_path):
    out = str(tmp_path / "bench")
    proc = check(distribuuuu("bench", "--cfg", TINY, "--iters", "4", "--warmup", "1", "--out", out,
                             "TRAIN.SYNTHETIC_SAMPLES", "48"))
    for row in ("model forward (train mode)", "model backward + optimizer", "model training step",
                "model forward (eval, no_grad)", "data loader alone", "full training step"):
        assert row in proc.stdout, row
    assert "waiting for data" in proc.stdout
    with open(os.path.join(out, "bench.json")) as f:
        result = json.load(f)
    m, d, s = result["model"], result["data"], result["step"]
    assert result["device"] == "cpu" and result["batch"] == 16 and result["input"] == [3, 16, 16]
    assert m["forward_ms"] > 0 and m["eval_forward_ms"] > 0 and m["train_ms"] > 0
    assert m["train_ms"] == pytest.approx(m["forward_ms"] + m["backward_step_ms"])
    assert m["train_img_per_s"] == pytest.approx(16 / (m["train_ms"] / 1e3))
    assert m["eval_img_per_s"] == pytest.approx(16 / (m["eval_forward_ms"] / 1e3))
    # 48 samples = 3 batches per epoch: 5 batches read across two epochs, the first one untimed
    assert d["batches"] == 4 and d["img_per_s"] > 0 and d["workers"] == 0
    assert s["steps"] == 4 and s["img_per_s"] > 0 and 0 < s["data_frac"] < 1
    assert s["img_per_s"] == pytest.approx(16 / (s["ms_per_step"] / 1e3))


@pytest.mark.e2e
def test_bench_scaling_runs_one_and_two_processes(tmp_path):
    out = str(tmp_path / "scaling")
    proc = check(distribuuuu("bench", "--cfg", TINY, "--scaling", "2,1", "--out", out,
                             "TRAIN.SYNTHETIC_SAMPLES", "64", "TEST.SYNTHETIC_SAMPLES", "16"))
    assert "processes" in proc.stdout and "efficiency" in proc.stdout
    with open(os.path.join(out, "scaling.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["processes"]) for r in rows] == [1, 2]  # sorted
    for r in rows:
        n = int(r["processes"])
        train = [m for m in read_metrics(os.path.join(out, f"p{n}")) if m["split"] == "train"]
        assert len(train) == 1 and train[0]["n"] == 64  # one epoch, every sample once, at each count
        assert float(r["img_per_s"]) == pytest.approx(train[0]["img_per_s"])
        assert float(r["epoch_s"]) == pytest.approx(train[0]["time_s"])
        assert float(r["img_per_s_per_process"]) == pytest.approx(train[0]["img_per_s"] / n)
        assert int(r["global_batch"]) == 16 * n
        with open(os.path.join(out, f"p{n}", "env.json")) as f:
            assert json.load(f)["world_size"] == n  # really n processes
    assert float(rows[0]["efficiency"]) == pytest.approx(1.0)
    eff = float(rows[1]["img_per_s"]) / 2 / float(rows[0]["img_per_s"])
    assert float(rows[1]["efficiency"]) == pytest.approx(eff)
    with open(os.path.join(out, "scaling.png"), "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert os.path.getsize(os.path.join(out, "scaling.png")) < 150_000


@pytest.mark.parametrize("text", ["1,x", "0,1", "1,1", "", "2;4"])
def test_bad_scaling_lists_are_user_errors(text):
    from distribuuuu.tools.scaling import parse_counts

    with pytest.raises(UserError, match="--scaling takes a comma-separated list"):
        parse_counts(text)


def test_bench_bad_input_exits_2_with_one_message(tmp_path):
    bad = check(cli_main("bench", "--cfg", TINY, "--scaling", "1,two", "--out", str(tmp_path)), 2)
    assert "--scaling takes a comma-separated list of process counts such as 1,2,4, got '1,two'" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    iters = check(cli_main("bench", "--cfg", TINY, "--iters", "0"), 2)
    assert "--iters must be at least 1" in iters.stderr
    key = check(cli_main("bench", "--cfg", TINY, "--scaling", "1,2", "MODEL.ARHC", "x"), 2)
    assert "MODEL.ARHC" in key.stderr and "MODEL.ARCH" in key.stderr  # before any process starts
    assert not os.path.exists(os.path.join(tmp_path, "p1"))

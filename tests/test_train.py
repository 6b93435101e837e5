"""Training and evaluation: DDP replicas that agree, exact evaluation over any number of processes, top-k
counting, weights with a module. prefix, and a resume that continues where the run stopped. Real
processes (gloo on CPU), but for the counting and the RNG state, in process."""

import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from distribuuuu.engine import rng
from distribuuuu.engine.evaluation import Counter, topk_hits
from distribuuuu.run_folder.metrics_files import read_jsonl
from tests.conftest import ROOT, TINY, check, distribuuuu, env, read_metrics, torchrun


def _weights(path):
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.e2e
def test_two_process_ddp_run_ends_with_identical_weights(tmp_path):
    out = str(tmp_path / "run")
    proc = check(torchrun(2, "tests/scripts/train_and_dump.py", "--cfg", TINY, "OUT_DIR", out))
    assert "rank 1/2" in proc.stdout  # every process logs its own placement line
    w0, w1 = _weights(f"{out}/rank0.pt"), _weights(f"{out}/rank1.pt")
    assert w0.keys() == w1.keys()
    for key in w0:
        assert torch.equal(w0[key], w1[key]), key
    # The run folder holds what the contract promises.
    for name in ("config.yaml", "config_diff.yaml", "log.txt", "metrics.jsonl",
                 "checkpoints/last.pth", "checkpoints/best.pth", "checkpoints/epoch_0002.pth"):
        assert os.path.isfile(os.path.join(out, name)), name
    lines = read_metrics(out)
    train = [m for m in lines if m["split"] == "train"]
    val = [m for m in lines if m["split"] == "val"]
    assert [m["epoch"] for m in train] == [1, 2] and [m["epoch"] for m in val] == [1, 2]
    for m in train:
        assert {"epoch", "split", "loss", "top1", "topk_acc", "n", "lr", "img_per_s"} <= m.keys()
        assert m["n"] == 128  # 2 ranks x 4 batches of 16: every training sample once
    for m in val:
        assert {"epoch", "split", "loss", "top1", "topk_acc", "n"} <= m.keys()
        assert m["n"] == 50
    # The checkpoint holds plain weights that load into the bare model, and its bookkeeping.
    ckpt = _weights(f"{out}/checkpoints/last.pth")
    assert not any(k.startswith("module.") for k in ckpt["model"])
    assert (ckpt["epoch"], ckpt["global_step"]) == (2, 8)
    for key in w0:
        assert torch.equal(ckpt["model"][key], w0[key]), key
    assert "done: best val balanced top-1" in open(f"{out}/log.txt").read()


def _eval(out_dir, weights, nproc):
    args = ["eval", "--cfg", TINY, "OUT_DIR", out_dir, "MODEL.WEIGHTS", weights,
            "TEST.SYNTHETIC_SAMPLES", "50", "TEST.BATCH_SIZE", "32"]
    if nproc > 1:
        args[1:1] = ["--nproc-per-node", str(nproc)]
    check(distribuuuu(*args))
    return read_jsonl(os.path.join(out_dir, "eval.jsonl"))[-1]  # eval writes eval.jsonl, not metrics.jsonl


@pytest.fixture(scope="module")
def barely_trained(tmp_path_factory) -> tuple[str, dict]:
    """(last.pth, its eval record in one process) of one epoch on 32 samples at a low LR: a model whose
    counts are neither 0 nor everything."""
    root = tmp_path_factory.mktemp("barely")
    check(distribuuuu("train", "--cfg", TINY, "OUT_DIR", str(root / "run"), "OPTIM.MAX_EPOCH", "1",
                      "TRAIN.SYNTHETIC_SAMPLES", "32", "OPTIM.BASE_LR", "0.01"))
    weights = str(root / "run" / "checkpoints" / "last.pth")
    return weights, _eval(str(root / "eval1"), weights, 1)


@pytest.mark.e2e
def test_exact_eval_is_the_same_for_one_and_three_processes(barely_trained, tmp_path):
    weights, one = barely_trained
    # 50 samples: not a multiple of 3, and fewer than the global batch of 3 x 32.
    three = _eval(str(tmp_path / "eval3"), weights, 3)
    assert one["n"] == three["n"] == 50
    assert 0 < one["top1"] < one["topk_acc"] < 100, one
    assert (one["top1"], one["topk_acc"]) == (three["top1"], three["topk_acc"])
    assert one["loss"] == pytest.approx(three["loss"], rel=1e-6)  # float sums in another order


@pytest.mark.e2e
def test_module_prefixed_state_dict_loads_with_model_weights(barely_trained, tmp_path):
    weights, plain = barely_trained
    prefixed = str(tmp_path / "ddp_style.pth")
    torch.save({"state_dict": {"module." + k: v for k, v in _weights(weights)["model"].items()}}, prefixed)
    from_prefixed = _eval(str(tmp_path / "eval"), prefixed, 1)
    assert (plain["top1"], plain["topk_acc"], plain["n"]) == (from_prefixed["top1"], from_prefixed["topk_acc"], from_prefixed["n"])


@pytest.mark.e2e
def test_interrupted_run_resumes_at_the_next_epoch(tmp_path):
    out = str(tmp_path / "run")
    args = [sys.executable, "-m", "distribuuuu", "train", "--cfg", TINY, "OUT_DIR", out,
            "OPTIM.MAX_EPOCH", "3", "TRAIN.SYNTHETIC_SAMPLES", "512"]
    straight_out = str(tmp_path / "straight")
    check(subprocess.run(args[:-6] + ["OUT_DIR", straight_out] + args[-4:], cwd=ROOT, env=env(),
                         capture_output=True, text=True, timeout=240))
    # Start the same run, and kill it hard once the first checkpoint exists.
    proc = subprocess.Popen(args, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = os.path.join(out, "checkpoints", "epoch_0001.pth")
    deadline = time.time() + 120
    while not os.path.exists(first) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    done = _weights(os.path.join(out, "checkpoints", "last.pth"))["epoch"]
    assert 1 <= done < 3, f"the kill came too late to test anything (epoch {done})"

    resumed = check(subprocess.run(args, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240))
    assert f"resumed from {out}/checkpoints/last.pth: {done} epochs done" in resumed.stdout
    epochs = [m["epoch"] for m in read_metrics(out) if m["split"] == "train"]
    assert epochs[-(3 - done):] == list(range(done + 1, 4))  # continued at the next epoch
    final = _weights(os.path.join(out, "checkpoints", "last.pth"))
    assert final["epoch"] == 3
    # One process, no augmentation, RNG state restored: the resumed run is the straight run.
    straight = _weights(os.path.join(straight_out, "checkpoints", "last.pth"))
    for key, value in straight["model"].items():
        torch.testing.assert_close(final["model"][key], value, rtol=0, atol=0, msg=key)


@pytest.mark.e2e
def test_config_command_prints_the_merged_config():
    proc = check(distribuuuu("config", "--cfg", TINY, "TRAIN.BATCH_SIZE", "3"))
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["TRAIN"]["BATCH_SIZE"] == 3 and cfg["MODEL"]["ARCH"] == "resnet_tiny"


# ---------------------------------------------------------------------------------------------
# In process: top-k counting and the RNG state a resume restores
# ---------------------------------------------------------------------------------------------
def test_topk_hits_counts_and_clips_k_to_the_number_of_classes():
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.7, 0.2, 0.1], [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])
    target = torch.tensor([1, 1, 0, 2])
    hits = topk_hits(logits, target, 2)
    assert (hits[:, 0].sum().item(), hits.any(1).sum().item()) == (1, 2)
    assert topk_hits(logits, target, 5).any(1).sum().item() == 4  # k=5 > 3 classes: everything


def test_counter_means_and_percentages():
    c = Counter(torch.device("cpu"), topk=2)
    c.update(torch.tensor([[2.0, 1.0, 0.0]]), torch.tensor([0]), torch.tensor(1.0))
    c.update(torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0]]), torch.tensor([1, 0]), torch.tensor(4.0))
    r = c.reduce().result()  # no process group: reduce is the identity
    assert r["n"] == 3
    assert r["loss"] == pytest.approx((1.0 + 2 * 4.0) / 3)
    assert r["top1"] == pytest.approx(100 / 3) and r["topk_acc"] == pytest.approx(200 / 3)
    assert math.isnan(Counter(torch.device("cpu"), 2).result()["top1"])


def test_rng_state_round_trip():
    state = rng.rng_state()
    a = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    rng.set_rng_state(state)
    b = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]

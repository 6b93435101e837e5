"""Imbalanced classes (TRAIN.CLASS_BALANCE, data/loading/balance.py): the setup line that says the class sizes
spread; the balanced sampler (every class drawn equally often, a disjoint share of one seeded draw per
rank, deterministic, resumed step-exactly across a real SIGTERM on 2 processes); the class-weighted loss
with mixup and label smoothing; evaluation unweighted; the refusals (a bad value, a shard set)."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from distribuuuu import data, engine, models
from distribuuuu.data.loading import balance
from distribuuuu.data.loading.items import TensorImageDataset
from distribuuuu.data.loading.samplers import ResumableDistributedSampler
from distribuuuu.errors import UserError
from distribuuuu.launch import comm
from tests.conftest import (
    TINY,
    check,
    check_user_error,
    cli_main,
    logged,
    make_cfg,
    read_metrics,
    read_text_or_empty,
    run,
    start_until,
    stop_and_wait,
    write_image_tree,
)

CPU = torch.device("cpu")
SIZES = [200, 40, 10, 150]  # a 20x spread


def _labelled(sizes: list[int]) -> TensorImageDataset:
    """Blank 2x2 images with these class sizes: what the sampler reads is the labels."""
    targets = torch.cat([torch.full((n,), c) for c, n in enumerate(sizes)])
    return TensorImageDataset(torch.zeros(len(targets), 1, 2, 2, dtype=torch.uint8), targets,
                              [f"class{c}" for c in range(len(sizes))])


def _own(folder, classes: int) -> dict:
    """A folder of class folders as one's own images (a tenth held out as the val set), 8 px, batch 4."""
    return {"TRAIN.DATASET": str(folder), "TEST.DATASET": "", "MODEL.NUM_CLASSES": classes, "TRAIN.IM_SIZE": 8,
            "TEST.IM_SIZE": 8, "TRAIN.BATCH_SIZE": 4}


def _balanced(dataset, num_replicas: int, rank: int, seed: int) -> ResumableDistributedSampler:
    """The training sampler that TRAIN.CLASS_BALANCE sampler builds (lpipeline.Pipeline.sampler)."""
    return ResumableDistributedSampler(dataset, num_replicas, rank, seed=seed, draw=balance.BalancedDraw(dataset))


def _drawn(sampler: ResumableDistributedSampler, epoch: int, start: int = 0) -> list[int]:
    sampler.set_epoch(epoch, start)
    return list(sampler)


# ---------------------------------------------------------------------------------------------
# The sampler, in process
# ---------------------------------------------------------------------------------------------
def test_the_balanced_sampler_draws_every_class_equally_often():
    """Over 10 epochs of 400 draws each class is drawn ~1,000 times (Binomial(4000, 1/4): sd 27.4; the
    tolerance is 4 sd, exceeded with probability ~6e-5 per class), and within a class every sample
    about equally often (a sample of the 10-image class: Binomial(~1000, 1/10), sd ~9.5, 4 sd). The plain
    shuffle would draw the classes 2000 / 400 / 100 / 1500 times."""
    dataset = _labelled(SIZES)
    labels = dataset.targets.numpy()
    sampler = _balanced(dataset, num_replicas=1, rank=0, seed=7)
    drawn = np.concatenate([_drawn(sampler, epoch) for epoch in range(10)])
    assert len(drawn) == 10 * len(dataset)  # as many samples an epoch as the plain shuffle
    per_class = np.bincount(labels[drawn], minlength=4)
    total, k = len(drawn), len(SIZES)
    sd = math.sqrt(total * (1 / k) * (1 - 1 / k))
    assert np.all(np.abs(per_class - total / k) < 4 * sd), per_class
    smallest = np.flatnonzero(labels == 2)  # the 10-image class
    per_sample = np.bincount(drawn, minlength=len(dataset))[smallest]
    n = per_class[2]
    assert np.all(np.abs(per_sample - n / 10) < 4 * math.sqrt(n * 0.1 * 0.9)), per_sample


def test_ranks_take_disjoint_shares_of_one_seeded_draw_and_a_resume_skips_its_prefix():
    """Rank r of 2 takes the positions r, r+2, ... of the one draw that (seed, epoch) makes on every rank
    (the one-process order): disjoint shares that cover it, the tail of fewer than 2 dropped; the same
    again for the same (seed, epoch), another draw for another epoch or seed; set_epoch(e, s) goes on
    with position s, as the checkpoint's samples_in_epoch says."""
    dataset = _labelled([7, 3, 1])  # 11 samples: one position left over on 2 ranks
    whole = _drawn(_balanced(dataset, 1, 0, seed=5), 3)
    ranks = [_balanced(dataset, 2, r, seed=5) for r in range(2)]
    shares = [_drawn(s, 3) for s in ranks]
    assert shares[0] == whole[0:10:2] and shares[1] == whole[1:10:2]
    assert [len(s) for s in ranks] == [5, 5]
    assert shares == [_drawn(_balanced(dataset, 2, r, seed=5), 3) for r in range(2)]  # deterministic
    assert _drawn(ranks[0], 4) != shares[0] and _drawn(_balanced(dataset, 2, 0, seed=6), 3) != shares[0]
    assert [_drawn(s, 3, start=4) for s in ranks] == [whole[4:10:2], whole[5:10:2]]
    assert [len(s) for s in ranks] == [3, 3]


def test_the_train_loader_of_a_held_out_folder_uses_it_and_evaluation_does_not(tmp_path):
    """TRAIN.CLASS_BALANCE sampler reaches every pipeline's training sampler (here an image folder's
    TRAIN.VAL_SPLIT part, whose labels are its rows'); the val loader stays exact and unbalanced."""
    write_image_tree(str(tmp_path / "imgs"), "", {"a": 30, "b": 6, "c": 4}, size=(8, 8))
    cfg = make_cfg(_own(tmp_path / "imgs", 3), {"TRAIN.CLASS_BALANCE": "sampler"}, base=TINY)
    train = data.build_train_loader(cfg, 0, 1, CPU)
    assert isinstance(train.sampler.draw, balance.BalancedDraw)
    labels = np.asarray(train.dataset.targets)
    assert len(labels) == len(train.dataset) == 34  # 40 less 5 + 1 + 0 held out (a tenth, at least min(5, a fifth))
    drawn = np.concatenate([labels[_drawn(train.sampler, e)] for e in range(20)])
    assert np.all(np.bincount(drawn) > 0.25 * len(drawn))  # each ~1/3; plain: 27 / 5 / 4 of 36
    val = data.build_val_loader(cfg, 0, 1, CPU)
    assert list(val.sampler) == list(range(len(val.dataset)))


# ---------------------------------------------------------------------------------------------
# The loss, in process
# ---------------------------------------------------------------------------------------------
def test_loss_weights_are_inverse_to_the_class_sizes_with_mean_one_over_the_samples():
    dataset = _labelled([*SIZES, 0])  # a class without training samples keeps weight 1
    weights = balance.loss_weights(dataset, num_classes=5)
    counts = torch.tensor([*SIZES, 0], dtype=torch.float32)
    assert torch.allclose(weights[:4] * counts[:4], torch.full((4,), sum(SIZES) / 4))
    assert weights[4] == 1
    assert math.isclose(float((weights * counts).sum() / counts.sum()), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize("mixup", [False, True], ids=["label-smoothing", "mixup"])
def test_a_loss_balanced_run_weighs_its_training_loss_and_not_the_val_loss(tmp_path, mixup):
    """A run with TRAIN.CLASS_BALANCE loss: the Stepper's criterion holds the training set's weights (with
    label smoothing, or under mixup, whose soft targets torch's cross-entropy weighs too) and trains;
    evaluation's loss is the plain mean cross-entropy of the val images (the real distribution)."""
    write_image_tree(str(tmp_path / "imgs"), "", {"a": 24, "b": 8, "c": 4}, size=(8, 8))
    opts = {**_own(tmp_path / "imgs", 3), "OPTIM.MAX_EPOCH": 1, "TRAIN.LABEL_SMOOTHING": 0.1}
    if mixup:
        opts.update({"TRAIN.MIXUP_ALPHA": 0.2})
    rows = {}
    for mode in ("none", "loss"):
        cfg = make_cfg(opts, {"TRAIN.CLASS_BALANCE": mode, "OUT_DIR": str(tmp_path / mode)}, base=TINY)
        with comm.session(cfg) as ctx:
            trainer = engine.Trainer(cfg, ctx)
            summary = trainer.fit()
        weight = trainer.stepper.criterion.weight if mode == "loss" else None
        if mode == "loss":  # kept after the split: 22 / 7 / 3 (a fraction 0.1 of each class held out, rounded)
            counts = np.bincount(np.asarray(trainer.train_loader.dataset.targets), minlength=3)
            assert torch.allclose(weight, torch.tensor(counts.sum() / (3 * counts), dtype=torch.float32))
            assert isinstance(trainer.stepper.criterion, torch.nn.CrossEntropyLoss)
            net, total, n = models.unwrap(trainer.model).eval(), 0.0, 0
            with torch.no_grad():
                for images, target in trainer.val_loader:
                    total, n = total + F.cross_entropy(net(images), target, reduction="sum").item(), n + len(target)
            val = [r for r in read_metrics(str(tmp_path / mode)) if r["split"] == "val"][-1]
            assert n == val["n"] and math.isclose(val["loss"], total / n, rel_tol=1e-5), (val["loss"], total / n)
        assert summary["epochs"] == 1
        rows[mode] = read_metrics(str(tmp_path / mode))
    train = {mode: [r for r in rows[mode] if r["split"] == "train"][0] for mode in rows}
    assert math.isfinite(train["loss"]["loss"]) and train["loss"]["loss"] != train["none"]["loss"]


def test_the_weighted_soft_target_loss_is_the_weighted_sum_over_classes():
    """Under mixup the targets are soft: the loss of a sample is sum over c of -w[c] t[c] log p[c], averaged
    over the batch (torch's cross-entropy with probabilities), so a weight of 1 everywhere is timm's."""
    from distribuuuu.optim import _mixup_and_criterion

    cfg = make_cfg({"TRAIN.MIXUP_ALPHA": 0.2, "MODEL.NUM_CLASSES": 4}, base=TINY)
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    target = torch.softmax(torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), 1)
    weight = torch.tensor([0.5, 2.0, 1.0, 4.0])
    _, criterion = _mixup_and_criterion(cfg, weight)
    expected = (-(weight * target * torch.log_softmax(logits, 1)).sum(1)).mean()
    assert torch.allclose(criterion(logits, target), expected)
    _, plain = _mixup_and_criterion(cfg)
    _, ones = _mixup_and_criterion(cfg, torch.ones(4))
    assert torch.allclose(plain(logits, target), ones(logits, target))


# ---------------------------------------------------------------------------------------------
# The setup line and the refusals
# ---------------------------------------------------------------------------------------------
def test_the_spread_line_names_the_sizes_and_the_way_out():
    counts = np.array(SIZES)
    line = balance.spread_line("none", counts, ["cat", "dog", "eel", "fox"])
    assert line.startswith("the training classes' sizes spread 20.0x: class eel has 10 samples, class cat 200;")
    assert "TRAIN.CLASS_BALANCE sampler" in line and "or loss" in line
    assert balance.spread_line("sampler", counts, ["cat", "dog", "eel", "fox"]).endswith(
        "evened out by TRAIN.CLASS_BALANCE sampler")


def test_changing_it_on_resume_changes_the_recipe_and_needs_resume_allow():
    """Sampler or weights change what the rest of the run trains on, as a recipe key: refused unless named
    in TRAIN.RESUME_ALLOW; a checkpoint from before the key counts as 'none'."""
    from distribuuuu.run_folder import resume_check

    old = make_cfg(base=TINY)
    with pytest.raises(UserError, match=r"TRAIN.CLASS_BALANCE: 'none' -> 'sampler'   \(changes the recipe mid-run"):
        resume_check.compare_configs(old.dump(), make_cfg({"TRAIN.CLASS_BALANCE": "sampler"}, base=TINY), "last.pth")
    allowed = make_cfg({"TRAIN.CLASS_BALANCE": "loss", "TRAIN.RESUME_ALLOW": ["TRAIN.CLASS_BALANCE"]}, base=TINY)
    assert ("TRAIN.CLASS_BALANCE", "none", "loss") in resume_check.compare_configs(old.dump(), allowed, "last.pth")
    before = old.dump().replace("  CLASS_BALANCE: none\n", "")
    assert "CLASS_BALANCE" not in before and resume_check.compare_configs(before, old, "last.pth") == []


def test_a_bad_value_is_refused_naming_the_values(tmp_path):
    check_user_error(cli_main("train", "--cfg", TINY, "OUT_DIR", str(tmp_path / "run"), "TRAIN.CLASS_BALANCE",
                              "oversample"), "TRAIN.CLASS_BALANCE must be one of none, sampler, loss", "'oversample'")


@pytest.mark.parametrize("mode", ["sampler", "loss"])
def test_a_shard_set_is_refused_naming_what_works(tmp_path, mode):
    write_image_tree(str(tmp_path / "imgs"), "train", {"a": 6, "b": 2}, size=(8, 8))
    write_image_tree(str(tmp_path / "imgs"), "val", {"a": 2, "b": 2}, size=(8, 8))
    check(cli_main("data", "shard", str(tmp_path / "imgs"), str(tmp_path / "shards")))
    check_user_error(cli_main("train", "--cfg", TINY, "OUT_DIR", str(tmp_path / "run"),
                              "TRAIN.DATASET", str(tmp_path / "shards"), "TEST.DATASET", str(tmp_path / "shards"),
                              "MODEL.NUM_CLASSES", "2", "TRAIN.BATCH_SIZE", "2", "TRAIN.CLASS_BALANCE", mode),
                     f"TRAIN.CLASS_BALANCE {mode}", "index.json does not hold", "the image folder")


# ---------------------------------------------------------------------------------------------
# Done when: 2 processes, a real SIGTERM mid-epoch, the same command again = the straight run
# ---------------------------------------------------------------------------------------------
MEASURED = ("img_per_s", "time_s", "data_frac", "peak_mem_mb")  # how fast and how big, not what was learnt


def _numbers(out) -> list[dict]:
    """metrics.jsonl's rows without their measurements of the machine."""
    return [{k: v for k, v in row.items() if k not in MEASURED} for row in read_metrics(str(out))]


@pytest.mark.e2e
def test_a_balanced_run_stopped_by_sigterm_mid_epoch_resumes_to_the_straight_runs_metrics(tmp_path):
    write_image_tree(str(tmp_path / "imgs"), "", {"a": 240, "b": 40, "c": 20}, size=(8, 8))
    train = [sys.executable, "-m", "distribuuuu", "train", "--nproc-per-node", "2", "--cfg", TINY,
             *[str(w) for pair in _own(tmp_path / "imgs", 3).items() for w in pair], "TRAIN.CLASS_BALANCE", "sampler",
             "TRAIN.PRINT_FREQ", "2",
             "TRAIN.CKPT_PERIOD_STEPS", "4", "OPTIM.MAX_EPOCH", "2"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    check(run([*train, "OUT_DIR", str(straight)], timeout=300))
    log = read_text_or_empty(straight / "log.txt")
    # held out: a tenth of a (24), at least 5 of b (40 -> 35 train), a fifth of c (20 -> 16 train)
    assert "setup: the training classes' sizes spread 13.5x: class c has 16 samples, class a 216; evened out by " \
           "TRAIN.CLASS_BALANCE sampler" in log, log[-3000:]

    # SIGTERM once a step checkpoint is due: the ranks write one where they are and exit 143
    stop_and_wait(*start_until([*train, "OUT_DIR", str(stopped)], stopped, logged("[train] epoch 1/2 iter")))
    ckpt = torch.load(stopped / "checkpoints" / "last.pth", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == 0 and 0 < ckpt["samples_in_epoch"] < 270, ckpt["samples_in_epoch"]

    check(run([*train, "OUT_DIR", str(stopped)], timeout=300))
    assert f"{ckpt['samples_in_epoch']} samples into epoch 1" in read_text_or_empty(stopped / "log.txt")
    assert _numbers(stopped) == _numbers(straight)
    rows = [(r["epoch"], r["split"]) for r in _numbers(straight)]
    assert rows == [(1, "train"), (1, "val"), (2, "train"), (2, "val")]

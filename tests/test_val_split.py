"""TRAIN.VAL_SPLIT: a stratified, fixed validation split carved from the training data, for every source."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from distribuuuu import data
from distribuuuu.data import holdout, transforms
from distribuuuu.data.holdout import SplitPart
from distribuuuu.data.loading import batches
from distribuuuu.data.sources import builtin
from distribuuuu.errors import UserError
from distribuuuu.run_folder.metrics_files import read_jsonl
from tests.conftest import (
    TINY,
    check,
    cli_main,
    distribuuuu,
    make_cfg,
    read_metrics,
    write_fake_cifar10,
    write_image_tree,
)

torch.set_num_threads(1)
CPU = torch.device("cpu")
MNIST = {"TRAIN.DATASET": "mnist5k", "TEST.DATASET": "mnist5k", "MODEL.NUM_CLASSES": 10,
         "MODEL.IN_CHANS": 1, "TRAIN.IM_SIZE": 28, "TRAIN.WORKERS": 0, "TRAIN.BATCH_SIZE": 64,
         "TEST.BATCH_SIZE": 100}
SYN = {"TRAIN.DATASET": "synthetic", "TEST.DATASET": "synthetic", "MODEL.NUM_CLASSES": 4, "TRAIN.TOPK": 2,
       "TRAIN.IM_SIZE": 8, "TRAIN.SYNTHETIC_SAMPLES": 70, "TEST.SYNTHETIC_SAMPLES": 12, "TRAIN.WORKERS": 0,
       "TRAIN.BATCH_SIZE": 8, "TEST.BATCH_SIZE": 8}


def _per_class(labels: np.ndarray, idx: np.ndarray) -> dict[int, int]:
    classes, counts = np.unique(labels[idx], return_counts=True)
    return dict(zip(classes.tolist(), counts.tolist()))


# ---------------------------------------------------------------------------------------------
# The split itself
# ---------------------------------------------------------------------------------------------
def test_holdout_is_stratified_disjoint_covering_and_fixed():
    labels = np.random.default_rng(5).permutation(np.repeat([0, 1, 2, 3], [50, 31, 9, 2]))
    sizes = {0: 50, 1: 31, 2: 9, 3: 2}
    for val_split, fraction in ((0.2, 0.2), (23, 23 / 92)):  # a fraction, or a count made a fraction
        kept, held = holdout.holdout_indices(labels, val_split)
        assert np.intersect1d(kept, held).size == 0
        assert np.array_equal(np.sort(np.concatenate([kept, held])), np.arange(len(labels)))
        want = {c: round(fraction * n) for c, n in sizes.items()}
        assert _per_class(labels, held) == {c: n for c, n in want.items() if n}
        assert _per_class(labels, kept) == {c: sizes[c] - want[c] for c in sizes}
        again = holdout.holdout_indices(labels, val_split)
        assert np.array_equal(again[0], kept) and np.array_equal(again[1], held)
    assert holdout.holdout_fraction(500, 4000) == 0.125
    # A fraction keeps at least MIN_HELD (5) of a class of 25 or more, a fifth of a smaller one:
    # round(0.05 x 50) = 2 -> 5, round(0.05 x 31) = 2 -> 5, 0 -> 9 // 5 = 1, 0 -> 2 // 5 = 0
    held = holdout.holdout_indices(labels, 0.05)[1]
    assert _per_class(labels, held) == {0: 5, 1: 5, 2: 1}
    assert _per_class(labels, holdout.holdout_indices(labels, 5)[1]) == {0: 3, 1: 2}  # a count: none


def test_holdout_errors_name_the_sizes():
    labels = np.repeat([0, 1], [10, 1])
    with pytest.raises(UserError, match=r"VAL_SPLIT 11 .*whole training set of 11"):
        holdout.holdout_indices(labels, 11)
    with pytest.raises(UserError, match=r"no training sample in class '1' \(1 samples\)"):
        holdout.holdout_indices(labels, 0.6)  # round(0.6 x 1) = 1: class 1 would be all validation
    with pytest.raises(UserError, match="holds out no sample"):
        holdout.holdout_indices(np.repeat([0, 1], [4, 1]), 0.01)  # 4 // 5 = 0: no floor either


# ---------------------------------------------------------------------------------------------
# The loaders, for every source and pipeline
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    write_image_tree(str(root / "folder"), "train", {"a": 9, "b": 5, "c": 6}, size=(14, 12))
    write_image_tree(str(root / "folder"), "val", {"a": 2, "b": 2}, size=(14, 12))
    write_fake_cifar10(str(root / "cifar"), per_batch=8, test_size=6)
    return root


def _case(name: str, root) -> dict:
    folder = {"TRAIN.DATASET": str(root / "folder"), "TEST.DATASET": str(root / "folder"), "MODEL.NUM_CLASSES": 3,
              "TRAIN.TOPK": 1, "TRAIN.IM_SIZE": 8, "TEST.IM_SIZE": 10, "TRAIN.WORKERS": 0, "TRAIN.BATCH_SIZE": 4,
              "TEST.BATCH_SIZE": 3}
    cifar = {"TRAIN.DATASET": str(root / "cifar"), "TEST.DATASET": str(root / "cifar"), "MODEL.NUM_CLASSES": 10,
             "TRAIN.IM_SIZE": 32, "TRAIN.WORKERS": 0, "TRAIN.BATCH_SIZE": 4, "TEST.BATCH_SIZE": 5}
    return {"mnist5k memory": {**MNIST, "TRAIN.VAL_SPLIT": 0.1},
            "mnist5k loader": {**MNIST, "TRAIN.VAL_SPLIT": 500, "TRAIN.DATA_PIPELINE": "loader"},
            "cifar memory": {**cifar, "TRAIN.VAL_SPLIT": 0.25},
            "cifar loader": {**cifar, "TRAIN.VAL_SPLIT": 10, "TRAIN.DATA_PIPELINE": "loader"},
            "synthetic loader": {**SYN, "TRAIN.VAL_SPLIT": 0.3},
            "synthetic memory": {**SYN, "TRAIN.VAL_SPLIT": 0.3, "TRAIN.DATA_PIPELINE": "memory"},
            "folder fast": {**folder, "TRAIN.VAL_SPLIT": 0.34},
            "folder pil": {**folder, "TRAIN.VAL_SPLIT": 0.34, "TRAIN.IMAGE_DECODE": "pil"}}[name]


CASES = ["mnist5k memory", "mnist5k loader", "cifar memory", "cifar loader", "synthetic loader",
         "synthetic memory", "folder fast", "folder pil"]


@pytest.mark.parametrize("name", CASES)
def test_train_and_val_loaders_hold_the_two_parts(name, trees):
    cfg = make_cfg({**_case(name, trees), "RNG_SEED": 1})
    full = data.build_dataset(cfg, train=True)
    labels = np.asarray(full.targets)
    kept, held = holdout.holdout_indices(labels, cfg.TRAIN.VAL_SPLIT)
    train = data.build_train_loader(cfg, 0, 1, CPU)
    assert isinstance(train.dataset, SplitPart) and train.dataset.classes == full.classes
    assert train.dataset.indices == kept.tolist() and len(train.dataset) == len(kept)
    # The training order, seen through the dataset's indices, never reaches a held-out image ...
    train.sampler.set_epoch(0)
    order = list(train.sampler)
    assert sorted(train.dataset.indices[i] for i in order) == sorted(kept.tolist())
    # ... and the batches carry the labels of those images
    _, y = next(iter(train))
    batch = len(y)
    assert y.tolist() == labels[[train.dataset.indices[i] for i in order[:batch]]].tolist()
    # Validation: the held-out images with the eval transforms, each once over 2 ranks
    got_y = []
    for rank in range(2):
        val = data.build_val_loader(cfg, rank, 2, CPU)
        assert val.dataset.indices == held.tolist()
        got_y += [y for _, ys in val for y in ys.tolist()]
    assert sorted(got_y) == sorted(labels[held].tolist())
    test = data.build_test_loader(cfg, 0, 1, CPU)
    assert not isinstance(test.dataset, SplitPart)
    assert len(test.dataset) == len(data.build_dataset(cfg, train=False))
    # Another RNG_SEED (another run): the same split
    other = data.build_train_loader(make_cfg({**_case(name, trees), "RNG_SEED": 7}), 0, 1, CPU)
    assert other.dataset.indices == train.dataset.indices


def test_mnist5k_validation_images_are_the_held_out_digits_unaugmented():
    augmented = {**MNIST, "TRAIN.VAL_SPLIT": 0.1, "TRAIN.AUTO_AUGMENT": "randaugment", "TRAIN.RANDOM_ERASE": 1.0}
    digits, labels = builtin.load_mnist5k("train", "TRAIN")
    _, held = holdout.holdout_indices(labels.numpy(), 0.1)
    assert len(held) == 400 and _per_class(labels.numpy(), held) == {c: 40 for c in range(10)}
    want = batches.BatchNormalize(transforms.MNIST_STATS)(digits[held])
    for pipeline in ("memory", "loader"):
        val = data.build_val_loader(make_cfg({**augmented, "TRAIN.DATA_PIPELINE": pipeline}), 0, 1, CPU)
        assert len(val.dataset) == 400
        x = torch.cat([x for x, _ in val])
        assert x.shape == want.shape and torch.allclose(x, want, atol=1e-5)  # no crop, policy or erasing


def test_without_val_split_the_val_loader_is_the_test_data():
    cfg = make_cfg(SYN)
    val, test = data.build_val_loader(cfg, 0, 1, CPU), data.build_test_loader(cfg, 0, 1, CPU)
    assert len(val.dataset) == len(test.dataset) == 12 and not isinstance(val.dataset, SplitPart)
    assert len(data.build_train_loader(cfg, 0, 1, CPU).dataset) == 70
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(val, test))


# ---------------------------------------------------------------------------------------------
# The preflight check and the command line
# ---------------------------------------------------------------------------------------------
def test_check_names_the_sizes_for_bad_counts(trees):
    folder = _case("folder fast", trees)
    with pytest.raises(UserError, match="whole training set of 20 samples"):
        data.check_datasets(make_cfg({**folder, "TRAIN.VAL_SPLIT": 20}), 1)
    # 19 of 20 is 0.95 of each class: round(0.95 x 5) = 5 of b's 5 images
    with pytest.raises(UserError, match=r"no training sample in class 'a' \(9 samples\), 'b' \(5 samples\)"):
        data.check_datasets(make_cfg({**folder, "TRAIN.VAL_SPLIT": 19}), 1)
    # 70 synthetic samples (18, 18, 17, 17 per class): 0.9 holds out 16 + 16 + 15 + 15
    with pytest.raises(UserError, match="8 training samples left after TRAIN.VAL_SPLIT holds out 62"):
        data.check_datasets(make_cfg({**SYN, "TRAIN.VAL_SPLIT": 0.9}), 9)
    data.check_datasets(make_cfg({**SYN, "TRAIN.VAL_SPLIT": 0.9, "TRAIN.BATCH_SIZE": 1}), 8)  # batch 8: no step
    data.check_datasets(make_cfg({**folder, "TRAIN.VAL_SPLIT": 0.5}), 1)


def test_bad_val_split_exits_2_through_the_cli():
    proc = check(cli_main("train", "--cfg", TINY, "TRAIN.VAL_SPLIT", "128"), status=2)
    assert "TRAIN.VAL_SPLIT 128" in proc.stderr and "128 samples" in proc.stderr and "Traceback" not in proc.stderr
    proc = check(cli_main("train", "--cfg", TINY, "TRAIN.VAL_SPLIT", "0.999"), status=2)
    assert "no training sample in class" in proc.stderr and "(32 samples)" in proc.stderr


@pytest.mark.e2e
def test_training_validates_on_the_held_out_part(tmp_path):
    out = str(tmp_path / "run")
    check(distribuuuu("train", "--cfg", TINY, "OUT_DIR", out, "OPTIM.MAX_EPOCH", "1", "TRAIN.VAL_SPLIT", "0.25"))
    lines = read_metrics(out)
    assert [m["n"] for m in lines if m["split"] == "train"] == [96 // 16 * 16]  # 128 - 32 held out
    assert [m["n"] for m in lines if m["split"] == "val"] == [32]


@pytest.mark.e2e
def test_best_on_valid_then_one_test_of_best_pth_at_the_end(tmp_path):
    """2 processes, 4 epochs: best.pth is chosen on the held-out split, TEST is evaluated once, at
    the end, on that checkpoint, and equals what `distribuuuu eval` gives for best.pth."""
    out = str(tmp_path / "run")
    proc = check(distribuuuu("train", "--nproc-per-node", "2", "--cfg", TINY, "OUT_DIR", out,
                             "OPTIM.MAX_EPOCH", "4", "TRAIN.VAL_SPLIT", "32"))
    assert "train: 96 - valid: 32 - test: 50" in proc.stdout
    lines = read_metrics(out)
    tests = [m for m in lines if m["split"] == "test"]
    assert len(tests) == 1 and lines[-1] == tests[0]  # the last line of the run
    vals = [m for m in lines if m["split"] == "val"]
    assert len(vals) == 4 and all(m["n"] == 32 for m in vals)
    # best.pth: the best balanced top-1, then the lower loss, then the later epoch
    best_epoch = max(vals, key=lambda m: (m["balanced_top1"], -m["loss"], m["epoch"]))["epoch"]
    assert tests[0]["epoch"] == best_epoch and tests[0]["n"] == 50 and tests[0]["weights"] == "best.pth"
    ev = check(distribuuuu("eval", "--cfg", TINY, "OUT_DIR", out))  # best.pth, on TEST (not the held-out part)
    assert read_metrics(out)[-1] == tests[0]  # eval leaves the run's metrics.jsonl alone
    record = read_jsonl(os.path.join(out, "eval.jsonl"))[-1]
    assert record["n"] == 50 and record["top1"] == tests[0]["top1"] and record["loss"] == pytest.approx(tests[0]["loss"], rel=1e-5)
    assert "best.pth" in ev.stdout

"""Per-class results: the confusion matrix counted with every evaluation (exact under DDP), per-class
top-1 in the val and test records, confusion.csv of the best checkpoint and of `eval --out`, and
`plot`'s confusion.png."""

from __future__ import annotations

import csv
import json
import os

import pytest
import torch

from distribuuuu import api
from distribuuuu.config import load_config
from distribuuuu.engine.evaluation import ClassCounter, Counter, confusion_csv, worst_classes
from tests.conftest import check, distribuuuu, read_metrics, write_image_tree

CPU = torch.device("cpu")
CLASSES = {"ant": 12, "bee": 8, "cat": 10}  # uneven: a weighted mean differs from a plain one


def test_per_class_top1_weighted_by_the_class_sizes_is_top1_even_with_ties():
    g = torch.Generator().manual_seed(0)
    counter, plain = ClassCounter(CPU, 2, 4), Counter(CPU, 2)
    for _ in range(5):
        logits = torch.randn(16, 4, generator=g).round()  # rounded: many ties between classes
        logits[:3] = 0.0  # whole rows tied
        target = torch.randint(0, 4, (16,), generator=g)
        loss = torch.tensor(1.0)
        counter.update(logits, target, loss)
        plain.update(logits, target, loss)
    result = counter.reduce().result()
    rows = result["confusion"]
    sizes = [sum(row) for row in rows]
    assert sum(sizes) == result["n"] == 80 and sum(rows[i][i] for i in range(4)) * 100 / 80 == result["top1"]
    weighted = sum(acc * n for acc, n in zip(result["per_class_top1"], sizes) if acc is not None) / sum(sizes)
    assert weighted == pytest.approx(result["top1"], abs=1e-9)
    assert result["top1"] == plain.reduce().result()["top1"]  # the same hits as the training epoch's counter


def test_a_class_without_samples_is_none_and_the_csv_names_every_class():
    counter = ClassCounter(CPU, 1, 3)
    counter.update(torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]]), torch.tensor([0, 0]), torch.tensor(0.5))
    result = counter.reduce().result()
    assert result["per_class_top1"] == [50.0, None, None] and result["confusion"] == [[1, 1, 0], [0, 0, 0], [0, 0, 0]]
    text = confusion_csv(["a,1", 'b"2', "c"], result["confusion"])
    rows = list(csv.reader(text.splitlines()))
    assert rows[0] == ["true \\ predicted", "a,1", 'b"2', "c"] and rows[1] == ["a,1", "1", "1", "0"]
    assert worst_classes(["a", "b", "c"], result["per_class_top1"], result["confusion"]) == \
        "a 50.0% (1/2; 1 taken for b)"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short run on a 3-class image folder (a val/ split of its own), and its folder."""
    root = tmp_path_factory.mktemp("per_class")
    data = str(root / "images")
    write_image_tree(data, "train", CLASSES, size=(16, 16))
    write_image_tree(data, "val", CLASSES, size=(16, 16))
    out = str(root / "run")
    cfg = load_config(None, ["MODEL.ARCH", "resnet_tiny", "TRAIN.DATASET", data, "TRAIN.IM_SIZE", "16",
                             "TRAIN.BATCH_SIZE", "8", "TEST.BATCH_SIZE", "7", "OPTIM.MAX_EPOCH", "2",
                             "TRAIN.WORKERS", "0", "DEVICE", "cpu", "NUM_THREADS", "1", "OUT_DIR", out,
                             "TRAIN.PRINT_FREQ", "100"])
    api.train(cfg)
    return data, out


def test_val_records_hold_per_class_top1_and_the_best_checkpoints_confusion_csv(trained):
    _, out = trained
    val = [r for r in read_metrics(out) if r["split"] == "val"]
    sizes = [CLASSES[name] for name in sorted(CLASSES)]
    for record in val:
        weighted = sum(a * n for a, n in zip(record["per_class_top1"], sizes)) / sum(sizes)
        assert weighted == pytest.approx(record["top1"], abs=1e-9) and record["n"] == sum(sizes)
        assert record["balanced_top1"] == pytest.approx(sum(record["per_class_top1"]) / len(sizes))
    with open(os.path.join(out, "confusion.csv"), newline="") as f:
        header, *rows = list(csv.reader(f))
    assert header[1:] == sorted(CLASSES) and [r[0] for r in rows] == sorted(CLASSES)
    # confusion.csv is best.pth's: the highest balanced top-1, then the lower val loss, the later epoch
    best = max(val, key=lambda r: (r["balanced_top1"], -r["loss"], r["epoch"]))
    assert [int(r[i + 1]) for i, r in enumerate(rows)] == [round(a * n / 100) for a, n in
                                                         zip(best["per_class_top1"], sizes)]
    with open(os.path.join(out, "metrics.csv")) as f:
        assert "per_class_top1" not in f.readline()  # a list: metrics.jsonl only


@pytest.mark.e2e
def test_eval_with_one_and_two_processes_writes_the_same_matrix_and_names_the_worst_classes(trained, tmp_path):
    data, out = trained
    best = os.path.join(out, "checkpoints", "best.pth")
    one = check(distribuuuu("eval", "--checkpoint", best, "TEST.DATASET", data, "--out", str(tmp_path / "one")))
    check(distribuuuu("eval", "--checkpoint", best, "TEST.DATASET", data, "--nproc-per-node", "2",
                      "TEST.BATCH_SIZE", "5", "--out", str(tmp_path / "two")))
    texts = [(tmp_path / name / "confusion.csv").read_text() for name in ("one", "two")]
    assert texts[0] == texts[1] and texts[0].startswith("true \\ predicted,ant,bee,cat\n")
    assert "[eval] worst classes: " in one.stdout + one.stderr
    records = [json.loads(line) for line in open(os.path.join(out, "eval.jsonl"))]
    assert records[0]["per_class_top1"] == records[1]["per_class_top1"] and "confusion" not in records[0]


@pytest.mark.e2e
def test_plot_draws_the_confusion_matrix(trained, tmp_path):
    _, out = trained
    proc = check(distribuuuu("plot", out, "--out", str(tmp_path)))
    assert os.path.getsize(tmp_path / "confusion.png") > 1000 and "confusion.png" in proc.stdout


def test_best_is_the_balanced_top1_then_the_lower_loss_then_the_later_epoch_and_patience_counts_late():
    """Trainer.update_best on its own: the rule that picks best.pth, and the count TRAIN.PATIENCE reads
    (no progress in the first half of the run counts)."""
    from types import SimpleNamespace

    from distribuuuu.engine.trainer import Trainer, TrainState

    cfg = load_config(None, ["OPTIM.MAX_EPOCH", "10"])
    t = SimpleNamespace(state=TrainState(), cfg=cfg)
    evaluations = [  # epoch, balanced top-1, loss, is best, evaluations without progress after it
        (1, 50.0, 1.0, True, 0),
        (2, 40.0, 2.0, False, 0),  # worse, but in the first half: not counted
        (3, 100.0, 0.5, True, 0),
        (6, 100.0, 0.6, False, 1),  # a tie on top-1 with a higher loss: not best, no progress
        (7, 100.0, 0.5, True, 2),  # a tie of both: the later epoch is best; the loss fell by < 1%
        (8, 100.0, 0.4, True, 0),  # the lower loss breaks the tie, and is progress
        (9, 99.0, 0.1, False, 0),  # a lower top-1 is never best, whatever its loss; the loss is progress
    ]
    for epoch, top1, loss, best, stalled in evaluations:
        t.state.epoch = epoch
        assert Trainer.update_best(t, top1, loss) is best, epoch
        assert t.state.evals_without_progress == stalled, epoch
    assert (t.state.best_epoch, t.state.best_metric, t.state.best_loss, t.state.lowest_loss) == (8, 100.0, 0.4, 0.1)

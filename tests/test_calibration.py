"""calibration.py: the temperature that minimises the validation NLL, the 15-bin ECE, the same fit on
every rank (two real processes), and the checkpoint written again with its hard links."""

from __future__ import annotations

import json
import math
import os
import textwrap

import pytest
import torch

from distribuuuu import calibration, weights
from tests.conftest import ROOT, check, torchrun


def _overconfident(n: int = 8000, classes: int = 10, sharpen: float = 3.0, seed: int = 0):
    """Logits whose labels are drawn from softmax(true logits), given `sharpen` times too large: the
    temperature that calibrates them is about `sharpen`."""
    g = torch.Generator().manual_seed(seed)
    true = 2.0 * torch.randn(n, classes, generator=g)
    labels = torch.multinomial(true.softmax(1), 1, generator=g)[:, 0]
    return sharpen * true, labels


def _fit(logits, labels):
    batches = [(logits[i : i + 4096], labels[i : i + 4096]) for i in range(0, len(labels), 4096)]
    return calibration.calibrate(torch.nn.Identity(), batches, torch.device("cpu"), logits.shape[1])


def _ece_by_hand(logits, labels, temperature) -> float:
    """The textbook definition, one sample at a time: bins (i/15, (i+1)/15] of the top probability."""
    bins = [[0, 0.0, 0.0] for _ in range(15)]
    for z, y in zip((logits.double() / temperature).softmax(1).tolist(), labels.tolist()):
        confidence = max(z)
        i = min(14, max(0, math.ceil(confidence * 15) - 1))
        bins[i][0] += 1
        bins[i][1] += confidence
        bins[i][2] += z.index(confidence) == y
    return sum(abs(hits - conf) for _, conf, hits in bins) / len(labels)


def test_the_fit_undoes_overconfidence_and_keeps_top1():
    logits, labels = _overconfident()
    fit = _fit(logits, labels)
    assert fit["temperature"] == pytest.approx(3.0, rel=0.05)
    assert fit["n"] == 8000 and fit["top1"] == fit["top1_calibrated"]
    assert fit["top1"] == pytest.approx(100.0 * float((logits.argmax(1) == labels).double().mean()))
    assert fit["nll_calibrated"] < fit["nll"] and fit["ece_calibrated"] < fit["ece"] / 4
    assert fit["ece"] == pytest.approx(_ece_by_hand(logits, labels, 1.0), abs=1e-12)
    assert fit["ece_calibrated"] == pytest.approx(_ece_by_hand(logits, labels, fit["temperature"]), abs=1e-12)
    nll = torch.nn.functional.cross_entropy(logits.double() / fit["temperature"], labels).item()
    assert fit["nll_calibrated"] == pytest.approx(nll, rel=1e-12)
    assert calibration.line(fit).startswith(f"temperature {fit['temperature']:.4f} | ECE ")


def test_an_evaluation_counts_the_ece_before_and_after_a_temperature():
    from distribuuuu.engine.evaluation import CalibratedCounter, ClassCounter

    logits, labels = _overconfident(n=3000, classes=5)
    counters = [ClassCounter(torch.device("cpu"), 2, 5), CalibratedCounter(torch.device("cpu"), 2, 5, 2.5)]
    for counter in counters:
        for i in range(0, 3000, 512):  # batches, as a loader gives them
            z, y = logits[i : i + 512], labels[i : i + 512]
            counter.update(z, y, torch.nn.functional.cross_entropy(z, y))
    plain, calibrated = (counter.reduce().result() for counter in counters)
    assert calibrated["ece"] == pytest.approx(_ece_by_hand(logits, labels, 1.0), abs=1e-12)
    assert calibrated["ece_calibrated"] == pytest.approx(_ece_by_hand(logits, labels, 2.5), abs=1e-12)
    assert calibrated["ece_calibrated"] < calibrated["ece"] and calibrated["temperature"] == 2.5
    assert {k: v for k, v in calibrated.items() if not k.startswith(("ece", "temp"))} == plain  # the rest as before
    assert calibration.ece_text(calibrated).endswith("at temperature 2.5")
    assert calibration.ece_text({**calibrated, "temperature": 1.0}).endswith("(uncalibrated)")


def test_the_fit_is_the_least_nll_on_a_fine_grid():
    logits, labels = _overconfident(n=2000, sharpen=0.6, seed=1)  # under-confident: T below 1
    fit = _fit(logits, labels)
    grid = torch.exp(torch.linspace(math.log(0.3), math.log(1.2), 401, dtype=torch.float64))
    nll = [torch.nn.functional.cross_entropy(logits.double() / t, labels).item() for t in grid]
    best = int(torch.tensor(nll).argmin())
    assert fit["temperature"] < 1 and fit["nll_calibrated"] <= nll[best] + 1e-12
    assert abs(math.log(fit["temperature"]) - math.log(grid[best])) < 4e-3  # the grid's own spacing


def test_store_writes_the_fit_into_the_card_and_keeps_the_hard_links(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    epoch = str(folder / "epoch_0003.pth")
    weights.save_checkpoint({"model": {"w": torch.ones(2)}, "epoch": 3, "card": {"classes": ["a", "b"]}}, epoch)
    for name in ("best.pth", "last.pth"):
        os.link(epoch, folder / name)
    other = str(folder / "epoch_0002.pth")
    weights.save_checkpoint({"model": {"w": torch.zeros(2)}, "epoch": 2}, other)
    fit = _fit(*_overconfident(n=500))
    best = str(folder / "best.pth")
    assert calibration.store(best, weights.load_checkpoint(best), fit)
    assert all(os.path.samefile(best, folder / n) for n in ("last.pth", "epoch_0003.pth"))
    assert not os.path.samefile(best, other) and "card" not in weights.load_checkpoint(other)
    ckpt = weights.load_checkpoint(epoch)  # the digest verified: written whole
    assert ckpt["card"] == {"classes": ["a", "b"], "temperature": fit["temperature"], "calibration": fit}
    inode = os.stat(best).st_ino
    assert not calibration.store(best, ckpt, fit) and os.stat(best).st_ino == inode  # the same fit: not written


@pytest.mark.e2e
def test_every_rank_fits_the_temperature_of_the_whole_split(tmp_path):
    """Two processes, each with its own uneven shard (700 and 1,300 samples): both get the same fit,
    the one a single process gets from all 2,000."""
    script = tmp_path / "fit.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {ROOT!r})
        import torch
        from distribuuuu import calibration
        from distribuuuu.config import load_config
        from distribuuuu.launch import comm
        from tests.test_calibration import _overconfident
        logits, labels = _overconfident(n=2000)
        with comm.session(load_config(None, ["DEVICE", "cpu"])) as ctx:
            part = slice(0, 700) if ctx.rank == 0 else slice(700, 2000)
            shard, truth = logits[part], labels[part]
            batches = [(shard[i : i + 128], truth[i : i + 128]) for i in range(0, len(truth), 128)]
            fit = calibration.calibrate(torch.nn.Identity(), batches, ctx.device, 10)
            with open({str(tmp_path)!r} + f"/fit{{ctx.rank}}.json", "w") as f:  # not stdout: the ranks share it
                json.dump(fit, f)
    """))
    check(torchrun(2, str(script)))
    fits = {rank: (tmp_path / f"fit{rank}.json").read_text() for rank in ("0", "1")}
    assert fits["0"] == fits["1"]  # the same on every rank
    fit, alone = json.loads(fits["0"]), _fit(*_overconfident(n=2000))
    assert fit["n"] == alone["n"] == 2000 and fit["top1"] == alone["top1"]
    assert fit["temperature"] == pytest.approx(alone["temperature"], rel=1e-6)
    for key in ("nll", "nll_calibrated", "ece", "ece_calibrated"):
        assert fit[key] == pytest.approx(alone[key], rel=1e-6, abs=1e-9), key

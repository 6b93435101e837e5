"""Steps 7 and 8 of the tutorial (tutorial/mp_naive.py, tutorial/mp_pipeline.py), run for real.

Each script cuts a ResNet into two stages in two gloo processes under torchrun, trains a few
steps, and compares itself with the unsplit model trained on the same batches from the same
weights. The tests read the numbers it prints back and check them against the tolerance the
script states (torch.allclose: |a - b| <= atol + rtol * |b|), and that the arithmetic of the
timing lines is the GPipe bubble (S - 1) / (M + S - 1). Timings themselves are not asserted on:
this machine is shared.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, check, env, torchrun

TUTORIAL = os.path.join(ROOT, "tutorial")
NAIVE, PIPELINE = (os.path.join(TUTORIAL, name) for name in ("mp_naive.py", "mp_pipeline.py"))
RTOL, ATOL = 1e-5, 1e-6  # what both scripts state; the tests read it back from their output
# Weights and BatchNorm buffers of this model stay well below 10 in a few steps: a bound on the
# max |diff| that allclose(RTOL, ATOL) implies for them.
WEIGHT_BOUND = ATOL + RTOL * 10

NUM = r"(\d+\.\d+(?:e[+-]\d+)?)"
TOL = r"\(rtol 1e-05, atol 1e-06\)"


def report(proc) -> str:
    return f"\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-3000:]}"


def close(a: float, b: float) -> bool:
    return abs(a - b) <= ATOL + RTOL * abs(b)


@pytest.mark.e2e
def test_naive_split_equals_the_unsplit_model():
    proc = check(torchrun(2, NAIVE, "--steps", "2"))
    out, why = proc.stdout, report(proc)
    inits = sorted(re.findall(r"\[init\] == rank: (\d), stage: (\d), world size: 2, backend: gloo", out))
    assert inits == [("0", "0"), ("1", "1")], why
    steps = re.findall(rf"== step: \[(\d)/2\] \| loss: {NUM} \| unsplit: {NUM} \| \|diff\|: {NUM}", out)
    assert [s for s, *_ in steps] == ["1", "2"], f"one loss line per step, from the last stage only{why}"
    for _, loss, unsplit, diff in steps:
        assert close(float(loss), float(unsplit)) and float(diff) <= ATOL + RTOL * float(unsplit), why
    assert len({loss for _, loss, _, _ in steps}) == 2, f"the loss changes: the optimizers step{why}"
    losses = re.findall(rf"\[check\] losses: max \|split - unsplit\| = {NUM} {TOL}: OK", out)
    weights = re.findall(rf"\[check\] weights after 2 steps: max \|split - unsplit\| = {NUM} {TOL}: OK", out)
    assert len(losses) == 1 and float(losses[0]) <= max(ATOL + RTOL * float(u) for _, _, u, _ in steps), why
    assert len(weights) == 1 and float(weights[0]) <= WEIGHT_BOUND, why
    timing = re.findall(r"\[time\] split over 2 processes: (\d+\.\d) ms/step \(stage 0 busy (\d+)%, "
                        r"stage 1 busy (\d+)%\) \| unsplit in one process: (\d+\.\d) ms/step", out)
    assert len(timing) == 1, why
    split, busy0, busy1, unsplit = map(float, timing[0])
    assert split > 0 and unsplit > 0 and 0 < busy0 and 0 < busy1, why
    # Not a speed claim: in the naive schedule the stages take turns (each waits for the other's
    # data), so their busy shares of a step (the slower stage's time) add up to at most 100%.
    assert busy0 + busy1 <= 101, f"the stages' busy times overlap, or the step time misses one{why}"


@pytest.mark.e2e
def test_pipeline_equals_the_unsplit_model_for_every_micro_batch_count():
    # 1, 2, 4, 8 as by default, and 3: 1/3 is not exact in floating point, so the reference must
    # divide the accumulated gradients by M in the schedule's order to stay allclose.
    micro = [1, 2, 3, 4, 8]
    proc = check(torchrun(2, PIPELINE, "--steps", "2", "--batch-size", "48",
                          "--microbatches", ",".join(map(str, micro))))
    out, why = proc.stdout, report(proc)
    assert "S = 2 stages | check: rtol 1e-05, atol 1e-06" in out, why
    checks = re.findall(rf"\[check\] M=(\d+): losses max \|pipeline - unsplit\| = {NUM}, weights after 2 steps "
                        rf"max \|pipeline - unsplit\| = {NUM} {TOL}: OK", out)
    assert [int(m) for m, _, _ in checks] == micro, f"one passing check per M{why}"
    for _, loss_diff, weight_diff in checks:
        assert float(loss_diff) <= ATOL + RTOL * 3 and float(weight_diff) <= WEIGHT_BOUND, why  # losses ~2.3
    times = re.findall(r"\[time\] M=(\d+) micro-batches of (\d+) \| pipeline: (\S+) ms/step \| unsplit: (\S+) "
                       r"ms/step \| ideal unsplit/S: (\S+) ms \| GPipe ideal/\(1-bubble\): (\S+) ms \| "
                       r"bubble \(S-1\)/\(M\+S-1\): (\S+)% \| measured 1-ideal/pipeline: (\S+)%", out)
    assert [int(t[0]) for t in times] == micro, f"one timing line per M{why}"
    for m, size, *numbers in times:
        m, size = int(m), int(size)
        pipe, unsplit, ideal, gpipe, bubble, measured = map(float, numbers)
        assert size * m == 48 and pipe > 0 and unsplit > 0, why
        assert abs(ideal - unsplit / 2) <= 0.06, why
        assert abs(bubble - 100 / (m + 1)) <= 0.06, f"GPipe's bubble (S-1)/(M+S-1) for S=2, M={m}{why}"
        assert abs(gpipe - ideal * (m + 1) / m) <= 0.1 * (m + 1) / m + 0.06, why
        # each printed number is rounded to 0.1: allow for it when recomputing from them
        assert abs(measured - 100 * (1 - ideal / pipe)) <= 0.06 + 5 * (1 / pipe + ideal / pipe**2), why


@pytest.mark.e2e
def test_scripts_refuse_bad_starts_with_one_message():
    """Before any process group: a micro-batch count that does not divide the batch, and a start
    without torchrun. Exit 2 (argparse), one line saying what is wrong, no traceback."""
    cases = [([PIPELINE, "--microbatches", "1,5"],
              "--microbatches 1,5: want whole numbers separated by commas, each dividing --batch-size 64"),
             ([NAIVE], "start me with torchrun --nproc-per-node 2 (RANK is not set)")]
    # Both at once: each spends most of its time importing torch.
    procs = [subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args, _ in cases]
    for proc, (_, message) in zip(procs, cases):
        out, err = proc.communicate(timeout=120)
        why = f"\n--- stdout\n{out[-2000:]}\n--- stderr\n{err[-2000:]}"
        assert proc.returncode == 2 and message in err and "Traceback" not in err, why


def test_scripts_are_standalone():
    """Like the other steps: plain PyTorch and torchvision, nothing from distribuuuu."""
    for path in (NAIVE, PIPELINE):
        with open(path) as f:
            source = f.read()
        assert not re.search(r"^\s*(import|from)\s+distribuuuu", source, re.M), path
        assert "torch.set_num_threads(1)" in source, path

"""Non-finite losses and gradients (TRAIN.NONFINITE): under skip, the default, a skipped step leaves no
trace and costs no host sync per step; stop, the skip limit and off end the run with one clear message
and the last good checkpoint kept; weights not finite at a checkpoint end the run there, naming them.
In process and tiny, but for the endings, which are real runs (docs/reliability.md)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from distribuuuu import engine, nonfinite, optim
from distribuuuu.data import register_source, unregister_source
from distribuuuu.launch import comm
from distribuuuu.optim import Stepper
from distribuuuu.strategies import Strategy
from tests.conftest import ROOT, TINY, distribuuuu, env, fit, make_cfg, read_metrics

CPU = torch.device("cpu")
SOURCE = "guard_nan_tiny"
NAN_INDEX = 5  # the one all-NaN training image


class QuadrantImages(torch.utils.data.Dataset):
    """4 classes of 8x8 images, class c bright in quadrant c (learnable in an epoch); ready floats,
    as the synthetic source gives them; ``nan``: the indices whose image is all NaN."""

    def __init__(self, n: int, seed: int, nan: tuple[int, ...] = ()) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.arange(n) % 4
        self.images = torch.rand(n, 3, 8, 8, generator=g) * 0.4
        for i, c in enumerate(self.labels.tolist()):
            r, k = divmod(c, 2)
            self.images[i, :, 4 * r:4 * r + 4, 4 * k:4 * k + 4] += 0.6
        self.images -= 0.5
        for i in nan:
            self.images[i] = float("nan")
        self.classes = ["a", "b", "c", "d"]

    @property
    def targets(self) -> list[int]:
        return self.labels.tolist()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], int(self.labels[i])


@pytest.fixture
def nan_source():
    register_source(SOURCE, lambda split, cfg, key: QuadrantImages(128, 0, (NAN_INDEX,)) if split == "train"
                    else QuadrantImages(32, 1))
    yield SOURCE
    unregister_source(SOURCE)


def _cfg(out, *opts: str):
    """A run into out on the source with a NaN sample (nan_source), at 8 px."""
    return make_cfg("OUT_DIR", out, "TRAIN.DATASET", SOURCE, "TEST.DATASET", SOURCE, "TEST.SPLIT", "val",
                    "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8", "OPTIM.BASE_LR", "0.1", "TRAIN.PRINT_FREQ", "100", *opts,
                    base=TINY)


# -- no trace -----------------------------------------------------------------------------------------
def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 4))


def _state(stepper: Stepper) -> dict:
    """Everything a step could move, as plain tensors."""
    flat = {f"model.{k}": v for k, v in stepper.model.state_dict().items()}
    for i, s in enumerate(stepper.optimizer.state.values()):
        flat.update({f"optim.{i}.{k}": v for k, v in s.items() if torch.is_tensor(v)})
    if stepper.ema is not None:
        flat.update({f"ema.{k}": v for k, v in stepper.ema.state_dict().items()})
    return {k: v.detach().clone() for k, v in flat.items()}


def _same(a: dict, b: dict) -> bool:
    """Bitwise: the bytes of every tensor (torch.equal would take -0.0 for 0.0)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].reshape(-1).view(torch.uint8).equal(b[k].reshape(-1).view(torch.uint8))
        for k in a)


@pytest.mark.parametrize("opts", [["OPTIM.OPTIMIZER", "sgd"], ["OPTIM.OPTIMIZER", "adamw"],
                                  ["OPTIM.OPTIMIZER", "sgd", "TRAIN.CLIP_GRAD_NORM", "1.0"],
                                  ["OPTIM.OPTIMIZER", "lamb"]], ids=["sgd", "adamw", "sgd-clip", "lamb-synced"])
def test_state_after_a_skipped_step_equals_the_state_before_bitwise(opts):
    cfg = make_cfg("TRAIN.EMA_DECAY", "0.9", *opts, base=TINY)
    model = _net()
    stepper = Stepper(cfg, CPU, model, optim.build_optimizer(cfg, model), global_batch=16,
                      strategy=Strategy(cfg, None))
    # LAMB has no fused kernel: the synced check
    assert type(stepper.guard) is (nonfinite.OnDevice if opts[1] != "lamb" else nonfinite.Synced)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    assert stepper.micro_step(x, y).last  # momentum and moments exist now
    before = _state(stepper)
    bad = x.clone()
    bad[3] = float("nan")
    assert stepper.micro_step(bad, y).last
    assert _same(_state(stepper), before)  # params, momentum/moments/step, BN stats + count, EMA
    assert stepper.guard.settle(2) == 1
    stepper.micro_step(x, y)
    assert stepper.guard.settle(3) == 0 and not _same(_state(stepper), before)  # and it trains on


def test_fused_sgd_momentum_is_not_born_from_a_skipped_first_step():
    """Fused SGD's first step makes the momentum buffers; a skipped one must not make them from its
    gradients (they start at zero): NaN first, then a good batch, ends where the good batch alone does."""
    cfg = make_cfg("OPTIM.OPTIMIZER", "sgd", base=TINY)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    runs = []
    for first_bad in (True, False):
        model = _net()
        stepper = Stepper(cfg, CPU, model, optim.build_optimizer(cfg, model), global_batch=16,
                          strategy=Strategy(cfg, None))
        if first_bad:
            stepper.micro_step(torch.full_like(x, float("nan")), y)
            assert stepper.guard.settle(1) == 1
            assert all(not s["momentum_buffer"].any() for s in stepper.optimizer.state.values())
        stepper.micro_step(x, y)
        stepper.micro_step(x.flip(0), y.flip(0))  # a second step uses the buffers
        runs.append(_state(stepper))
    assert _same(*runs)


# -- one all-NaN sample in a run --------------------------------------------------------------------
def test_one_nan_sample_is_skipped_without_trace_and_the_run_is_saved(tmp_path, nan_source):
    out = tmp_path / "run"
    summary = fit(_cfg(out, "OPTIM.MAX_EPOCH", "3", "TRAIN.CKPT_PERIOD_STEPS", "1"))
    records = read_metrics(str(out))
    train = [r for r in records if r["split"] == "train"]
    val = [r for r in records if r["split"] == "val"]
    assert [r["skipped_steps"] for r in train] == [1, 1, 1]  # the NaN image's batch, once per epoch
    assert all(r["loss"] is not None and r["n"] == 112 for r in train)  # the finite batches' loss
    assert val[-1]["loss"] is not None and val[-1]["top1"] >= 75, val  # chance is 25%
    assert summary["best"] >= 75
    ckpts = sorted(os.path.basename(p) for p in glob.glob(str(out / "checkpoints" / "*.pth")))
    assert "last.pth" in ckpts and "best.pth" in ckpts and "epoch_0003.pth" in ckpts, ckpts
    last = torch.load(out / "checkpoints" / "last.pth", map_location="cpu", weights_only=True)
    assert last["global_step"] == 24  # 3 x 8 steps of the schedule, the 3 skipped ones too
    assert all(torch.isfinite(t).all() for t in last["model"].values() if t.is_floating_point())


class CrashAtFirstStepCheckpoint(engine.HookBase):
    """Ends the process's run (as a crash would) right after the first mid-epoch checkpoint."""

    def after_step(self, trainer, step, printed):
        if glob.glob(os.path.join(trainer.cfg.OUT_DIR, "checkpoints", "step_*.pth")):
            raise KeyboardInterrupt


def test_resume_across_a_skipped_step_is_bitwise_a_straight_run(tmp_path, nan_source):
    opts = ["OPTIM.MAX_EPOCH", "2", "TRAIN.CKPT_PERIOD_STEPS", "2", "TRAIN.EMA_DECAY", "0.9"]
    fit(_cfg(tmp_path / "straight", *opts))
    with pytest.raises(KeyboardInterrupt):
        fit(_cfg(tmp_path / "resumed", *opts), hooks=[CrashAtFirstStepCheckpoint()])
    (step,) = glob.glob(str(tmp_path / "resumed" / "checkpoints" / "step_*.pth"))
    mid = torch.load(step, map_location="cpu", weights_only=True)
    fit(_cfg(tmp_path / "resumed", *opts))
    train = [r for r in read_metrics(str(tmp_path / "resumed")) if r["split"] == "train"]
    # The resumed epoch met the NaN batch after the checkpoint it started from.
    assert mid["epoch"] == 0 and train[0]["skipped_steps"] == 1, (mid["global_step"], train)
    a, b = (torch.load(tmp_path / run / "checkpoints" / "last.pth", map_location="cpu", weights_only=True)
            for run in ("straight", "resumed"))
    assert a["global_step"] == b["global_step"] == 16
    for key in ("model", "ema"):
        assert _same(a[key], b[key]), key
    assert _same(*({f"{i}.{k}": v for i, s in ckpt["optimizer"]["state"].items() for k, v in s.items()}
                   for ckpt in (a, b)))


# -- no host sync per step ------------------------------------------------------------------------------
SYNCS = {torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
         torch.Tensor.__float__, torch.Tensor.__int__}


class CountSyncs(TorchFunctionMode):
    """Counts the tensor calls that make the host wait for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in SYNCS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_sync_calls_do_not_grow_with_the_steps(tmp_path, optimizer):
    counts = []
    for samples in (16, 142):  # batch 2: 8 and 71 optimizer steps, no print step between
        cfg = make_cfg("OUT_DIR", tmp_path / str(samples), "OPTIM.OPTIMIZER", optimizer, "OPTIM.BASE_LR", "0.01",
                       "OPTIM.MAX_EPOCH", "1", "TRAIN.BATCH_SIZE", "2", "TRAIN.SYNTHETIC_SAMPLES", samples,
                       "TRAIN.IM_SIZE", "8", "TEST.IM_SIZE", "8", "TEST.SYNTHETIC_SAMPLES", "8",
                       "TRAIN.PRINT_FREQ", "1000", base=TINY)
        mode = CountSyncs()
        with comm.session(cfg) as ctx:
            trainer = engine.Trainer(cfg, ctx)
            with mode:
                trainer.fit()
        counts.append(mode.count)
    assert abs(counts[1] - counts[0]) <= 5, counts  # 63 more steps, not 63 more syncs (nor one per 10 steps)


# -- weights that are not finite at a checkpoint --------------------------------------------------------
class PoisonBuffersAtTheEnd(engine.HookBase):
    """A BatchNorm statistic turns NaN at the run's last step (as a forward pass of bad data would
    leave it without the guard): the epoch's checkpoint is refused."""

    def after_step(self, trainer, step, printed):
        if trainer.state.epoch + 1 == trainer.cfg.OPTIM.MAX_EPOCH and \
                trainer.state.samples_in_epoch >= trainer.epoch_samples:
            bn = next(m for m in trainer.model.modules() if isinstance(m, nn.BatchNorm2d))
            bn.running_var.fill_(float("nan"))


def test_weights_not_finite_at_a_checkpoint_raise_naming_the_tensor(tmp_path):
    cfg = make_cfg("OUT_DIR", tmp_path / "run", "OPTIM.MAX_EPOCH", "1", "TEST.SYNTHETIC_SAMPLES", "16", base=TINY)
    with pytest.raises(nonfinite.NonFiniteWeights, match=r"at step 8 \(epoch 1\): bn1.running_var \(nan\)"):
        fit(cfg, hooks=[PoisonBuffersAtTheEnd()])


@pytest.mark.e2e
def test_weights_not_finite_at_a_checkpoint_exit_2_with_one_line_and_no_done(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "distribuuuu", "train", "--cfg", TINY, "OUT_DIR", str(out),
                           "OPTIM.MAX_EPOCH", "1", "TEST.SYNTHETIC_SAMPLES", "16", "TRAIN.HOOKS",
                           "['tests.test_nonfinite_guard:PoisonBuffersAtTheEnd']"],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "the weights are not finite at step 8" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "done:" not in proc.stdout + proc.stderr
    assert not os.path.exists(out / "checkpoints" / "epoch_0001.pth")


# -- a clear ending: TRAIN.NONFINITE stop, the skip limit, off (real runs) ---------------------------
FAST = ["OPTIM.MAX_EPOCH", "1", "TRAIN.SYNTHETIC_SAMPLES", "64", "TEST.SYNTHETIC_SAMPLES", "16"]


def _train(out, *args: str, nproc: int = 0) -> subprocess.CompletedProcess:
    launcher = ["--nproc-per-node", str(nproc)] if nproc else []
    return distribuuuu("train", *launcher, "--cfg", TINY, "OUT_DIR", str(out), *args, timeout=180)


def _assert_nonfinite_ending(proc: subprocess.CompletedProcess, *parts: str) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    for part in ("lower OPTIM.BASE_LR (now 1e+30)", "TRAIN.CLIP_GRAD_NORM", "check the data", *parts):
        assert part in errors[0], errors[0]
    return errors[0]


@pytest.mark.parametrize("nproc", [0, 2], ids=["plain", "spawn-2"])
@pytest.mark.e2e
def test_nonfinite_stop_is_a_clear_ending_on_every_rank(tmp_path, nproc):
    out = tmp_path / "run"
    proc = _train(out, *FAST, "OPTIM.BASE_LR", "1e30", "TRAIN.NONFINITE", "stop", nproc=nproc)
    _assert_nonfinite_ending(proc, "non-finite loss or gradients at step", "TRAIN.NONFINITE stop")
    if nproc:  # each rank ended the same way (no peer left waiting, no crash): the spawner prints it once
        assert [ln.split(":")[0] for ln in proc.stderr.splitlines() if ln.startswith("error")] == ["error"], proc.stderr
    log = (out / "log.txt").read_text()
    assert "rank 0 failed: NonFiniteLoss: non-finite loss" in log  # why the run ended, in the run folder


@pytest.mark.e2e
def test_nonfinite_skip_limit_is_a_clear_ending(tmp_path):
    proc = _train(tmp_path / "run", *FAST, "OPTIM.BASE_LR", "1e30", "TRAIN.NONFINITE_MAX_SKIPS", "1")
    _assert_nonfinite_ending(proc, "2 in a row", "NONFINITE_MAX_SKIPS 1")


@pytest.mark.e2e
def test_nonfinite_off_ends_at_the_epoch_and_keeps_the_last_good_checkpoint(tmp_path):
    """TRAIN.NONFINITE off checks nothing per step; an epoch whose loss is not finite ends the run
    with the same kind of message, before a checkpoint of the broken weights replaces the good one."""
    out = tmp_path / "run"
    assert _train(out, *FAST).returncode == 0  # one good epoch
    good = torch.load(out / "checkpoints" / "last.pth", map_location="cpu", weights_only=True)
    # The same run, one more epoch, with an LR that diverges (allowed explicitly on resume).
    proc = _train(out, *FAST, "OPTIM.MAX_EPOCH", "2", "OPTIM.BASE_LR", "1e30", "TRAIN.NONFINITE", "off",
                  "TRAIN.RESUME_ALLOW", "['OPTIM.BASE_LR', 'TRAIN.NONFINITE']")
    _assert_nonfinite_ending(proc, "the training loss of epoch 2", "TRAIN.NONFINITE off")
    last = torch.load(out / "checkpoints" / "last.pth", map_location="cpu", weights_only=True)
    assert last["epoch"] == 1 and all(torch.equal(last["model"][k], good["model"][k]) for k in good["model"])
    records = read_metrics(str(out))  # every line parses
    assert [(r["epoch"], r["split"]) for r in records if r["split"] == "train"] == [(1, "train"), (2, "train")]
    assert records[-1]["loss"] is None  # the non-finite epoch is recorded (NaN as null)


@pytest.mark.e2e
def test_the_gpu_sync_debug_job_dry_runs_on_the_cpu(tmp_path):
    """benchmarks/gpu.py's sync_debug job (a GPU session runs it under set_sync_debug_mode("error")):
    its CPU dry run counts no sync-forcing call in the watched steps and skips the one NaN step."""
    proc = subprocess.run([sys.executable, "benchmarks/gpu.py", "--out", str(tmp_path), "--device", "cpu", "--small",
                           "--only", "sync_debug"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "gpu.json") as f:
        rec = json.load(f)["jobs"]["sync_debug"]["result"]
    assert rec["ok"] and rec["sync_calls_while_watched"] == 0 and rec["skipped_steps"] == 1, rec


def test_fused_sgd_gives_momentum_to_parameters_that_start_training_later():
    """A frozen backbone unfrozen later (or a parameter without a gradient so far): fused SGD's kernel
    takes no missing buffer beside existing ones; that step makes them as multi-tensor SGD does."""
    cfg = make_cfg("OPTIM.OPTIMIZER", "sgd", base=TINY)
    model = _net()
    stepper = Stepper(cfg, CPU, model, optim.build_optimizer(cfg, model), global_batch=16,
                      strategy=Strategy(cfg, None))
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    model[0].requires_grad_(False)
    stepper.micro_step(x, y)
    frozen = [p.detach().clone() for p in model[0].parameters()]
    model[0].requires_grad_(True)
    stepper.micro_step(x, y)
    first = [stepper.optimizer.state[p]["momentum_buffer"].clone() for p in model[0].parameters()]
    stepper.micro_step(x, y)
    assert stepper.guard.settle(3) == 0
    assert all(f.ne(0).any() for f in first)  # its first step made them (from the gradients) ...
    assert all(not torch.equal(a, p) for a, p in zip(frozen, model[0].parameters()))  # ... and it trained
    bufs = [stepper.optimizer.state[p]["momentum_buffer"] for p in model.parameters()]
    assert all(torch.isfinite(b).all() for b in bufs)
    assert all(group["fused"] for group in stepper.optimizer.param_groups)  # the fused kernel throughout
    assert isinstance(stepper.guard, nonfinite.OnDevice)


def test_the_epoch_counter_leaves_out_non_finite_batches_and_reads_older_sums():
    from distribuuuu.engine.evaluation import Counter

    logits, target = torch.tensor([[2.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 0])
    c = Counter(CPU, 2, skip_nonfinite=True)
    c.update(logits, target, torch.tensor(0.5))
    c.update(logits, target, torch.tensor(float("nan")))  # a skipped step's batch
    assert c.result() == {"loss": 0.5, "top1": 50.0, "topk_acc": 100.0, "n": 2} and c.n == 4
    c.add([1.0, 2.0, 2.0, 2.0])  # a checkpoint's sums from before issue 24: [loss, hit1, hitk, n]
    assert c.result()["n"] == 4 and c.sums_with_n().tolist() == [2.0, 3.0, 4.0, 6.0, 4.0]
    off = Counter(CPU, 2)  # TRAIN.NONFINITE off: the epoch's loss must show the NaN (NonFiniteEpochCheck)
    off.update(logits, target, torch.tensor(float("nan")))
    assert off.result()["n"] == 2 and off.result()["loss"] != off.result()["loss"]


def test_a_checkpoint_from_before_the_fused_kernels_resumes_on_them():
    """Optimizer state saved with foreach SGD (before issue 24) loads its param groups' kernel keys;
    the stepper puts back the fused kernel its device-side skip needs."""
    cfg = make_cfg("OPTIM.OPTIMIZER", "sgd", base=TINY)
    model = _net()
    opt = optim.build_optimizer(cfg, model)
    stepper = Stepper(cfg, CPU, model, opt, global_batch=16, strategy=Strategy(cfg, None))
    old = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    opt.load_state_dict(old.state_dict())
    stepper.load_state_dict({})
    assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    stepper.micro_step(x, y)
    stepper.micro_step(x.flip(0), y)  # a multi-tensor kernel would refuse the guard's found_inf
    assert isinstance(stepper.guard, nonfinite.OnDevice) and stepper.guard.settle(2) == 0

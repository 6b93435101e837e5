"""Training options: accumulation, AMP, EMA, mixup, clipping, the optimizers and the LR schedule, early
stopping, torch.compile, and the strategies (DIST.STRATEGY: the rules each states, zero1, dp)."""

import math

import pytest
import torch

from distribuuuu import optim, strategies
from distribuuuu.errors import UserError
from distribuuuu.optim import Stepper, ema_decay_per_step
from distribuuuu.strategies import Strategy
from tests.conftest import TINY, check, cli_main, distribuuuu, make_cfg, read_metrics, torchrun

CPU = torch.device("cpu")


def _net():
    """No BatchNorm: with BN, two half batches see other statistics than one full batch."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 6 * 6, 4))


def _cfg(*opts):
    """4 classes (_net's), plain SGD: no momentum, no weight decay, so an update is lr x gradient."""
    return make_cfg("MODEL.NUM_CLASSES", "4", "TRAIN.TOPK", "2", "OPTIM.MOMENTUM", "0.0", "OPTIM.NESTEROV", "False",
                    "OPTIM.WEIGHT_DECAY", "0.0", *opts)


def _one_step(cfg, batches):
    model = _net()
    opt = optim.build_optimizer(cfg, model)
    stepper = Stepper(cfg, CPU, model, opt, global_batch=16, strategy=Strategy(cfg, None))
    outs = [stepper.micro_step(x, y) for x, y in batches]
    return model, outs


def test_accumulating_two_half_batches_equals_one_full_batch():
    torch.manual_seed(1)
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,))
    full, outs_full = _one_step(_cfg(), [(x, y)])
    accum, outs = _one_step(_cfg("TRAIN.ACCUM_STEPS", "2"), [(x[:8], y[:8]), (x[8:], y[8:])])
    assert [o.last for o in outs] == [False, True] and outs_full[0].last
    # The same gradient sums in another order: equal to float rounding.
    for a, b in zip(full.parameters(), accum.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(_net().parameters(), full.parameters()))  # it moved


def test_clipping_bounds_the_update():
    torch.manual_seed(2)
    x, y = torch.randn(16, 3, 8, 8) * 100, torch.randint(0, 4, (16,))
    cfg = _cfg("TRAIN.CLIP_GRAD_NORM", "0.01", "OPTIM.BASE_LR", "1.0")
    before = [p.detach().clone() for p in _net().parameters()]
    model, _ = _one_step(cfg, [(x, y)])
    delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    assert delta.norm() <= 0.01 + 1e-6  # plain SGD: update = lr x clipped gradient


def test_mixup_counts_top1_against_the_hard_labels():
    cfg = _cfg("TRAIN.MIXUP_ALPHA", "0.4", "TRAIN.CUTMIX_ALPHA", "1.0")
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 4, (8,))
    _, outs = _one_step(cfg, [(x, y)])
    assert torch.equal(outs[0].target, y)


def test_ema_decay_follows_the_global_batch():
    cfg = _cfg("TRAIN.EMA_DECAY", "0.99", "OPTIM.REF_BATCH_SIZE", "128")
    assert ema_decay_per_step(cfg, 128) == pytest.approx(0.99)
    assert ema_decay_per_step(cfg, 256) == pytest.approx(0.99 ** 2)  # one step = two reference steps
    assert ema_decay_per_step(cfg, 64) == pytest.approx(0.99 ** 0.5)


@pytest.mark.parametrize("name, cls", [("sgd", "SGD"), ("adamw", "AdamW"), ("lamb", "Lamb"), ("lars", "Lars")])
def test_optimizers_build_and_step(name, cls):
    cfg = _cfg("OPTIM.OPTIMIZER", name, "OPTIM.NO_WD_NORM_BIAS", "True", "OPTIM.WEIGHT_DECAY", "0.1",
               "OPTIM.BASE_LR", "0.01")
    model, outs = _one_step(cfg, [(torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3]))])
    opt = optim.build_optimizer(cfg, model)
    assert type(opt).__name__ == cls
    assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.1]  # biases exempt
    assert outs[0].last


@pytest.mark.e2e
def test_ddp_with_accumulation_bf16_ema_keeps_replicas_identical(tmp_path):
    out = str(tmp_path / "run")
    check(torchrun(2, "tests/scripts/train_and_dump.py", "--cfg", TINY, "OUT_DIR", out,
                   "TRAIN.ACCUM_STEPS", "2", "TRAIN.AMP", "bf16", "TRAIN.EMA_DECAY", "0.9",
                   "TRAIN.BEST_METRIC", "ema_top1", "TRAIN.LABEL_SMOOTHING", "0.1", "TRAIN.CHANNELS_LAST", "True"))
    w0 = torch.load(f"{out}/rank0.pt", weights_only=True)
    w1 = torch.load(f"{out}/rank1.pt", weights_only=True)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    lines = read_metrics(out)
    assert [m["split"] for m in lines].count("val_ema") == 2
    train = [m for m in lines if m["split"] == "train"]
    assert train[-1]["step"] == 4  # 128 samples / (16 x 2 ranks x 2 accumulation) = 2 steps per epoch
    ckpt = torch.load(f"{out}/checkpoints/last.pth", weights_only=True)
    assert "ema" in ckpt and "scaler" in ckpt


@pytest.mark.e2e
def test_fp16_with_grad_scaler_checkpoints_and_resumes(tmp_path):
    out = str(tmp_path / "run")
    check(distribuuuu("train", "--cfg", TINY, "OUT_DIR", out, "TRAIN.AMP", "fp16", "OPTIM.MAX_EPOCH", "1"))
    scale = torch.load(f"{out}/checkpoints/last.pth", weights_only=True)["scaler"]["scale"]
    assert scale > 0
    proc = check(distribuuuu("train", "--cfg", TINY, "OUT_DIR", out, "TRAIN.AMP", "fp16"))
    assert "resumed from" in proc.stdout


@pytest.mark.e2e
def test_patience_stops_early_and_target_records_time_to_accuracy(tmp_path):
    out = str(tmp_path / "patience")
    proc = check(distribuuuu("train", "--cfg", TINY, "OUT_DIR", out, "OPTIM.MAX_EPOCH", "6",
                             "OPTIM.BASE_LR", "1e-6", "TRAIN.PATIENCE", "1", "OPTIM.LR_POLICY", "constant"))
    assert "early stop: no progress in 1 evaluations" in proc.stdout
    epochs = len([m for m in read_metrics(out) if m["split"] == "train"])
    assert 4 <= epochs < 6  # evaluations count in the run's second half only: epochs 4 to 6 of 6
    out = str(tmp_path / "target")
    proc = check(distribuuuu("train", "--cfg", TINY, "OUT_DIR", out, "OPTIM.MAX_EPOCH", "6", "TRAIN.TARGET_TOP1", "90"))
    hit = [m for m in read_metrics(out) if "time_to_target_s" in m]
    assert len(hit) == 1 and hit[0]["top1"] >= 90 and hit[0]["time_to_target_s"] > 0
    assert "target top-1 90% reached" in proc.stdout


@pytest.mark.e2e
def test_torch_compile_runs_and_logs_compile_time_apart(tmp_path):
    """The wiring (compile, compile time logged apart, the compiled model's checkpoint) with aot_eager:
    the default inductor backend generates C++ on a CPU, minutes of the suite; gpu.py's compile job runs
    inductor on a GPU."""
    out = str(tmp_path / "run")
    proc = check(distribuuuu("train", "--cfg", TINY, "OUT_DIR", out, "OPTIM.MAX_EPOCH", "1", "TRAIN.COMPILE", "True",
                             "TRAIN.COMPILE_BACKEND", "aot_eager"))
    assert "torch.compile + first step" in proc.stdout
    state = torch.load(f"{out}/checkpoints/last.pth", map_location="cpu", weights_only=True)["model"]
    assert state and not any(k.startswith("_orig_mod.") for k in state)  # loads into an uncompiled model
    assert read_metrics(out)[-1]["n"] == 50


def _zero_vs_ddp_worker(out_dir):
    """Runs in each of 2 spawned processes: a few steps under ddp and under zero1 from the same
    start; saves the weights and the bytes of optimizer state this rank holds."""
    import os

    from distribuuuu import models
    from distribuuuu.launch import comm
    from distribuuuu.optim import Stepper

    results = {}
    base = make_cfg("OPTIM.OPTIMIZER", "adamw", "OPTIM.BASE_LR", "0.01", base=TINY)
    with comm.session(base) as ctx:
        for strategy in ("ddp", "zero1"):
            cfg = make_cfg("DIST.STRATEGY", strategy, "OPTIM.OPTIMIZER", "adamw", "OPTIM.BASE_LR", "0.01", base=TINY)
            torch.manual_seed(0)
            strat = strategies.build(cfg, ctx)
            model = strat.wrap_model(models.build_model(cfg))
            opt = strat.build_optimizer(model)
            stepper = Stepper(cfg, ctx.device, model, opt, global_batch=32, strategy=strat)
            g = torch.Generator().manual_seed(ctx.rank)
            for _ in range(3):
                x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
                stepper.micro_step(x, y)
            inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer wraps the local optimizer
            state_bytes = sum(t.numel() * t.element_size() for s in inner.state.values()
                              for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
            results[strategy] = (models.state_dict_for_saving(model), state_bytes)
            if strategy == "zero1":
                opt.consolidate_state_dict(to=0)
                if ctx.rank == 0:
                    results["zero1_full_state_entries"] = len(opt.state_dict()["state"])
    torch.save(results, os.path.join(out_dir, f"zero_rank{ctx.rank}.pt"))


@pytest.mark.e2e
def test_zero1_matches_ddp_and_shards_the_optimizer_state(tmp_path):
    from distribuuuu.launch import spawn

    assert spawn.spawn(_zero_vs_ddp_worker, 2, args=(str(tmp_path),)) == 0
    r0 = torch.load(tmp_path / "zero_rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "zero_rank1.pt", weights_only=True)
    ddp_w, ddp_bytes = r0["ddp"]
    zero_w, zero_bytes0 = r0["zero1"]
    for k in ddp_w:  # the same maths, only where the optimizer state lives differs
        torch.testing.assert_close(zero_w[k], ddp_w[k], rtol=1e-5, atol=1e-6, msg=k)
    for k in ddp_w:  # replicas agree (BatchNorm running statistics follow each rank's own batches)
        if "running" not in k and "num_batches" not in k:
            assert torch.equal(r1["zero1"][0][k], zero_w[k]), k
    zero_bytes1 = r1["zero1"][1]
    # Each rank holds about half of AdamW's state (parameters are split in whole tensors).
    assert zero_bytes0 + zero_bytes1 == pytest.approx(ddp_bytes, rel=0.01)
    assert max(zero_bytes0, zero_bytes1) < 0.75 * ddp_bytes
    assert r0["zero1_full_state_entries"] == len([p for p in ddp_w if "running" not in p and "num_batches" not in p])


@pytest.mark.e2e
def test_zero1_checkpoints_and_resumes(tmp_path):
    out = str(tmp_path / "run")
    check(distribuuuu("train", "--nproc-per-node", "2", "--cfg", TINY, "OUT_DIR", out, "DIST.STRATEGY", "zero1",
                      "OPTIM.MAX_EPOCH", "1"))
    assert len(torch.load(f"{out}/checkpoints/last.pth", weights_only=True)["optimizer"]["state"]) > 0
    proc = check(distribuuuu("train", "--nproc-per-node", "2", "--cfg", TINY, "OUT_DIR", out, "DIST.STRATEGY", "zero1"))
    assert "resumed from" in proc.stdout and read_metrics(out)[-1]["epoch"] == 2


def test_dp_runs_in_one_process_and_refuses_several():
    proc = cli_main("train", "--nproc-per-node", "2", "--cfg", TINY, "DIST.STRATEGY", "dp")
    assert proc.returncode == 2 and "DIST.STRATEGY dp is ONE process" in proc.stderr


# ---------------------------------------------------------------------------------------------
# The LR schedule
# ---------------------------------------------------------------------------------------------
def test_cosine_schedule_with_warmup():
    cfg = make_cfg("OPTIM.MAX_EPOCH", "10", "OPTIM.WARMUP_EPOCHS", "2", "OPTIM.WARMUP_FACTOR", "0.1",
                   "OPTIM.MIN_LR", "0.01")
    # The decay runs over the 8 epochs after the warmup (#27: every run reaches its peak LR).
    cos = lambda e: 0.99 * 0.5 * (1 + math.cos(math.pi * (e - 2) / 8)) + 0.01  # noqa: E731
    factor = optim.Schedule(cfg, 1.0)
    assert factor(0.0) == pytest.approx(0.1)  # warmup starts at WARMUP_FACTOR
    assert factor(1.0) == pytest.approx(0.55)  # halfway through warmup
    assert factor(2.0) == pytest.approx(1.0)  # warmup over: the peak itself
    assert factor(6.0) == pytest.approx(cos(6.0))
    assert factor(10.0) == pytest.approx(0.01)  # ends at MIN_LR
    # Monotone after warmup.
    values = [factor(2 + i / 10) for i in range(80)]
    assert values == sorted(values, reverse=True)


def test_steps_schedule_and_linear_scaling():
    cfg = make_cfg("OPTIM.LR_POLICY", "steps", "OPTIM.STEPS", "[0, 3, 6]", "OPTIM.LR_MULT", "0.1",
                   "OPTIM.MAX_EPOCH", "9", "OPTIM.WARMUP_EPOCHS", "0",
                   "OPTIM.LR_SCALING", "linear", "OPTIM.BASE_LR", "0.1")
    factor = optim.Schedule(cfg, 1.0)
    assert [factor(e) for e in (0, 2.99, 3, 5.5, 6, 8.9)] == pytest.approx(
        [1, 1, 0.1, 0.1, 0.01, 0.01])
    assert optim.peak_lr(cfg, 256) == pytest.approx(0.2)  # 0.1 x 256 / 128
    plain = make_cfg("OPTIM.BASE_LR", "0.1")
    assert optim.peak_lr(plain, 256) == pytest.approx(0.1)


# ---------------------------------------------------------------------------------------------
# Each strategy states its own rules (strategies/), asked before any process starts
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opts, world, message", [
    (["DIST.STRATEGY", "fsdp", "TRAIN.EMA_DECAY", "0.9"], 2, "TRAIN.EMA_DECAY needs whole parameters"),
    (["DIST.STRATEGY", "fsdp", "TRAIN.AMP", "fp16"], 2, "fsdp supports TRAIN.AMP off or bf16"),
    (["DIST.STRATEGY", "fsdp", "TRAIN.FREEZE_BACKBONE_EPOCHS", "1"], 2, "not fsdp (its shards"),
    (["DIST.STRATEGY", "ddp", "DIST.CPU_OFFLOAD", "True"], 2, "DIST.CPU_OFFLOAD True needs DIST.STRATEGY fsdp"),
    (["DIST.STRATEGY", "dp"], 2, "dp is ONE process driving all local GPUs, but 2 processes"),
])
def test_a_strategy_refuses_what_it_cannot_train(opts, world, message):
    from distribuuuu import strategies

    cfg = make_cfg(*opts, base=TINY)
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        strategies.strategy_class(cfg.DIST.STRATEGY).check_config(cfg, world)


def test_what_a_strategy_allows_passes_its_check_and_dp_alone_stays_dp():
    from distribuuuu import strategies

    for opts, world in ((["DIST.STRATEGY", "fsdp", "DIST.CPU_OFFLOAD", "True"], 2), (["DIST.STRATEGY", "dp"], 1),
                        (["DIST.STRATEGY", "zero1", "TRAIN.EMA_DECAY", "0.9"], 2)):
        cfg = make_cfg(*opts, base=TINY)
        strategies.strategy_class(cfg.DIST.STRATEGY).check_config(cfg, world)
    assert [strategies.resolve(n, False) for n in ("ddp", "fsdp", "dp")] == ["single", "single", "dp"]
    assert [strategies.resolve(n, True) for n in ("ddp", "zero1", "fsdp")] == ["ddp", "zero1", "fsdp"]


def test_every_strategy_the_config_allows_is_in_the_registry():
    """DIST.STRATEGY's choices (config/validate.py) are the registry: ddp, the default, and single
    (the base class) are built into strategies/__init__.py (no module of their name);
    strategy_class imports the module of any other."""
    import importlib.util

    from distribuuuu import strategies
    from distribuuuu.config.validate import STRATEGIES

    assert set(strategies.BUILT_IN) == {"single", "ddp"}  # defined in strategies/__init__.py
    assert importlib.util.find_spec("distribuuuu.strategies.ddp") is None
    for name in (*STRATEGIES, "single"):
        cls = strategies.strategy_class(name)
        module = "distribuuuu.strategies" if name in strategies.BUILT_IN else f"distribuuuu.strategies.{name}"
        assert issubclass(cls, strategies.Strategy) and cls.name == name and cls.__module__ == module

"""Training options of issue #5: accumulation, AMP, EMA, mixup, clipping, optimizers, early stopping."""

import pytest
import torch

from distribuuuu import optim
from distribuuuu.config import load_config
from distribuuuu.stepper import Stepper, ema_decay_per_step
from tests.helpers import TINY, check, distribuuuu, read_metrics, torchrun

CPU = torch.device("cpu")


def _net():
    """No BatchNorm: with BN, two half batches see other statistics than one full batch."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 6 * 6, 4))


def _cfg(*opts):
    return load_config(None, ["MODEL.NUM_CLASSES", "4", "TRAIN.TOPK", "2", "OPTIM.MOMENTUM", "0.0",
                              "OPTIM.NESTEROV", "False", "OPTIM.WEIGHT_DECAY", "0.0", *opts])


def _one_step(cfg, batches):
    model = _net()
    opt = optim.build_optimizer(cfg, model)
    stepper = Stepper(cfg, CPU, model, opt, global_batch=16)
    outs = [stepper.micro_step(x, y) for x, y in batches]
    return model, outs


def test_accumulating_two_half_batches_equals_one_full_batch():
    torch.manual_seed(1)
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,))
    full, outs_full = _one_step(_cfg(), [(x, y)])
    accum, outs = _one_step(_cfg("TRAIN.ACCUM_STEPS", "2"), [(x[:8], y[:8]), (x[8:], y[8:])])
    assert [o.stepped for o in outs] == [None, True] and outs_full[0].stepped is True
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
    assert outs[0].stepped is True


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


def test_fp16_with_grad_scaler_checkpoints_and_resumes(tmp_path):
    out = str(tmp_path / "run")
    check(distribuuuu("train", "--cfg", TINY, "OUT_DIR", out, "TRAIN.AMP", "fp16", "OPTIM.MAX_EPOCH", "1"))
    scale = torch.load(f"{out}/checkpoints/last.pth", weights_only=True)["scaler"]["scale"]
    assert scale > 0
    proc = check(distribuuuu("train", "--cfg", TINY, "OUT_DIR", out, "TRAIN.AMP", "fp16"))
    assert "resumed from" in proc.stdout


def test_patience_stops_early_and_target_records_time_to_accuracy(tmp_path):
    out = str(tmp_path / "patience")
    proc = check(distribuuuu("train", "--cfg", TINY, "OUT_DIR", out, "OPTIM.MAX_EPOCH", "6",
                             "OPTIM.BASE_LR", "1e-6", "TRAIN.PATIENCE", "1", "OPTIM.LR_POLICY", "constant"))
    assert "early stop: no better top1 in 1 evaluations" in proc.stdout
    assert len([m for m in read_metrics(out) if m["split"] == "train"]) < 6
    out = str(tmp_path / "target")
    proc = check(distribuuuu("train", "--cfg", TINY, "OUT_DIR", out, "OPTIM.MAX_EPOCH", "6", "TRAIN.TARGET_TOP1", "90"))
    hit = [m for m in read_metrics(out) if "time_to_target_s" in m]
    assert len(hit) == 1 and hit[0]["top1"] >= 90 and hit[0]["time_to_target_s"] > 0
    assert "target top-1 90% reached" in proc.stdout


def test_torch_compile_runs_and_logs_compile_time_apart(tmp_path):
    out = str(tmp_path / "run")
    proc = check(distribuuuu("train", "--cfg", TINY, "OUT_DIR", out, "OPTIM.MAX_EPOCH", "1", "TRAIN.COMPILE", "True"),)
    assert "torch.compile + first step" in proc.stdout
    assert read_metrics(out)[-1]["n"] == 50

"""Fine-tuning: weights of another head, MODEL.PRETRAINED PATH, a frozen backbone, a backbone LR scale.

In process: real weights files (a real training checkpoint among them) and real training runs on the
synthetic tiny config; one e2e test runs the installed command with 2 DDP processes from a folder
outside the repository.
"""

import logging
import os
import subprocess
import sys

import pytest
import safetensors.torch
import torch
import torch.nn as nn
import torch.nn.functional as F
from yacs.config import CfgNode

from distribuuuu import engine, heads, models, optim
from distribuuuu.config import get_defaults, merge_text
from distribuuuu.errors import UserError
from distribuuuu.model_card import from_checkpoint
from distribuuuu.weights import adapt_input_channels, load_checkpoint
from tests.conftest import (
    ROOT,
    TINY,
    check,
    cli_main,
    env,
    fit,
    make_cfg,
    process_state_restored,
    write_image_tree,
)

torch.set_num_threads(1)


def _build(*opts, new_head=True):
    return models.build_model(make_cfg("MODEL.ARCH", "resnet_tiny", "TRAIN.TOPK", "2", *opts), new_head=new_head)


def _train_cfg(tmp_path, name, *opts):
    """TINY into tmp_path/name, with the one-epoch warmup this module's schedules are checked against."""
    return make_cfg("OUT_DIR", tmp_path / name, "TRAIN.PRINT_FREQ", "100", "OPTIM.WARMUP_EPOCHS", "1", *opts,
                    base=TINY)


def _head_lines(caplog):
    return [r.getMessage() for r in caplog.records if "re-initialised" in r.getMessage()]


@pytest.fixture(scope="module")
def source_ckpt(tmp_path_factory):
    """A real distribuuuu checkpoint: synthetic_tiny (4 classes) trained for one epoch."""
    tmp = tmp_path_factory.mktemp("source")
    fit(_train_cfg(tmp, "src", "OPTIM.MAX_EPOCH", "1"))
    return str(tmp / "src" / "checkpoints" / "last.pth")


def _source_state(path):
    return models.strip_wrapper_prefixes(load_checkpoint(path)["model"])


def _backbone(state):
    return {k: v.clone() for k, v in state.items() if not k.startswith("fc.")}


# ---------------------------------------------------------------------------------------------
# Finding the head
# ---------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:The default weight initialization of GoogleNet")
@pytest.mark.parametrize("arch, expected", [
    ("resnet_tiny", ["fc"]),                          # timm's ResNet class built directly: get_classifier()
    ("resnet10t", ["fc"]),                            # timm: pretrained cfg 'classifier'
    ("mobilenet_v3_small", ["classifier.3"]),         # torchvision: last Linear of `classifier`
    ("googlenet", ["fc", "aux1.fc2", "aux2.fc2"]),    # torchvision: auxiliary heads of the same width
])
def test_head_layers_are_found_and_score_the_classes(arch, expected):
    model = models.build_model(make_cfg("MODEL.ARCH", arch, "MODEL.NUM_CLASSES", "7"))
    assert heads.head_layers(model) == expected
    for name in expected:
        layer = model.get_submodule(name)
        assert (layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels) == 7
    backbone, head = heads.split_parameters(model)
    assert len(head) == 2 * len(expected) and len(backbone) + len(head) == len(list(model.parameters()))


def test_a_model_without_a_classifier_cannot_be_split():
    with pytest.raises(UserError, match="cannot find the classifier"):
        heads.split_parameters(nn.Sequential(nn.BatchNorm1d(3)))


# ---------------------------------------------------------------------------------------------
# MODEL.WEIGHTS and MODEL.PRETRAINED PATH
# ---------------------------------------------------------------------------------------------
def _save(obj_kind, state, path):
    if obj_kind == "safetensors":
        safetensors.torch.save_file(state, str(path))
        return
    obj = {"bare": state, "state_dict": {"state_dict": state, "epoch": 9}, "model": {"model": state}}[obj_kind]
    torch.save(obj, path)


@pytest.mark.parametrize("kind, suffix", [("checkpoint", ".pth"), ("bare", ".pt"), ("state_dict", ".pth"),
                                          ("model", ".pth"), ("safetensors", ".safetensors")])
def test_weights_of_another_head_load_and_reinitialise_it_with_one_line(tmp_path, caplog, source_ckpt, kind, suffix):
    state = _source_state(source_ckpt)
    path = source_ckpt if kind == "checkpoint" else str(tmp_path / f"w{suffix}")
    if kind != "checkpoint":
        _save(kind, state, path)
    with caplog.at_level(logging.INFO, logger="distribuuuu"):
        model = _build("MODEL.NUM_CLASSES", "6", "MODEL.SMALL_STEM", "True", "MODEL.WEIGHTS", path)
    lines = _head_lines(caplog)
    assert len(lines) == 1, lines
    assert "classifier fc" in lines[0] and "(4 classes in the file, 6 in the model)" in lines[0]
    got = model.state_dict()
    assert got["fc.weight"].shape == (6, 128)
    for key, value in _backbone(state).items():
        assert torch.equal(got[key], value), key


def test_same_head_loads_everything_without_the_line(caplog, source_ckpt):
    with caplog.at_level(logging.INFO, logger="distribuuuu"):
        model = _build("MODEL.NUM_CLASSES", "4", "MODEL.SMALL_STEM", "True", "MODEL.WEIGHTS", source_ckpt)
    assert not _head_lines(caplog)
    assert torch.equal(model.fc.weight, _source_state(source_ckpt)["fc.weight"])


def test_pretrained_path_always_starts_a_new_head_and_adapts_the_stem(caplog, source_ckpt):
    state = _source_state(source_ckpt)
    with caplog.at_level(logging.INFO, logger="distribuuuu"):
        model = _build("MODEL.NUM_CLASSES", "4", "MODEL.SMALL_STEM", "True", "MODEL.IN_CHANS", "1",
                       "MODEL.PRETRAINED", source_ckpt, new_head=False)
    lines = _head_lines(caplog)
    assert len(lines) == 1 and "(4 classes in the file, 4 in the model" in lines[0] and "new task" in lines[0]
    got = model.state_dict()
    assert not torch.equal(got["fc.weight"], state["fc.weight"])  # same shape, fresh anyway
    assert torch.allclose(got["conv1.weight"], state["conv1.weight"].sum(1, keepdim=True))  # 3 -> 1 channel
    assert torch.equal(got["layer4.0.conv2.weight"], state["layer4.0.conv2.weight"])


def test_eval_refuses_another_head_and_training_refuses_other_mismatches(tmp_path, source_ckpt, caplog):
    with pytest.raises(UserError, match=r"fc.weight has shape \(4, 128\) in the file but \(6, 128\) in the model; "
                                        r"set MODEL.NUM_CLASSES 4"):
        _build("MODEL.NUM_CLASSES", "6", "MODEL.SMALL_STEM", "True", "MODEL.WEIGHTS", source_ckpt, new_head=False)
    state = _source_state(source_ckpt)
    torch.save(state, tmp_path / "bare.pt")  # no model card: a checkpoint's card would supply its SMALL_STEM
    with pytest.raises(UserError, match=r"missing from the file: conv1.0.weight.*not in the model: conv1.weight"):
        _build("MODEL.NUM_CLASSES", "6", "MODEL.WEIGHTS", str(tmp_path / "bare.pt"))  # no SMALL_STEM: the deep stem
    broken = dict(state)
    broken.pop("layer2.0.conv1.weight")
    broken["extra.weight"] = torch.zeros(2)
    torch.save(broken, tmp_path / "broken.pt")
    with pytest.raises(UserError, match=r"missing from the file: layer2.0.conv1.weight.*not in the model: extra"):
        _build("MODEL.NUM_CLASSES", "6", "MODEL.SMALL_STEM", "True", "MODEL.WEIGHTS", str(tmp_path / "broken.pt"))
    narrow = dict(state, **{"layer4.0.bn1.weight": torch.ones(64)})  # a shape outside the head
    torch.save(narrow, tmp_path / "narrow.pt")
    with pytest.raises(UserError, match=r"layer4.0.bn1.weight has shape \(64\) in the file but \(128\)"):
        _build("MODEL.NUM_CLASSES", "6", "MODEL.SMALL_STEM", "True", "MODEL.WEIGHTS", str(tmp_path / "narrow.pt"))
    assert not _head_lines(caplog)  # a refused file logs no "re-initialised" line
    proc = cli_main("train", "--cfg", TINY, "OUT_DIR", str(tmp_path / "r"), "MODEL.NUM_CLASSES", "6",
                    "MODEL.WEIGHTS", str(tmp_path / "narrow.pt"))
    assert proc.returncode == 2 and "layer4.0.bn1.weight has shape" in proc.stderr


def test_cli_exits_2_on_a_bad_pretrained_value_or_file(tmp_path):
    proc = cli_main("train", "--cfg", TINY, "OUT_DIR", str(tmp_path / "r"), "MODEL.PRETRAINED", str(tmp_path / "no.pt"))
    assert proc.returncode == 2 and "MODEL.PRETRAINED" in proc.stderr and "does not exist" in proc.stderr
    proc = cli_main("config", "--cfg", TINY, "MODEL.PRETRAINED", "true")
    assert proc.returncode == 2 and "write True or False" in proc.stderr
    proc = cli_main("config", "--cfg", TINY, "MODEL.PRETRAINED", "3")
    assert proc.returncode == 2 and "expects a bool or a str" in proc.stderr
    proc = cli_main("config", "--cfg", TINY, "MODEL.PRETRAINED", str(tmp_path / "x.pt"))
    assert proc.returncode == 0 and str(tmp_path / "x.pt") in proc.stdout
    for opts, words in ((["TRAIN.FREEZE_BACKBONE_EPOCHS", "-2"], "-1 to keep"),
                        (["OPTIM.BACKBONE_LR_SCALE", "0.0"], "must be positive"),
                        (["TRAIN.FREEZE_BACKBONE_EPOCHS", "1", "DIST.STRATEGY", "fsdp"], "not fsdp"),
                        (["TRAIN.FREEZE_BACKBONE_EPOCHS", "1", "DIST.STATIC_GRAPH", "True"], "STATIC_GRAPH False")):
        proc = cli_main("config", "--cfg", TINY, *opts)
        assert proc.returncode == 2 and words in proc.stderr, (opts, proc.stderr)


# ---------------------------------------------------------------------------------------------
# Across channels (#27): 1-channel weights onto an RGB stem and back; any other mismatch is exit 2
# ---------------------------------------------------------------------------------------------
# Image folders of 8 px, one epoch; MODEL.NUM_CLASSES and TRAIN.TOPK left at their defaults.
FOLDER_RUN = ["MODEL.ARCH", "resnet_tiny", "TRAIN.IM_SIZE", "8", "OPTIM.MAX_EPOCH", "1", "OPTIM.WARMUP_EPOCHS", "0",
              "TRAIN.BATCH_SIZE", "4", "TEST.BATCH_SIZE", "4", "TRAIN.WORKERS", "0", "NUM_THREADS", "1",
              "DEVICE", "cpu", "TRAIN.PRINT_FREQ", "100", "RNG_SEED", "0"]


def _folder(root, mode: str, classes: list[str]) -> str:
    write_image_tree(str(root), "train", dict.fromkeys(classes, 4), mode=mode, size=(8, 8))
    write_image_tree(str(root), "val", dict.fromkeys(classes, 2), mode=mode, size=(8, 8))
    return str(root)


@pytest.fixture(scope="module")
def gray_ckpt(tmp_path_factory):
    """A 1-channel checkpoint: 4 classes of gray images (as the mnist5k export), MODEL.IN_CHANS 1."""
    tmp = tmp_path_factory.mktemp("gray")
    digits = _folder(tmp / "digits", "L", ["0", "1", "2", "3"])
    with process_state_restored():  # module scope: outside each test's own restoring
        check(cli_main("train", *FOLDER_RUN, "TRAIN.DATASET", digits, "MODEL.IN_CHANS", "1", "OUT_DIR", str(tmp / "run")))
    return str(tmp / "run" / "checkpoints" / "last.pth")


def _trained(run) -> tuple[dict, object, CfgNode]:
    ckpt = load_checkpoint(str(run / "checkpoints" / "last.pth"))
    cfg = get_defaults()
    merge_text(cfg, ckpt["cfg"], "the checkpoint")
    return models.strip_wrapper_prefixes(ckpt["model"]), from_checkpoint(ckpt), cfg


def test_a_1_channel_checkpoint_fine_tunes_onto_3_rgb_classes_and_back(tmp_path, gray_ckpt):
    rgb = _folder(tmp_path / "pets", "RGB", ["cat", "dog", "owl"])
    proc = check(cli_main("train", *FOLDER_RUN, "TRAIN.DATASET", rgb, "MODEL.WEIGHTS", gray_ckpt,
                          "MODEL.IN_CHANS", "3", "OUT_DIR", str(tmp_path / "rgb")))  # 3 set: not the card's 1
    out = proc.stdout + proc.stderr
    assert "conv1.0.weight adapted from 1 to 3 input channels" in out
    assert "the classifier fc is re-initialised (4 classes in the file, 3 in the model)" in out
    state, card, cfg = _trained(tmp_path / "rgb")
    assert state["conv1.0.weight"].shape[1] == 3 and state["fc.weight"].shape[0] == 3  # 3-channel stem, 3-way head
    assert card.classes == ["cat", "dog", "owl"] and card.in_chans == 3
    assert (cfg.MODEL.NUM_CLASSES, cfg.TRAIN.TOPK) == (3, 2)  # followed the folder; TOPK 5 clamped below 3
    # And back: the RGB run's weights onto the gray images, a 1-channel stem and a 4-way head again.
    digits = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(gray_ckpt))), "digits")
    proc = check(cli_main("train", *FOLDER_RUN, "TRAIN.DATASET", digits, "MODEL.IN_CHANS", "1",
                          "MODEL.WEIGHTS", str(tmp_path / "rgb" / "checkpoints" / "last.pth"),
                          "OUT_DIR", str(tmp_path / "gray")))
    assert "conv1.0.weight adapted from 3 to 1 input channels" in proc.stdout + proc.stderr
    state, card, _ = _trained(tmp_path / "gray")
    assert state["conv1.0.weight"].shape[1] == 1 and card.classes == ["0", "1", "2", "3"]


def test_pretrained_file_of_1_channel_is_adapted_onto_the_rgb_stem(gray_ckpt):
    """MODEL.PRETRAINED FILE (it used to end in a size-mismatch traceback): the stem exactly as
    adapt_input_channels makes it, every other tensor but the head as in the file."""
    source = _source_state(gray_ckpt)
    model = models.build_model(make_cfg("MODEL.ARCH", "resnet_tiny", "MODEL.NUM_CLASSES", "3", "TRAIN.TOPK", "3",
                                        "MODEL.PRETRAINED", gray_ckpt))
    got = model.state_dict()
    assert torch.equal(got["conv1.0.weight"], adapt_input_channels(source["conv1.0.weight"], 3))
    assert torch.equal(got["layer4.0.conv2.weight"], source["layer4.0.conv2.weight"])


@pytest.mark.parametrize("have, want", [(1, 3), (3, 1), (1, 4), (4, 1)])
def test_an_adapted_stem_answers_a_gray_image_as_before(have, want):
    conv = nn.Conv2d(have, 8, 3)
    weight = adapt_input_channels(conv.weight.detach(), want)
    assert weight.shape == (8, want, 3, 3)
    gray = torch.rand(2, 1, 8, 8)
    before = F.conv2d(gray.expand(-1, have, -1, -1), conv.weight)
    assert torch.allclose(F.conv2d(gray.expand(-1, want, -1, -1), weight), before, atol=1e-5)


@pytest.mark.parametrize("key, name, layer, shapes", [
    ("MODEL.WEIGHTS", "narrow", "layer4.0.bn1.weight", "(64) in the file but (128) in the model"),
    ("MODEL.PRETRAINED", "narrow", "layer4.0.bn1.weight", "(64) in the file but (128) in the model"),
    # 1 channel but 24 filters: not a 1 <-> 3 adaptation (MODEL.PRETRAINED keeps such a stem as initialised)
    ("MODEL.WEIGHTS", "wide_stem", "conv1.weight", "(24, 1, 3, 3) in the file but (16, 3, 3, 3) in the model"),
])
def test_another_shape_mismatch_is_exit_2_naming_the_layer_and_both_shapes(tmp_path, source_ckpt, key, name, layer,
                                                                           shapes):
    state = _source_state(source_ckpt)
    changed = {"narrow": {"layer4.0.bn1.weight": torch.ones(64)}, "wide_stem": {"conv1.weight": torch.ones(24, 1, 3, 3)}}
    torch.save(dict(state, **changed[name]), tmp_path / "w.pt")
    proc = cli_main("train", "--cfg", TINY, "OUT_DIR", str(tmp_path / "r"), "MODEL.NUM_CLASSES", "6",
                    key, str(tmp_path / "w.pt"))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"layer {layer} has shape {shapes}" in errors[0], errors[0]


# ---------------------------------------------------------------------------------------------
# Two LR groups
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("no_wd", [False, True])
def test_backbone_lr_scale_makes_groups_that_follow_the_schedule(no_wd):
    cfg = make_cfg("MODEL.ARCH", "resnet_tiny", "OPTIM.BACKBONE_LR_SCALE", "0.1", "OPTIM.NO_WD_NORM_BIAS", str(no_wd),
                   "OPTIM.WARMUP_EPOCHS", "2", "OPTIM.MAX_EPOCH", "10")
    model = models.build_model(cfg)
    opt = optim.build_optimizer(cfg, model)
    head = {id(p) for p in model.fc.parameters()}
    assert len(opt.param_groups) == (4 if no_wd else 2)
    for g in opt.param_groups:
        in_head = {id(p) in head for p in g["params"]}
        assert len(in_head) == 1 and g["lr_scale"] == (1.0 if in_head.pop() else 0.1)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    schedule = optim.Schedule(cfg, 0.4)
    for epoch in (0.0, 0.5, 1.9, 2.0, 6.3, 9.99):  # warmup, then cosine
        lr = schedule.apply(opt, epoch)
        for g in opt.param_groups:
            assert g["lr"] == pytest.approx(lr * g["lr_scale"], rel=1e-12)
    default = make_cfg("MODEL.ARCH", "resnet_tiny")
    groups = optim.build_optimizer(default, models.build_model(default)).param_groups
    assert len(groups) == 1 and "lr_scale" not in groups[0]  # as before the key existed: old checkpoints resume


def test_zero1_takes_the_groups_and_keeps_their_ratio(tmp_path):
    import torch.distributed as dist

    from distribuuuu.strategies import zero1

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    cfg = make_cfg("MODEL.ARCH", "resnet_tiny", "MODEL.NUM_CLASSES", "4", "TRAIN.TOPK", "2",
                   "OPTIM.BACKBONE_LR_SCALE", "0.25")
    model = models.build_model(cfg)
    opt = zero1.Zero1(cfg, None).build_optimizer(model)
    for group in opt.param_groups:  # what the schedule does at LR 0.08
        group["lr"] = 0.08 * group["lr_scale"]
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    before = model.fc.weight.detach().clone()
    opt.step()
    assert not torch.equal(model.fc.weight, before)
    assert sorted(g["lr"] for g in opt.optim.param_groups) == pytest.approx([0.02, 0.08])  # the local shard's


# ---------------------------------------------------------------------------------------------
# Freezing, resume
# ---------------------------------------------------------------------------------------------
class Snapshots(engine.HookBase):
    """After each epoch: the backbone's state (parameters and BatchNorm statistics), the head, and
    which backbone parameters required a gradient during it; the optimizer's LRs."""

    def __init__(self):
        self.backbone, self.head, self.grad, self.lrs = [], [], [], []

    def after_step(self, trainer, step, printed):
        net = models.unwrap(trainer.model)
        self.step_grad = any(p.requires_grad for p in heads.split_parameters(net)[0])

    def after_epoch(self, trainer, metrics):
        state = models.unwrap(trainer.model).state_dict()
        self.backbone.append(_backbone(state))
        self.head.append(state["fc.weight"].clone())
        self.grad.append(self.step_grad)
        self.lrs.append(sorted({g["lr"] for g in trainer.optimizer.param_groups}))


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_frozen_backbone_stays_exactly_as_loaded_then_trains(tmp_path, source_ckpt, caplog):
    loaded = _backbone(_source_state(source_ckpt))
    snaps = Snapshots()
    cfg = _train_cfg(tmp_path, "ft", "MODEL.NUM_CLASSES", "3", "MODEL.WEIGHTS", source_ckpt,
                     "TRAIN.FREEZE_BACKBONE_EPOCHS", "2", "OPTIM.MAX_EPOCH", "3", "OPTIM.WEIGHT_DECAY", "0.01")
    with caplog.at_level(logging.INFO, logger="distribuuuu"):
        fit(cfg, hooks=[snaps])
    assert [_same(s, loaded) for s in snaps.backbone] == [True, True, False]  # weights and BN statistics
    assert snaps.grad == [False, False, True]
    assert not torch.equal(snaps.head[0], snaps.head[1])  # the head trains while the backbone is frozen
    assert any("backbone frozen for epochs 1-2" in r.getMessage() for r in caplog.records)
    assert any("epoch 3: backbone unfrozen" in r.getMessage() for r in caplog.records)


def test_resume_in_the_frozen_phase_stays_frozen_then_unfreezes(tmp_path, source_ckpt, caplog):
    loaded = _backbone(_source_state(source_ckpt))
    opts = ["MODEL.NUM_CLASSES", "3", "MODEL.PRETRAINED", source_ckpt, "TRAIN.FREEZE_BACKBONE_EPOCHS", "2",
            "OPTIM.BACKBONE_LR_SCALE", "0.1"]
    fit(_train_cfg(tmp_path, "run", *opts, "OPTIM.MAX_EPOCH", "1"))  # stops inside the frozen phase
    first = load_checkpoint(str(tmp_path / "run" / "checkpoints" / "last.pth"))
    assert _same(_backbone(models.strip_wrapper_prefixes(first["model"])), loaded)
    assert [g["lr_scale"] for g in first["optimizer"]["param_groups"]] == [0.1, 1.0]
    snaps = Snapshots()
    package_log = logging.getLogger("distribuuuu")  # it does not propagate to caplog's root handler
    package_log.addHandler(caplog.handler)
    try:
        caplog.set_level(logging.INFO, logger="distribuuuu")
        caplog.clear()  # the first run's lines
        fit(_train_cfg(tmp_path, "run", *opts, "OPTIM.MAX_EPOCH", "3"), hooks=[snaps])  # resumes at epoch 2
    finally:
        package_log.removeHandler(caplog.handler)
    # The resumed run's weights come from its checkpoint: MODEL.PRETRAINED is not read again.
    assert "resumed from" in caplog.text and f"MODEL.PRETRAINED {source_ckpt}" not in caplog.text
    assert [_same(s, loaded) for s in snaps.backbone] == [True, False]
    assert snaps.grad == [False, True]
    for low, high in snaps.lrs:  # two groups, 0.1 apart, through the resumed schedule
        assert low == pytest.approx(0.1 * high)
    # The stored config names a MODEL.PRETRAINED path: it reads back as a --cfg file does (yacs's
    # own merge refuses a str over the default False), and the model it describes loads the weights.
    text = load_checkpoint(str(tmp_path / "run" / "checkpoints" / "last.pth"))["cfg"]
    with pytest.raises(ValueError, match="Type mismatch"):
        get_defaults().merge_from_other_cfg(CfgNode.load_cfg(text))
    cfg = get_defaults()
    merge_text(cfg, text, "the checkpoint's config")
    assert cfg.MODEL.PRETRAINED == source_ckpt and cfg.MODEL.NUM_CLASSES == 3


# ---------------------------------------------------------------------------------------------
# The installed command, 2 DDP processes, from a folder outside the repository
# ---------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_finetune_with_ddp_freezes_then_unfreezes_from_outside_the_repo(tmp_path, source_ckpt):
    loaded = _backbone(_source_state(source_ckpt))
    e = env()
    e["PYTHONPATH"] = ROOT  # this checkout's package, as the installed editable one
    proc = subprocess.run(
        [sys.executable, "-m", "distribuuuu", "train", "--cfg", "synthetic_tiny", "--nproc-per-node", "2",
         "OUT_DIR", "ft", "MODEL.NUM_CLASSES", "3", "MODEL.WEIGHTS", source_ckpt, "TRAIN.FREEZE_BACKBONE_EPOCHS", "1",
         "OPTIM.BACKBONE_LR_SCALE", "0.1", "TRAIN.SYNTHETIC_SAMPLES", "64", "TEST.SYNTHETIC_SAMPLES", "32"],
        cwd=tmp_path, env=e, capture_output=True, text=True, timeout=240)
    check(proc)
    out = proc.stdout + proc.stderr
    assert out.count("classifier fc is re-initialised (4 classes in the file, 3 in the model)") == 2  # per rank
    assert "find_unused_parameters on" in out and "epoch 2: backbone unfrozen" in out
    states = [models.strip_wrapper_prefixes(load_checkpoint(str(tmp_path / "ft" / "checkpoints" / f"epoch_000{e}.pth"))
                                            ["model"]) for e in (1, 2)]
    assert _same(_backbone(states[0]), loaded)  # frozen on both ranks through DDP's all-reduce
    assert not _same(_backbone(states[1]), loaded)
    assert states[0]["fc.weight"].shape == (3, 128) and not torch.equal(states[0]["fc.weight"], states[1]["fc.weight"])
    assert os.path.isfile(tmp_path / "ft" / "config.yaml")

"""The models (distribuuuu/models.py): names, heads, stems, and safe weight loading (CPU, tiny inputs)."""

import os

import pytest
import safetensors.torch
import torch
import torch.nn as nn

from distribuuuu import models
from distribuuuu.errors import UserError
from distribuuuu.weights import load_checkpoint
from tests.conftest import make_cfg

torch.set_num_threads(1)

BASELINES = ["resnet18", "resnet50", "botnet50", "efficientnet_b0", "regnetx_160", "regnety_160", "regnety_320"]


def build(arch="resnet18", *opts):
    return models.build_model(make_cfg("MODEL.ARCH", arch, *opts))


def last_linear(model):
    return [m for m in model.modules() if isinstance(m, nn.Linear)][-1]


@pytest.mark.parametrize("arch", BASELINES)
def test_baselines_have_the_asked_head(arch):
    # BoTNet's attention is sized for TRAIN.IM_SIZE: build it for 64 px so a forward stays cheap.
    size = 64 if arch == "botnet50" else 32
    model = build(arch, "MODEL.NUM_CLASSES", "7", "TRAIN.IM_SIZE", str(size)).eval()
    assert last_linear(model).out_features == 7
    with torch.no_grad():
        assert model(torch.randn(2, 3, size, size)).shape == (2, 7)


def test_aliases_resolve_to_the_expected_library():
    assert models.resolve_arch("resnet18") == ("torchvision", "resnet18")
    assert models.resolve_arch("regnety_320") == ("timm", "regnety_320")
    assert models.resolve_arch("botnet50") == ("timm", "botnet50ts_256")
    assert models.resolve_arch("resnet_tiny")[0] == "tiny"


def test_timm_only_and_torchvision_only_names_build():
    tv = build("mobilenet_v3_small", "MODEL.NUM_CLASSES", "7")  # not a timm name
    assert isinstance(tv, __import__("torchvision").models.MobileNetV3)
    assert last_linear(tv).out_features == 7
    tm = build("resnet10t", "MODEL.NUM_CLASSES", "7", "MODEL.IN_CHANS", "1")  # not a torchvision name
    assert tm.get_classifier().out_features == 7
    with torch.no_grad():
        assert tm.eval()(torch.randn(2, 1, 32, 32)).shape == (2, 7)


def test_unknown_name_suggests_a_close_one():
    with pytest.raises(UserError, match=r"unknown MODEL.ARCH 'resnt18' \(did you mean resnet18"):
        build("resnt18")


@pytest.mark.parametrize("arch", ["resnet18", "resnet_tiny"])
def test_one_channel_small_stem(arch):
    model = build(arch, "MODEL.NUM_CLASSES", "10", "MODEL.IN_CHANS", "1", "MODEL.SMALL_STEM", "True")
    assert model.conv1.stride == (1, 1) and model.conv1.kernel_size == (3, 3)
    assert model.conv1.in_channels == 1
    assert isinstance(model.maxpool, nn.Identity)
    x = torch.randn(2, 1, 28, 28)
    out = model(x)
    assert out.shape == (2, 10)
    out.sum().backward()  # the new stem is wired into the graph
    assert model.conv1.weight.grad is not None


def test_tiny_models_widths_and_classes():
    tiny = build("resnet_tiny", "MODEL.NUM_CLASSES", "10")
    mini = build("resnet_mini", "MODEL.NUM_CLASSES", "10", "MODEL.IN_CHANS", "1")
    assert tiny.fc.in_features == 128 and tiny.fc.out_features == 10
    assert mini.fc.in_features == 256 and mini.conv1[0].in_channels == 1
    assert models.count_parameters(tiny) < models.count_parameters(mini) < 2_000_000


def test_torchvision_in_chans_replaces_the_rgb_conv():
    model = build("efficientnet_b0", "MODEL.IN_CHANS", "1", "MODEL.NUM_CLASSES", "7").eval()
    with torch.no_grad():
        assert model(torch.randn(2, 1, 32, 32)).shape == (2, 7)


def test_small_stem_outside_the_resnet_family_is_a_user_error():
    with pytest.raises(UserError, match="SMALL_STEM True supports the ResNet family only"):
        build("efficientnet_b0", "MODEL.SMALL_STEM", "True")


def test_syncbn_conversion_keeps_timm_fused_activations():
    model = models.convert_syncbn(build("regnetx_002", "MODEL.NUM_CLASSES", "7"))
    kinds = {type(m).__name__ for m in model.modules()}
    assert "BatchNormAct2d" not in kinds and "SyncBatchNormAct" in kinds
    tv = models.convert_syncbn(build("resnet_tiny"))
    assert not any(type(m) is nn.BatchNorm2d for m in tv.modules())


def test_unwrap_and_state_dict_for_saving():
    model = build("resnet_tiny", "MODEL.NUM_CLASSES", "10")
    wrapped = nn.DataParallel(model)  # on the CPU it only adds the ".module" level, like DDP
    assert models.unwrap(wrapped) is model
    assert models.unwrap(nn.DataParallel(torch.compile(model))) is model  # compile wraps lazily: cheap
    assert list(wrapped.state_dict())[0].startswith("module.")
    assert list(models.state_dict_for_saving(wrapped)) == list(model.state_dict())
    assert models.count_parameters(wrapped) == sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# load_weights
# ---------------------------------------------------------------------------------------------
def assert_same_tensors(a: dict, b: dict, skip=()):
    keys = [k for k in a if not k.startswith(skip)] if skip else list(a)
    assert keys and all(torch.equal(a[k], b[k]) for k in keys)


@pytest.mark.parametrize("container", ["checkpoint", "state_dict", "bare"])
def test_round_trip_through_a_ddp_like_wrapper(tmp_path, container):
    src = build("resnet_tiny", "MODEL.NUM_CLASSES", "10")
    state = nn.DataParallel(src).state_dict()  # keys start with "module."
    obj = {"checkpoint": {"model": state, "epoch": 3}, "state_dict": {"state_dict": state}, "bare": state}[container]
    path = tmp_path / "w.pth"
    torch.save(obj, path)
    dst = build("resnet_tiny", "MODEL.NUM_CLASSES", "10")
    assert not torch.equal(dst.fc.weight, src.fc.weight)
    models.load_weights(dst, str(path))
    assert_same_tensors(src.state_dict(), dst.state_dict())


def test_compiled_prefix_is_stripped(tmp_path):
    src = build("resnet_tiny")
    torch.save({"_orig_mod." + k: v for k, v in src.state_dict().items()}, tmp_path / "c.pth")
    dst = build("resnet_tiny")
    models.load_weights(dst, str(tmp_path / "c.pth"))
    assert_same_tensors(src.state_dict(), dst.state_dict())


def test_weights_via_config(tmp_path):
    src = build("resnet_tiny", "MODEL.NUM_CLASSES", "10")
    torch.save(src.state_dict(), tmp_path / "w.pth")
    dst = build("resnet_tiny", "MODEL.NUM_CLASSES", "10", "MODEL.WEIGHTS", str(tmp_path / "w.pth"),
                "MODEL.PRETRAINED", "True")  # WEIGHTS wins; no pretrained file is looked up
    assert_same_tensors(src.state_dict(), dst.state_dict())


def test_head_size_mismatch_names_num_classes(tmp_path):
    torch.save(build("resnet_tiny", "MODEL.NUM_CLASSES", "10").state_dict(), tmp_path / "w.pth")
    dst = build("resnet_tiny", "MODEL.NUM_CLASSES", "7")
    with pytest.raises(UserError, match=r"fc.weight has shape \(10, 128\) in the file but \(7, 128\) "
                                        r"in the model; set MODEL.NUM_CLASSES 10 to match"):
        models.load_weights(dst, str(tmp_path / "w.pth"))
    before = dst.fc.weight.clone()
    models.load_weights(dst, str(tmp_path / "w.pth"), allow_head_mismatch=True)
    assert torch.equal(dst.fc.weight, before)  # the head keeps its fresh init


def test_other_architecture_is_a_user_error(tmp_path):
    torch.save(build("resnet_mini").state_dict(), tmp_path / "mini.pth")
    with pytest.raises(UserError, match="has shape .* in the file but"):
        models.load_weights(build("resnet_tiny"), str(tmp_path / "mini.pth"))
    partial = build("resnet_tiny").state_dict()
    partial.pop("layer4.0.conv1.weight")
    partial["extra.weight"] = torch.zeros(1)
    torch.save(partial, tmp_path / "partial.pth")
    with pytest.raises(UserError, match=r"missing from the file: layer4.0.conv1.weight.*not in the model: extra"):
        models.load_weights(build("resnet_tiny"), str(tmp_path / "partial.pth"))


class _Evil:
    """Unpickling this would run a shell command (creating a marker file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_never_runs(tmp_path):
    """As MODEL.WEIGHTS and as a checkpoint to resume or evaluate (weights.load_checkpoint)."""
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pth"
    torch.save({"model": _Evil(marker)}, path)
    with pytest.raises(UserError, match="weights_only"):
        models.load_weights(build("resnet_tiny"), str(path))
    with pytest.raises(UserError, match="refused to load checkpoint"):
        load_checkpoint(str(path))
    assert not marker.exists()


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        models.load_weights(build("resnet_tiny"), str(tmp_path / "nope.pth"))
    (tmp_path / "junk.pth").write_bytes(b"not a torch file")
    with pytest.raises(UserError, match="cannot be read"):
        models.load_weights(build("resnet_tiny"), str(tmp_path / "junk.pth"))


def test_safetensors_file_loads(tmp_path):
    src = build("resnet_tiny", "MODEL.NUM_CLASSES", "10")
    safetensors.torch.save_file(src.state_dict(), str(tmp_path / "w.safetensors"))
    dst = build("resnet_tiny", "MODEL.NUM_CLASSES", "10")
    models.load_weights(dst, str(tmp_path / "w.safetensors"))
    assert_same_tensors(src.state_dict(), dst.state_dict())


# ---------------------------------------------------------------------------------------------
# PRETRAINED: local files only
# ---------------------------------------------------------------------------------------------
def test_pretrained_torchvision_from_local_file(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    expected = tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    with pytest.raises(UserError, match=f"put them at {expected}.*MODEL.WEIGHTS"):
        build("resnet18", "MODEL.PRETRAINED", "True", "MODEL.NUM_CLASSES", "10")
    expected.parent.mkdir(parents=True)
    imagenet = build("resnet18").state_dict()  # stands in for the 1000-class ImageNet file
    torch.save(imagenet, expected)
    model = build("resnet18", "MODEL.PRETRAINED", "True", "MODEL.NUM_CLASSES", "10")
    assert model.fc.out_features == 10
    assert_same_tensors(imagenet, model.state_dict(), skip=("fc.",))


def test_pretrained_adapts_the_stem_for_one_channel_and_small_stem(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    folder = tmp_path / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    imagenet = build("resnet18").state_dict()
    torch.save(imagenet, folder / "resnet18-f37072fd.pth")
    gray = build("resnet18", "MODEL.PRETRAINED", "True", "MODEL.IN_CHANS", "1")
    assert torch.allclose(gray.conv1.weight, imagenet["conv1.weight"].sum(1, keepdim=True))
    small = build("resnet18", "MODEL.PRETRAINED", "True", "MODEL.SMALL_STEM", "True")
    assert small.conv1.weight.shape == (64, 3, 3, 3)
    assert_same_tensors(imagenet, small.state_dict(), skip=("conv1.",))


def test_pretrained_timm_from_local_safetensors(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with pytest.raises(UserError, match=r"resnet10t\.safetensors"):
        build("resnet10t", "MODEL.PRETRAINED", "True")
    folder = tmp_path / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    imagenet = build("resnet10t").state_dict()
    safetensors.torch.save_file(imagenet, str(folder / "resnet10t.safetensors"))
    model = build("resnet10t", "MODEL.PRETRAINED", "True", "MODEL.NUM_CLASSES", "7")
    assert_same_tensors(imagenet, model.state_dict(), skip=("fc.",))

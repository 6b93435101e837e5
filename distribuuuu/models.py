"""Models by name, and where their first weights come from (the files
themselves: weights.py).

``build_model(cfg)`` resolves MODEL.ARCH (an alias below, else any
torchvision classification model, else any timm model), applies
NUM_CLASSES, IN_CHANS and SMALL_STEM, then loads weights from LOCAL
files only (WEIGHTS, else PRETRAINED: True or a path). It returns a
plain CPU module: the engine moves it to the device, converts BatchNorm
(``convert_syncbn``) and wraps it in DDP, in that order.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
import os
from collections.abc import Callable
from typing import Any

import timm
import timm.layers
import torch
import torch.nn as nn
import torchvision
from timm.models.resnet import BasicBlock
from timm.models.resnet import Bottleneck as TimmBottleneck
from timm.models.resnet import ResNet as TimmResNet

from distribuuuu import weights
from distribuuuu.config.user_modules import import_user_modules  # not the package (no cycle)
from distribuuuu.errors import UserError
from distribuuuu.weights import first_conv as _first_conv
from distribuuuu.weights import strip_wrapper_prefixes  # noqa: F401 -- models.strip_wrapper_prefixes, as callers write it

log = logging.getLogger("distribuuuu")

# MODEL.ARCH aliases -> (library, name there): Distribuuuu's baseline
# table, plus tiny CPU models.
ALIASES: dict[str, tuple[str, str]] = {
    "resnet18": ("torchvision", "resnet18"),
    "resnet50": ("torchvision", "resnet50"),
    "efficientnet_b0": ("torchvision", "efficientnet_b0"),
    "regnetx_160": ("timm", "regnetx_160"),
    "regnety_160": ("timm", "regnety_160"),
    "regnety_320": ("timm", "regnety_320"),
    "botnet50": ("timm", "botnet50ts_256"),  # ResNet-50 with self-attention in the last stage
    "resnet_tiny": ("tiny", "resnet_tiny"),
    "resnet_mini": ("tiny", "resnet_mini"),
}

# Stage widths of the tiny ResNets (one BasicBlock per stage), for CPU
# demos and tests.
TINY_WIDTHS: dict[str, tuple[int, int, int, int]] = {
    "resnet_tiny": (16, 32, 64, 128),
    "resnet_mini": (32, 64, 128, 256),
}


# ---------------------------------------------------------------------------------------------
# The user's own models: plain functions (num_classes, in_chans) ->
# nn.Module
# ---------------------------------------------------------------------------------------------
_USER_MODELS: dict[str, Callable[..., nn.Module]] = {}


def register_model(
    fn: Callable[..., nn.Module] | str | None = None, *, name: str | None = None
) -> Any:
    """Register a plain ``def my_net(num_classes, in_chans) ->
    nn.Module`` so that MODEL.ARCH names it.

    Use ``@register_model`` (the function's name) or
    ``@register_model("name")``, in a module that IMPORTS (or ``--import
    my_models.py``) names; no timm internals are involved (timm's own
    decorator makes create_model pass pretrained_cfg and other arguments
    such a function does not take). The function is called with
    keywords, and gets ``img_size`` too when it takes it. A checkpoint
    records the file the function lives in (IMPORTS as absolute paths,
    inferred/), so eval, predict, export and load_model find it from
    any folder. Registering a name of another function, or an alias, is
    a ValueError; the same function registered again (its module
    imported twice) replaces itself."""
    if isinstance(fn, str):
        return lambda f: register_model(f, name=fn)
    if fn is None:
        return lambda f: register_model(f, name=name)
    key = name or fn.__name__
    known = _USER_MODELS.get(key)
    if key in ALIASES or (known is not None and _where(known) != _where(fn)):
        owner = (
            "an alias of distribuuuu"
            if key in ALIASES
            else f"already registered by {_where(known)}"
        )
        raise ValueError(f"register_model: the model name {key!r} is {owner}; pick another name")
    _USER_MODELS[key] = fn
    return fn


def _where(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def user_model_file(arch: str) -> str | None:
    """The file of the module that defines the user's model arch (None:
    not a registered function, or one of the script being run: importing
    that file again would run the script again)."""
    fn = _USER_MODELS.get(arch)
    if fn is None or getattr(fn, "__module__", None) == "__main__":
        return None
    try:
        return os.path.abspath(inspect.getsourcefile(fn) or "")
    except TypeError:
        return None


def _build_user(name: str, num_classes: int, in_chans: int, im_size: int) -> nn.Module:
    fn = _USER_MODELS[name]
    kwargs: dict[str, Any] = {"num_classes": num_classes, "in_chans": in_chans}
    if "img_size" in inspect.signature(fn).parameters:
        kwargs["img_size"] = im_size
    model = fn(**kwargs)
    if not isinstance(model, nn.Module):
        raise UserError(
            f"MODEL.ARCH {name!r}: {_where(fn)} returned {type(model).__name__}, not a "
            "torch.nn.Module"
        )
    return model


# ---------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------
@functools.cache
def _torchvision_names() -> frozenset[str]:
    return frozenset(torchvision.models.list_models(module=torchvision.models))


@functools.cache
def _timm_names() -> frozenset[str]:
    return frozenset(timm.list_models())


def _check_timm_tag(arch: str) -> None:
    """A "name.tag" MODEL.ARCH must carry a tag of timm's own registry
    (no download): timm would otherwise stop with "Invalid pretrained
    tag" in every rank."""
    if "." not in arch:
        return
    name, tag = arch.split(".", 1)
    known = [n.split(".", 1)[1] for n in timm.models.get_arch_pretrained_cfgs(name) if "." in n]
    if tag not in known:
        tags = ", ".join(sorted(known)) if known else "none"
        raise UserError(
            f"MODEL.ARCH {arch!r}: timm has no pretrained tag {tag!r} for {name} (its tags: "
            f"{tags}); use one of those as {name}.TAG, or {name} alone for its default"
        )


def _unknown_arch(arch: str) -> UserError:
    """The error for a MODEL.ARCH that no library has, with the closest
    names."""
    known = sorted(set(ALIASES) | _torchvision_names() | _timm_names())
    close = difflib.get_close_matches(arch, known, n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    return UserError(
        f"unknown MODEL.ARCH {arch!r}{hint}; any torchvision or timm classification model name "
        f"works, or one of {', '.join(ALIASES)}, or a function registered with "
        "distribuuuu.models.register_model in a module that IMPORTS names"
    )


def resolve_arch(arch: str) -> tuple[str, str]:
    """MODEL.ARCH -> (library, name): an alias, a registered function,
    torchvision, then timm."""
    if arch in ALIASES:
        return ALIASES[arch]
    if arch in _USER_MODELS:
        return "user", arch
    if arch in _torchvision_names():
        return "torchvision", arch
    # timm also takes "name.pretrained_tag"; asked live: an IMPORTS
    # module may have registered the name since.
    if timm.is_model(arch.split(".", 1)[0]):
        _check_timm_tag(arch)
        return "timm", arch
    raise _unknown_arch(arch)


DEFAULT_SIZE = 224  # the input side of torchvision's ImageNet models and of the aliases


def default_size(arch: str) -> int:
    """The input side MODEL.ARCH is made for: timm's pretrained
    config's, else DEFAULT_SIZE (the ceiling of TRAIN.IM_SIZE when the
    images decide it: inferred/)."""
    lib, name = resolve_arch(arch)
    pretrained = timm.models.get_pretrained_cfg(name.split(".", 1)[0]) if lib == "timm" else None
    return int(pretrained.input_size[-1]) if pretrained is not None else DEFAULT_SIZE


# ---------------------------------------------------------------------------------------------
# Construction
# ---------------------------------------------------------------------------------------------
def _create_tiny(name: str, num_classes: int, in_chans: int, im_size: int) -> nn.Module:
    """A ResNet with one BasicBlock per stage of widths
    TINY_WIDTHS[name], built from timm's ResNet class.

    timm's plain 7x7 stem is always 64 wide, which would cost more than
    a 16-wide network; its 'deep' stem (3x3 convs of widths w/2, w/2, w)
    scales with the stage widths instead. zero_init_last=False here:
    MODEL.ZERO_INIT_RESIDUAL decides (init_residual_bn), as for every
    model.
    """
    widths = TINY_WIDTHS[name]
    return TimmResNet(
        BasicBlock,
        [1, 1, 1, 1],
        channels=widths,
        stem_type="deep",
        stem_width=widths[0] // 2,
        zero_init_last=False,
        num_classes=num_classes,
        in_chans=in_chans,
    )


def _create_timm(name: str, num_classes: int, in_chans: int, im_size: int) -> nn.Module:
    kwargs: dict[str, Any] = {"num_classes": num_classes, "in_chans": in_chans}
    pcfg = timm.models.get_pretrained_cfg(name.split(".", 1)[0])
    if pcfg is not None and pcfg.fixed_input_size:
        # Attention position embeddings (BoTNet, ViT, ...) are sized for
        # one input: ours.
        kwargs["img_size"] = im_size
    try:
        return timm.create_model(name, pretrained=False, **kwargs)
    except TypeError as e:
        if "img_size" not in str(e):
            raise
        del kwargs["img_size"]  # a fixed-size model that picks its size itself
        return timm.create_model(name, pretrained=False, **kwargs)


def _create_torchvision(name: str, num_classes: int, in_chans: int, im_size: int) -> nn.Module:
    kwargs: dict[str, Any] = {"weights": None, "num_classes": num_classes}
    # ViT and MaxViT build position embeddings / attention windows for
    # one input size.
    if name.startswith("vit_"):
        kwargs["image_size"] = im_size
    elif name.startswith("maxvit_"):
        kwargs["input_size"] = (im_size, im_size)
    model = torchvision.models.get_model(name, **kwargs)
    return model if in_chans == 3 else _with_in_chans(model, name, in_chans)


def _with_in_chans(model: nn.Module, name: str, in_chans: int) -> nn.Module:
    """torchvision has no in_chans argument: its RGB input conv swapped
    for one of in_chans inputs."""
    conv_name, conv = _first_conv(model)
    if conv.in_channels != 3 or conv.groups != 1:
        raise UserError(
            f"MODEL.IN_CHANS {in_chans} is not supported for {name}: its first convolution is not "
            "a plain 3-channel one; use MODEL.IN_CHANS 3"
        )
    new = nn.Conv2d(
        in_chans,
        conv.out_channels,
        conv.kernel_size,
        conv.stride,
        conv.padding,
        conv.dilation,
        bias=conv.bias is not None,
        padding_mode=conv.padding_mode,
    )
    model.set_submodule(conv_name, new)
    return model


def _use_small_stem(model: nn.Module, arch: str) -> None:
    """3x3 stride-1 first conv and no max-pool, so 28-32 px images keep
    their size into layer1."""
    if not isinstance(model, (torchvision.models.ResNet, TimmResNet)):
        raise UserError(
            "MODEL.SMALL_STEM True supports the ResNet family only (torchvision or timm ResNets "
            f"such as resnet18, resnet50, resnet_tiny), not MODEL.ARCH {arch}; set "
            "MODEL.SMALL_STEM False"
        )
    _, first = _first_conv(model.conv1)  # conv1 is a Sequential in timm's deep stems
    out_chans = model.bn1.num_features  # what the stem hands to layer1
    conv = nn.Conv2d(first.in_channels, out_chans, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(
        conv.weight, mode="fan_out", nonlinearity="relu"
    )  # as both libraries do
    model.conv1 = conv
    model.maxpool = nn.Identity()


_LAST_BN = {
    torchvision.models.resnet.BasicBlock: "bn2",
    torchvision.models.resnet.Bottleneck: "bn3",
    BasicBlock: "bn2",
    TimmBottleneck: "bn3",
}  # the residual branch's last BatchNorm of each block


def init_residual_bn(model: nn.Module, zero: bool) -> int:
    """MODEL.ZERO_INIT_RESIDUAL: the last BatchNorm weight of every
    residual block at 0 (each block then starts as the identity, and the
    signal of a deep net passes through at the start), or at 1.

    torchvision leaves them at 1 unless built with zero_init_residual;
    timm zeroes them in its ResNets (zero_init_last) and in other blocks
    with a zero_init_last() method, which is used when zero. Under one
    recipe (SGD 0.2, no warmup, 3 epochs of mnist5k at 32 px)
    torchvision's resnet18 stayed at 14.6% val top-1 and timm's reached
    87.6% (docs/recipes.md, "Residual blocks that start as the
    identity"). Returns the number of blocks set."""
    count = 0
    for module in model.modules():
        name = next((n for cls, n in _LAST_BN.items() if type(module) is cls), None)
        bn = getattr(module, name, None) if name else None
        if isinstance(bn, nn.BatchNorm2d) and bn.weight is not None:
            with torch.no_grad():
                bn.weight.fill_(0.0 if zero else 1.0)
            count += 1
        elif zero and name is None and callable(getattr(module, "zero_init_last", None)):
            # timm's other residual blocks (RegNet, ...) know their last
            # norm
            module.zero_init_last()
            count += 1
        elif (
            not zero
            and isinstance(module, nn.modules.batchnorm._BatchNorm)
            and module.weight is not None
            and not module.weight.detach().any()
        ):  # a norm a library zeroed (BatchNorm starts at 1)
            with torch.no_grad():
                module.weight.fill_(1.0)
            count += 1
    return count


# resolve_arch's library -> its constructor (name, num_classes,
# in_chans, im_size)
_CREATE: dict[str, Callable[..., nn.Module]] = {
    "tiny": _create_tiny,
    "user": _build_user,
    "timm": _create_timm,
    "torchvision": _create_torchvision,
}


def build_model(cfg, new_head: bool = False, with_weights: bool = True) -> nn.Module:
    """The model named by cfg.MODEL.ARCH, on the CPU, not wrapped and
    not SyncBN-converted.

    new_head: training, so a MODEL.WEIGHTS file whose classifier has
    another class count is loaded with the classifier re-initialised
    (eval / predict / export refuse it). with_weights False: the
    architecture only, for callers that load a checkpoint's weights
    themselves.
    """
    if cfg.get("IMPORTS"):  # load_config did; a cfg built by hand (Python API) may not have
        import_user_modules(cfg.IMPORTS)
    lib, name = resolve_arch(cfg.MODEL.ARCH)
    model = _CREATE[lib](name, cfg.MODEL.NUM_CLASSES, cfg.MODEL.IN_CHANS, cfg.TRAIN.IM_SIZE)
    if cfg.MODEL.SMALL_STEM:
        _use_small_stem(model, cfg.MODEL.ARCH)
    init_residual_bn(model, bool(cfg.MODEL.get("ZERO_INIT_RESIDUAL", True)))
    if with_weights and (cfg.MODEL.WEIGHTS or cfg.MODEL.PRETRAINED):
        _load_initial_weights(model, cfg, new_head)
    return model


def _load_initial_weights(model: nn.Module, cfg, new_head: bool) -> None:
    """MODEL.WEIGHTS (this model's weights; the head may be new when
    new_head), else MODEL.PRETRAINED (True: torch hub's cached file for
    MODEL.ARCH, its head loaded when it fits; a path: a start for a new
    task, its head never loaded). See docs/recipes.md, Fine-tuning."""
    pretrained = cfg.MODEL.PRETRAINED
    if cfg.MODEL.WEIGHTS:
        # WEIGHTS replaces every tensor (the head too, unless
        # re-initialised), so PRETRAINED would change nothing.
        if pretrained:
            log.info("MODEL.WEIGHTS is set, so MODEL.PRETRAINED weights are not looked up")
        load_weights(model, cfg.MODEL.WEIGHTS, allow_head_mismatch=new_head)
    elif pretrained:
        # A file of another task: a new head size and a changed stem
        # (IN_CHANS, SMALL_STEM) are expected.
        path = pretrained if isinstance(pretrained, str) else pretrained_file(cfg.MODEL.ARCH)
        weights.load_file(
            model,
            path,
            "MODEL.PRETRAINED",
            new_head=True,
            adapt_stem=True,
            fresh_head=isinstance(pretrained, str),
        )


# ---------------------------------------------------------------------------------------------
# Pretrained weights: local files only
# ---------------------------------------------------------------------------------------------
def pretrained_candidates(arch: str) -> tuple[list[str], str]:
    """Where PRETRAINED True looks for the weights of arch, and where
    they can be obtained."""
    lib, name = resolve_arch(arch)
    folder = os.path.join(torch.hub.get_dir(), "checkpoints")
    if lib == "torchvision":
        # The file name torchvision itself would download to, so an
        # existing hub cache just works.
        url = torchvision.models.get_model_weights(name).DEFAULT.url
        return [
            os.path.join(folder, os.path.basename(url))
        ], f"fetch it on a machine with internet from {url}"
    names = dict.fromkeys([name, arch])  # timm's name, then the alias, without repeats
    paths = [os.path.join(folder, n + ext) for n in names for ext in (".safetensors", ".pth")]
    pcfg = timm.models.get_pretrained_cfg(name.split(".", 1)[0]) if lib == "timm" else None
    hub = getattr(pcfg, "hf_hub_id", None)
    where = f"e.g. model.safetensors of https://huggingface.co/{hub}, renamed" if hub else ""
    return paths, where


def pretrained_file(arch: str) -> str:
    """The local file MODEL.PRETRAINED True loads for arch (torch hub's
    cache); UserError if absent."""
    paths, where = pretrained_candidates(arch)
    found = [p for p in paths if os.path.isfile(p)]
    if not found:
        hints = ([f"or {os.path.basename(paths[1])}"] if len(paths) > 1 else []) + (
            [where] if where else []
        )
        hint = f" ({'; '.join(hints)})" if hints else ""
        raise UserError(
            f"MODEL.PRETRAINED True needs the weights of {arch} as a local file (nothing is "
            f"downloaded): put them at {paths[0]}{hint}, or give a file's path: MODEL.PRETRAINED "
            "PATH (or MODEL.WEIGHTS PATH for weights of this very model)"
        )
    return found[0]


# ---------------------------------------------------------------------------------------------
# Loading and saving weights (the files themselves: weights.py)
# ---------------------------------------------------------------------------------------------
def load_weights(model: nn.Module, path: str, allow_head_mismatch: bool = False) -> None:
    """Load MODEL.WEIGHTS strictly: every tensor name and shape must
    match.

    allow_head_mismatch: a classifier of another class count is
    re-initialised (one log line) instead of being an error, for
    fine-tuning on another number of classes.
    """
    weights.load_file(unwrap(model), path, "MODEL.WEIGHTS", new_head=allow_head_mismatch)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP / DataParallel (.module) and torch.compile
    (._orig_mod) wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def state_dict_for_saving(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without wrapper prefixes: loadable by plain
    torchvision / timm models."""
    return unwrap(model).state_dict()


def convert_syncbn(model: nn.Module) -> nn.Module:
    """BatchNorm -> SyncBatchNorm (statistics over the global batch).

    timm's converter, because torch's would turn timm's BatchNormAct2d
    (RegNet, BoTNet) into a plain SyncBatchNorm and silently drop the
    activation fused into it.
    """
    return timm.layers.convert_sync_batchnorm(model)


def count_parameters(model: nn.Module) -> int:
    """Number of parameters (trainable or not) of the unwrapped model."""
    return sum(p.numel() for p in unwrap(model).parameters())

"""Which layers of a model are its classifier head, and which are the
backbone.

Fine-tuning needs the answer three times: loading weights of another
class count (the head is re-initialised), freezing the backbone
(TRAIN.FREEZE_BACKBONE_EPOCHS) and a lower backbone LR
(OPTIM.BACKBONE_LR_SCALE). The head is asked of the library first,
guessed last:

  1. timm: the model's pretrained cfg names it (``classifier``: 'fc',
     'head.fc', or a tuple such as DeiT's ('head', 'head_dist')), else
     ``get_classifier()`` returns it (timm's ResNet class, which the
     tiny ResNets are, has no pretrained cfg when built directly);
  2. torchvision: the attribute its classification models use (``fc``,
     ``classifier``, ``heads``, ``head``); inside a Sequential, its last
     Linear (or 1x1 conv: SqueezeNet);
  3. otherwise the model's last Linear (last conv when it has none).

Auxiliary class-score layers of the same width (GoogLeNet's aux1/aux2,
Inception's AuxLogits) are part of the head too. Everything else,
normalisation layers of a classifier Sequential included, is the
backbone.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn

from distribuuuu.errors import UserError

_TORCHVISION_HEADS = ("fc", "classifier", "heads", "head")
_SCORE_LAYERS = (nn.Linear, nn.Conv2d)


def _width(module: nn.Module) -> int:
    return module.out_features if isinstance(module, nn.Linear) else module.out_channels


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _last_score_layer(prefix: str, module: nn.Module) -> str | None:
    """The name of module itself if it scores classes, else of the last
    Linear (or conv) inside it."""
    if isinstance(module, _SCORE_LAYERS):
        return prefix
    inner = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)]
    inner = inner or [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Conv2d)]
    if not inner:
        return None
    name = inner[-1][0]
    return f"{prefix}.{name}" if prefix else name


def _timm_head(model: nn.Module) -> list[str]:
    cfg = getattr(model, "pretrained_cfg", None) or {}
    names = cfg.get("classifier") if isinstance(cfg, dict) else None
    if names:
        names = [names] if isinstance(names, str) else list(names)
        found = [n for n in names if isinstance(_submodule(model, n), _SCORE_LAYERS)]
        if found:
            return found
    get = getattr(model, "get_classifier", None)
    if not callable(get):
        return []
    try:
        heads = get()
    except (AttributeError, NotImplementedError):
        return []
    heads = heads if isinstance(heads, tuple) else (heads,)
    by_id = {id(m): n for n, m in model.named_modules()}
    found = []
    for head in heads:
        if isinstance(head, nn.Module) and id(head) in by_id:
            name = _last_score_layer(by_id[id(head)], head)
            if name is not None:
                found.append(name)
    return found


def _named_head(model: nn.Module) -> list[str]:
    for attr in _TORCHVISION_HEADS:
        module = getattr(model, attr, None)
        if isinstance(module, nn.Module):
            name = _last_score_layer(attr, module)
            if name is not None:
                return [name]
    return []


def _last_layer(model: nn.Module) -> list[str]:
    name = _last_score_layer("", model)
    return [name] if name else []


def head_layers(model: nn.Module) -> list[str]:
    """Module names of the classifier layer(s) of an unwrapped model:
    the main one first, then auxiliary class-score layers of the same
    width (see the module docstring for the rules)."""
    main = _timm_head(model) or _named_head(model) or _last_layer(model)
    if not main:
        return []
    width = _width(model.get_submodule(main[0]))
    aux = [
        n
        for n, m in model.named_modules()
        if isinstance(m, _SCORE_LAYERS)
        and n not in main
        and "aux" in n.lower()
        and _width(m) == width
    ]
    return main + aux


def head_state_keys(model: nn.Module) -> set[str]:
    """The state-dict names of the head's tensors (weight and bias of
    each head layer)."""
    return {
        f"{layer}.{name}"
        for layer in head_layers(model)
        for name, _ in model.get_submodule(layer).named_parameters(recurse=False)
    }


def head_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The head's parameters (the same objects the model and a wrapper
    around it train)."""
    return [p for layer in head_layers(model) for p in model.get_submodule(layer).parameters()]


def split_parameters(
    model: nn.Module, params: Iterable[nn.Parameter] | None = None
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(backbone, head) of ``params`` (default: every parameter of
    model), by identity, so a DDP / compile wrapper's renamed parameters
    sort the same way. UserError when there is no head."""
    head_ids = {id(p) for p in head_parameters(model)}
    if not head_ids:
        raise UserError(
            f"cannot find the classifier of this {type(model).__name__} (no Linear or conv layer), "
            "which TRAIN.FREEZE_BACKBONE_EPOCHS and OPTIM.BACKBONE_LR_SCALE leave training; set "
            "them to 0 and 1.0"
        )
    params = list(model.parameters()) if params is None else list(params)
    return [p for p in params if id(p) not in head_ids], [p for p in params if id(p) in head_ids]


def describe(model: nn.Module) -> str:
    """'fc' or 'head, head_dist': the head's layer names, for log lines
    and messages."""
    return ", ".join(head_layers(model)) or "(none found)"

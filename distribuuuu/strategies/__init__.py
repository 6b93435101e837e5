"""The ways of training (DIST.STRATEGY): one module per way, one registry line each.

``build(cfg, ctx)`` picks the Strategy for this run. With one process there is nothing to
distribute: ddp / zero1 / fsdp train as ``single`` (fsdp says so), and dp drives all the GPUs
of its one process. With several processes dp trains as ddp. Adding a strategy: a module here
with a ``STRATEGY`` class (a subclass of base.Strategy), one line in ``_MODULES``, and its name
in the config's DIST.STRATEGY choices.
"""

from __future__ import annotations

import importlib
from typing import Any

from yacs.config import CfgNode

from distribuuuu.strategies.base import Strategy

_MODULES = {  # name -> module of distribuuuu.strategies (imported when chosen)
    "single": "single",
    "ddp": "ddp",
    "zero1": "zero1",
    "fsdp": "fsdp",
    "dp": "dp",
}


def resolve(name: str, distributed: bool) -> str:
    """The strategy that trains DIST.STRATEGY ``name`` with one process or several."""
    if not distributed:
        return "dp" if name == "dp" else "single"
    return "ddp" if name == "dp" else name


def build(cfg: CfgNode, ctx: Any) -> Strategy:
    """The Strategy of this run (see the module docstring for the one-process cases)."""
    module = importlib.import_module(f"distribuuuu.strategies.{_MODULES[resolve(cfg.DIST.STRATEGY, ctx.distributed)]}")
    return module.STRATEGY(cfg, ctx)


__all__ = ["Strategy", "build", "resolve"]

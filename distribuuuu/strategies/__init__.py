"""The ways of training (DIST.STRATEGY): one module per way, one registry line each.

``build(cfg, ctx)`` picks the Strategy for this run. With one process there is nothing to
distribute: ddp / zero1 / fsdp train as ``single`` (fsdp says so), and dp drives all the GPUs
of its one process; dp with several processes is refused before any starts (DP.check_config).
``strategy_class(name)`` is the class that DIST.STRATEGY names, asked before the run for its
config rules, process-group backend and collectives. Adding a strategy: a module here with a
``STRATEGY`` class (a subclass of base.Strategy), one line in ``_MODULES``, and its name in the
config's DIST.STRATEGY choices.
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
    return name if distributed or name == "dp" else "single"


def strategy_class(name: str) -> type[Strategy]:
    """The Strategy subclass of DIST.STRATEGY ``name`` (its module imported on first use)."""
    return importlib.import_module(f"distribuuuu.strategies.{_MODULES[name]}").STRATEGY


def build(cfg: CfgNode, ctx: Any) -> Strategy:
    """The Strategy of this run (see the module docstring for the one-process cases)."""
    return strategy_class(resolve(cfg.DIST.STRATEGY, ctx.distributed))(cfg, ctx)


__all__ = ["Strategy", "build", "resolve", "strategy_class"]

"""The old name of ``distribuuuu.launch`` (renamed in 0.2: tools skip
folders named ``dist``).

Kept for one release so that user code and TRAIN.HOOKS strings written
against it still import: ``distribuuuu.dist.signals.Preempted``, ``from
distribuuuu.dist import comm``, ``distribuuuu.dist.launch.detect`` (now
``distribuuuu.launch.launcher``). New code imports
``distribuuuu.launch``.
"""

from __future__ import annotations

import importlib
import sys
import warnings

warnings.warn(
    "distribuuuu.dist is now distribuuuu.launch (and dist.launch is launch.launcher); the old "
    "name goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)

# old submodule name -> new module: registered in sys.modules so `import
# distribuuuu.dist.X` works too
_RENAMED = {
    "comm": "comm",
    "gloo_cuda": "gloo_cuda",
    "group": "comm",
    "hostlist": "hostlist",
    "launch": "launcher",
    "signals": "signals",
    "spawn": "spawn",
}
for _old, _new in _RENAMED.items():
    _module = importlib.import_module(f"distribuuuu.launch.{_new}")
    sys.modules[f"{__name__}.{_old}"] = _module
    globals()[_old] = _module
__path__: list[
    str
] = []  # a package to the import system, so `import distribuuuu.dist.signals` is looked up above

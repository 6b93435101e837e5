"""distribuuuu: the pure and clear PyTorch distributed training framework for image classification.

The Python API (distribuuuu/api.py): ``train(cfg, hooks=())``, ``evaluate(cfg)``,
``load_model(checkpoint_path)``, importable from here: ``from distribuuuu import train``.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["train", "evaluate", "load_model", "__version__"]

_API = ("train", "evaluate", "load_model")


def __getattr__(name: str) -> Any:
    # Loaded on first use (PEP 562): `import distribuuuu.<module>` (the CLI, each spawned rank)
    # must not pay for torch, the models and the engine just to reach one small module.
    if name in _API:
        from distribuuuu import api

        return getattr(api, name)
    raise AttributeError(f"module 'distribuuuu' has no attribute {name!r}")

"""distribuuuu: the pure and clear PyTorch distributed training
framework for image classification.

The Python API (distribuuuu/api.py): ``train(cfg, hooks=())``,
``evaluate(cfg)``, ``load_model(checkpoint_path)``, importable from
here: ``from distribuuuu import train``. They load api.py on first use:
`import distribuuuu.<module>` (the CLI, each spawned rank) must not pay
for torch, the models and the engine just to reach one small module.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["train", "evaluate", "load_model", "__version__"]


def train(*args: Any, **kwargs: Any) -> Any:
    """distribuuuu.api.train."""
    from distribuuuu import api

    return api.train(*args, **kwargs)


def evaluate(*args: Any, **kwargs: Any) -> Any:
    """distribuuuu.api.evaluate."""
    from distribuuuu import api

    return api.evaluate(*args, **kwargs)


def load_model(*args: Any, **kwargs: Any) -> Any:
    """distribuuuu.api.load_model."""
    from distribuuuu import api

    return api.load_model(*args, **kwargs)

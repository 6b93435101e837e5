"""distribuuuu: the pure and clear PyTorch distributed training framework for image classification."""

__version__ = "0.1.0"

"""vpo-lightning: Vector Policy Optimization post-training on PyTorch Lightning."""

__version__ = "0.1.0"

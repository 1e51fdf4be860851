"""tracktron: Detectron's training loop on PyTorch/torchvision, tracked in MLflow."""

__version__ = "0.1.0"

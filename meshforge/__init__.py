"""meshforge: recipe-driven distributed transformer training on PyTorch's native parallelisms."""

__version__ = "0.1.0"

"""flodl: Hydra-configured data-parallel training on PyTorch."""

from flodl.metrics.scalars import record_scalar

__all__ = ["record_scalar"]

"""flodl: Hydra-configured data-parallel training on PyTorch.

A run starts from `train.py` (see the README); a task's code may call `record_scalar`. The rooms of the
package and the direction of their imports: docs/architecture.md.
"""

from flodl.metrics.scalars import record_scalar

__all__ = ["record_scalar"]

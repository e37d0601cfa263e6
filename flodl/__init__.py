"""flodl: Hydra-configured data-parallel training on PyTorch.

A run starts from `train.py` (see the README); a task's code may call `record_scalar`. The rooms of the
package and the direction of their imports: docs/architecture.md.
"""

from typing import Any

__all__ = ["record_scalar"]


def __getattr__(name: str) -> Any:
    # Loaded on first use, so importing the config's schema and rules (flodl.config.*) never loads torch.
    if name == "record_scalar":
        from flodl.metrics.scalars import record_scalar

        return record_scalar
    raise AttributeError(f"module 'flodl' has no attribute {name!r}")

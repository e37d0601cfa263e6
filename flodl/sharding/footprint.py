"""What one rank holds of the model's training state, whole or sharded over its group; pure.

Each trainable tensor counts its parameter, its gradient (the parameter's dtype) and the optimizer's state
kept per element (Adam's two float32 moments: 8 bytes, SGD's momentum: 4); sharded over k ranks, each holds
FSDP2's shard of each (shard_numel). Activations and the data plane come on top.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flodl.sharding.groups import shard_numel


@dataclass(frozen=True)
class TensorBytes:
    shape: tuple[int, ...]
    # Bytes per element of the parameter, and of its gradient.
    param: int
    # Bytes per element of the optimizer's state for it (0: it keeps none).
    state: int


def rank_bytes(tensors: Sequence[TensorBytes], size: int) -> int:
    """Parameter, gradient and optimizer state bytes one rank holds with the model sharded over `size`
    ranks (1: a full replica)."""
    return sum(shard_numel(t.shape, size) * (2 * t.param + t.state) for t in tensors)

"""The per-rank divergence of one reduce (torch, no collectives).

`divergence = ‖θ_pre - θ_post‖ / ‖θ_post‖` (global L2 over every parameter): how far this rank's replica
had drifted from the consensus it adopts. It is defined once here so every backend reports numbers the
guard can compare.

The squared norms add up over any split of the parameters, so a backend can take the norms piece by
piece (`DivergenceSums`, on the device, no host read) as each piece's consensus lands, and read them once
at the end.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

# Below this the consensus is numerically zero; the ratio would be noise or a division by zero.
POST_NORM_FLOOR = 1e-10


def _norms(tensors: Sequence[Tensor]) -> list[Tensor]:
    return list(torch._foreach_norm(list(tensors), 2, dtype=torch.float64))


class DivergenceSums:
    """The norms of `pre - post` and `post`, piece by piece, kept on the device (float64) until `read`
    turns them into the divergence with one host read."""

    def __init__(self) -> None:
        self.diff: list[Tensor] = []
        self.post: list[Tensor] = []

    def reset(self) -> None:
        self.diff, self.post = [], []

    @torch.no_grad()
    def add(self, pre: Sequence[Tensor], post: Sequence[Tensor], *, in_place: bool = False) -> None:
        """With `in_place=True`, `pre` is scratch and becomes `pre - post` (no model-sized temporary)."""
        self.post += _norms(post)
        if in_place:
            torch._foreach_sub_(list(pre), list(post))
            diffs = pre
        else:
            diffs = torch._foreach_sub(list(pre), list(post))
        self.diff += _norms(diffs)

    def read(self) -> float:
        """0 when ‖post‖ ≤ POST_NORM_FLOOR."""
        squares = torch.stack(self.diff + self.post).view(2, -1).square().sum(dim=1)
        diff_sq, post_sq = squares.tolist()
        post_norm = post_sq**0.5
        return diff_sq**0.5 / post_norm if post_norm > POST_NORM_FLOOR else 0.0


@torch.no_grad()
def divergence(pre: Sequence[Tensor], post: Sequence[Tensor], *, in_place: bool = False) -> float:
    """Divergence of this rank's pre-reduce params `pre` from the consensus `post`, with one host read.

    With `in_place=True`, `pre` is treated as scratch and becomes `pre - post`.
    """
    if len(pre) != len(post):
        raise ValueError(f"pre has {len(pre)} tensors but post has {len(post)}")
    if not pre:
        return 0.0
    sums = DivergenceSums()
    sums.add(pre, post, in_place=in_place)
    return sums.read()

"""The per-rank divergence triple of one reduce (torch, no collectives).

`divergence = ‖θ_pre - θ_post‖ / ‖θ_post‖` (global L2 over every parameter), with the pre and post
norms alongside: how far this rank's replica had drifted from the consensus it adopts. It is defined
once here so every backend reports numbers the guard can compare.

The squared norms add up over any split of the parameters, so a backend can take the norms piece by
piece (`DivergenceSums`, on the device, no host read) while the pieces are still being reduced, and read
them once at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

# Below this the consensus is numerically zero; the ratio would be noise or a division by zero.
POST_NORM_FLOOR = 1e-10


class DivergenceTriple(NamedTuple):
    divergence: float
    pre_norm: float
    post_norm: float


def _norms(tensors: Sequence[Tensor]) -> list[Tensor]:
    return list(torch._foreach_norm(list(tensors), 2, dtype=torch.float64))


class DivergenceSums:
    """The norms of `pre`, `pre - post` and `post`, piece by piece, kept on the device (float64) until
    `read` turns them into the three global sums of squares with one host read."""

    def __init__(self) -> None:
        self.pre: list[Tensor] = []
        self.diff: list[Tensor] = []
        self.post: list[Tensor] = []

    def reset(self) -> None:
        self.pre, self.diff, self.post = [], [], []

    @torch.no_grad()
    def add_pre(self, pre: Sequence[Tensor]) -> None:
        self.pre += _norms(pre)

    @torch.no_grad()
    def add_post(self, pre: Sequence[Tensor], post: Sequence[Tensor], *, in_place: bool = False) -> None:
        """With `in_place=True`, `pre` is scratch and becomes `pre - post` (no model-sized temporary)."""
        self.post += _norms(post)
        if in_place:
            torch._foreach_sub_(list(pre), list(post))
            diffs = pre
        else:
            diffs = torch._foreach_sub(list(pre), list(post))
        self.diff += _norms(diffs)

    def read(self) -> DivergenceTriple:
        """Every piece's `add_pre` must have had its `add_post`."""
        if not (len(self.pre) == len(self.diff) == len(self.post)):
            raise ValueError(f"{len(self.pre)} pre pieces, {len(self.diff)} diffs, {len(self.post)} post")
        squares = torch.stack(self.pre + self.diff + self.post).view(3, -1).square().sum(dim=1)
        return _triple_from_sums(*squares.tolist())


def _triple_from_sums(pre_sq: float, diff_sq: float, post_sq: float) -> DivergenceTriple:
    """The divergence is 0 when ‖post‖ ≤ POST_NORM_FLOOR; post_norm is still reported as measured."""
    pre_norm, diff_norm, post_norm = pre_sq**0.5, diff_sq**0.5, post_sq**0.5
    divergence = diff_norm / post_norm if post_norm > POST_NORM_FLOOR else 0.0
    return DivergenceTriple(divergence, pre_norm, post_norm)


@torch.no_grad()
def divergence_triple(
    pre: Sequence[Tensor], post: Sequence[Tensor], *, in_place: bool = False
) -> DivergenceTriple:
    """Divergence of this rank's pre-reduce params `pre` from the consensus `post`, with one host read.

    With `in_place=True`, `pre` is treated as scratch and becomes `pre - post`.
    """
    if len(pre) != len(post):
        raise ValueError(f"pre has {len(pre)} tensors but post has {len(post)}")
    if not pre:
        return DivergenceTriple(0.0, 0.0, 0.0)
    sums = DivergenceSums()
    sums.add_pre(pre)  # first: the in-place subtraction overwrites pre
    sums.add_post(pre, post, in_place=in_place)
    return sums.read()

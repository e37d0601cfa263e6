"""The per-rank divergence triple of one reduce (torch, no collectives).

`divergence = ‖θ_pre - θ_post‖ / ‖θ_post‖` (global L2 over every parameter), with the pre and post
norms alongside (reference §3.3 step 4, §5.1). It is defined once here so every backend reports
numbers the guard can compare.

The squared norms add up over any split of the parameters, so a backend can accumulate them piece by
piece (`DivergenceSums`, on the device, no host read) while the pieces are still being reduced, and read
them once at the end (`triple_from_sums`).
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


def _sum_of_squares(tensors: Sequence[Tensor]) -> Tensor:
    return torch.stack(torch._foreach_norm(list(tensors), 2, dtype=torch.float64)).square().sum()


class DivergenceSums:
    """`[‖pre‖², ‖pre - post‖², ‖post‖²]` in float64 on the device, accumulated piece by piece."""

    def __init__(self, device: torch.device) -> None:
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)

    def reset(self) -> None:
        self.sums.zero_()

    @torch.no_grad()
    def add_pre(self, pre: Sequence[Tensor]) -> None:
        self.sums[0] += _sum_of_squares(pre)

    @torch.no_grad()
    def add_post(self, pre: Sequence[Tensor], post: Sequence[Tensor], *, in_place: bool = False) -> None:
        """With `in_place=True`, `pre` is scratch and becomes `pre - post` (no model-sized temporary)."""
        self.sums[2] += _sum_of_squares(post)
        if in_place:
            torch._foreach_sub_(list(pre), list(post))
            diffs = pre
        else:
            diffs = torch._foreach_sub(list(pre), list(post))
        self.sums[1] += _sum_of_squares(diffs)


def triple_from_sums(pre_sq: float, diff_sq: float, post_sq: float) -> DivergenceTriple:
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
    sums = DivergenceSums(pre[0].device)
    sums.add_pre(pre)  # first: the in-place subtraction overwrites pre
    sums.add_post(pre, post, in_place=in_place)
    return triple_from_sums(*sums.sums.tolist())

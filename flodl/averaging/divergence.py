"""The per-rank divergence triple of one reduce (torch, no collectives).

`divergence = ‖θ_pre - θ_post‖ / ‖θ_post‖` (global L2 over every parameter), with the pre and post
norms alongside (reference §3.3 step 4, §5.1). It is defined once here so every backend reports
numbers the guard can compare.
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


def _sum_of_squares(norms: Sequence[Tensor]) -> Tensor:
    return torch.stack(list(norms)).square().sum()


@torch.no_grad()
def divergence_triple(
    pre: Sequence[Tensor], post: Sequence[Tensor], *, in_place: bool = False
) -> DivergenceTriple:
    """Divergence of this rank's pre-reduce params `pre` from the consensus `post`.

    Norms accumulate in float64 and stay on the device until one host read at the end. With
    `in_place=True`, `pre` is treated as scratch and becomes `pre - post`, which saves a
    model-sized temporary (the pre-sync scratch copy doubles as this scratch in the original).
    The divergence is 0 when ‖post‖ ≤ POST_NORM_FLOOR; post_norm is still reported as measured.
    """
    if len(pre) != len(post):
        raise ValueError(f"pre has {len(pre)} tensors but post has {len(post)}")
    if not pre:
        return DivergenceTriple(0.0, 0.0, 0.0)
    pre, post = list(pre), list(post)
    # pre's norm first: the in-place subtraction below overwrites it.
    pre_sq = _sum_of_squares(torch._foreach_norm(pre, 2, dtype=torch.float64))
    post_sq = _sum_of_squares(torch._foreach_norm(post, 2, dtype=torch.float64))
    if in_place:
        torch._foreach_sub_(pre, post)
        diffs = pre
    else:
        diffs = torch._foreach_sub(pre, post)
    diff_sq = _sum_of_squares(torch._foreach_norm(diffs, 2, dtype=torch.float64))
    pre_sq_v, diff_sq_v, post_sq_v = torch.stack([pre_sq, diff_sq, post_sq]).tolist()  # the one sync
    pre_norm, diff_norm, post_norm = pre_sq_v**0.5, diff_sq_v**0.5, post_sq_v**0.5
    divergence = diff_norm / post_norm if post_norm > POST_NORM_FLOOR else 0.0
    return DivergenceTriple(divergence, pre_norm, post_norm)

"""Epoch partition plans (pure): which picks each rank trains on in an epoch.

The pick space is `len(dataset) * augment`; pick p reads sample `p // augment` (view `p % augment`).
Each epoch shuffles the pick space with `seed + epoch` — identical on every rank, so a plan only
needs an `EpochSlice` per rank: consecutive disjoint slices of that permutation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flodl.links.messages import EpochSlice


def epoch_permutation(total_picks: int, seed: int, epoch: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(total_picks, generator=generator)


def equal_slices(total_picks: int, world_size: int, batch_size: int, epoch: int = 0) -> list[EpochSlice]:
    """Equal whole-batch slices of `epoch`, one per rank; the sub-batch remainder of the epoch is dropped.

    Every rank gets the same number of batches, as lock-step gradient averaging requires; every epoch is
    cut the same way.
    """
    batches_per_rank = total_picks // (world_size * batch_size)
    size = batches_per_rank * batch_size
    return [EpochSlice(epoch, offset=r * size, size=size) for r in range(world_size)]


def picks_to_samples(picks: Tensor, augment: int) -> Tensor:
    return picks // augment if augment > 1 else picks

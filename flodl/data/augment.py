"""Augment views: `augment=k` gives each sample k views; `task.transform` makes each view different.

The caches hold raw samples; the transform runs after the lookup, on the assembled batch, and receives
one `ViewKey(sample, view, epoch, seed)` per row. A key's generator is seeded from the key alone, so a view
is the same bytes in every run and on every rank, whichever rank trains it and whatever tier served it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from flodl.data.streams import mixed_seed

# (rows: list[Tensor], keys: list[ViewKey]) -> list[Tensor]
Transform = Callable[[list[Tensor], list["ViewKey"]], list[Tensor]]


class ViewKey(NamedTuple):
    sample: int
    view: int
    epoch: int
    seed: int

    def rng_seed(self) -> int:
        """A 63-bit seed mixed from every part of the key, so nearby keys are unrelated."""
        return mixed_seed(*self)

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        return torch.Generator(device=device).manual_seed(self.rng_seed())


def view_keys(picks: Tensor, augment: int, epoch: int, seed: int) -> list[ViewKey]:
    """The key of each pick: pick p is view p % augment of sample p // augment."""
    k = max(augment, 1)
    return [ViewKey(p // k, p % k, epoch, seed) for p in picks.tolist()]


def apply_transform(
    transform: Transform | None, rows: list[Tensor], picks: Tensor, augment: int, epoch: int, seed: int
) -> list[Tensor]:
    if transform is None:
        return rows
    return list(transform(rows, view_keys(picks, augment, epoch, seed)))


def gaussian_jitter(
    rows: list[Tensor], keys: list[ViewKey], std: float = 0.05, field: int = 0
) -> list[Tensor]:
    """Example transform: adds N(0, std²) noise to one field, drawn from each row's own key generator."""
    x = rows[field]
    noise = torch.stack(
        [torch.randn(x.shape[1:], generator=key.generator(), dtype=torch.float32) for key in keys]
    )
    out = list(rows)
    out[field] = x + (std * noise).to(device=x.device, dtype=x.dtype)
    return out

"""Where a rank's randomness comes from.

- The model is built from `seed` on every rank: the same initial weights everywhere.
- Then each rank's process-wide generators (torch's CPU and CUDA ones, numpy's, Python's `random`) are
  seeded from (seed, rank): dropout and anything else a training step draws differ between ranks, the same
  in every run with the same seed and world, and a checkpoint keeps each rank's own (worker/rank_state.py).
- A map-style Dataset read afresh draws, in the `__getitem__` calls of one batch, from those three
  generators seeded from (seed, epoch, the batch's first pick): whichever rank, DataLoader worker or resumed
  run reads the batch, it draws the same, and no two batches draw alike. The reader's own streams are put
  back afterwards, so reading never moves the step's.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

_MASK = (1 << 64) - 1
# Tags that keep the rank streams and the batch streams apart from each other (and from augment's ViewKeys).
_RANK = 0x52414E4B
_BATCH = 0x42415443


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def mixed_seed(*parts: int) -> int:
    """A 63-bit seed mixed from every part (splitmix64 steps), so nearby tuples give unrelated seeds."""
    state = 0
    for part in parts:
        state = _splitmix64((state ^ (part & _MASK)) & _MASK)
    return state >> 1


def rank_seed(seed: int, rank: int) -> int:
    return mixed_seed(_RANK, seed, rank)


def batch_seed(seed: int, epoch: int, first_pick: int) -> int:
    return mixed_seed(_BATCH, seed, epoch, first_pick)


def seed_rank_streams(seed: int, rank: int) -> None:
    """Seed this process's generators for `rank` (after the model is built: its weights stay everyone's)."""
    stream = rank_seed(seed, rank)
    torch.manual_seed(stream)  # the CPU generator and every CUDA device's
    random.seed(stream)
    np.random.seed(stream & 0xFFFFFFFF)


@contextmanager
def batch_streams(stream: int) -> Iterator[None]:
    """Within: the host generators (torch's CPU one, numpy's, `random`) draw the batch's stream; after: they
    are where they were."""
    saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
    torch.default_generator.manual_seed(stream)
    np.random.seed(stream & 0xFFFFFFFF)
    random.seed(stream)
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])


class SeededIndices(list):
    """One batch's sample indices and the stream its reads draw from (travels to DataLoader workers)."""

    def __init__(self, indices: list[int], stream: int) -> None:
        super().__init__(indices)
        self.stream = stream


class SeededReads(Dataset):
    """A map-style Dataset whose batches are read under their own streams (`SeededIndices`); the DataLoader
    calls `__getitems__` with a batch's indices, in the rank's process or in a worker."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._batched = getattr(dataset, "__getitems__", None)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: SeededIndices) -> list[Any]:
        with batch_streams(indices.stream):
            if self._batched is not None:
                return list(self._batched(list(indices)))
            return [self.dataset[i] for i in indices]

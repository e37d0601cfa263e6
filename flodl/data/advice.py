"""The read plan: the batches this rank was told it will train, in order, and how far it got.

Workers advise each slice they are handed (a StartEpoch, an ExtendPartition); the plan turns it into
batches of the shared epoch permutation. The prefetcher assembles batches from it and the stager stages
the samples it lists. It is advice only: a batch the worker asks for that is not the plan's next one is
found further on (the ones skipped are dropped) or served without the plan.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from flodl.data.partition import picks_to_samples


def batch_key(picks: Tensor) -> bytes:
    """Exact identity of a batch's picks (cheap: one small copy)."""
    return picks.numpy().tobytes()


@dataclass(frozen=True)
class PlannedBatch:
    key: bytes
    epoch: int
    picks: Tensor
    samples: np.ndarray
    # Absolute position in the plan.
    position: int


class ReadPlan:
    def __init__(self, augment: int) -> None:
        self.augment = augment
        self.changed = threading.Condition()
        # Slices advised so far: the stager replans at each.
        self.advised = 0
        self._batches: list[PlannedBatch] = []
        # Index in _batches of the next batch the worker will take; _base = batches dropped before it.
        self._next = 0
        self._base = 0

    def add(self, epoch: int, picks: Tensor, batch_size: int) -> None:
        """Plan the whole batches of one advised slice."""
        chunks = [chunk for chunk in picks.split(batch_size) if len(chunk) == batch_size]
        with self.changed:
            end = self._base + len(self._batches)
            self._batches.extend(
                PlannedBatch(batch_key(c), epoch, c, picks_to_samples(c, self.augment).numpy(), end + i)
                for i, c in enumerate(chunks)
            )
            self.advised += 1
            self.changed.notify_all()

    def position(self) -> int:
        """The absolute position of the next batch to take."""
        return self._base + self._next

    def get(self, position: int) -> PlannedBatch | None:
        index = position - self._base
        with self.changed:
            return self._batches[index] if 0 <= index < len(self._batches) else None

    def find(self, key: bytes) -> int | None:
        """Absolute position of the first batch with these picks at or after the next one, or None."""
        with self.changed:
            for index in range(self._next, len(self._batches)):
                if self._batches[index].key == key:
                    return self._base + index
        return None

    def take(self, position: int) -> None:
        """The worker has taken the batch at `position` (and skipped every one before it)."""
        with self.changed:
            self._next = max(self._next, position - self._base + 1)
            if self._next > 1024:  # forget what was consumed, in blocks
                del self._batches[: self._next]
                self._base += self._next
                self._next = 0
            self.changed.notify_all()

    def pending(self) -> int:
        with self.changed:
            return len(self._batches) - self._next

    def upcoming_samples(self) -> np.ndarray:
        """Samples of every batch not yet taken, in reading order."""
        with self.changed:
            arrays = [b.samples for b in self._batches[self._next :]]
        return np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)

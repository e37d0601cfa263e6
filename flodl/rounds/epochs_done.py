"""The epochs a long run has done, held in a size that does not grow with the run."""

from __future__ import annotations


class EpochsDone:
    """A set of epochs that fills in from `first` on, held as `end` (the first epoch not in it: every one
    before it is) and the few in it past `end`: its size is the gap's, however long the run (a set of every
    epoch, scanned at each round, slowed a long run's coordinator)."""

    def __init__(self, first: int) -> None:
        self.end = first
        self.past: set[int] = set()

    def add(self, epoch: int) -> None:
        if epoch >= self.end:
            self.past.add(epoch)
        while self.end in self.past:
            self.past.remove(self.end)
            self.end += 1

    def __contains__(self, epoch: int) -> bool:
        return epoch < self.end or epoch in self.past

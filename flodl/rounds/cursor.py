"""The planner's cursor: the next batch not handed out yet, across epochs, up to a segment's end."""

from __future__ import annotations

from dataclasses import dataclass

from flodl.links.messages import EpochSlice


@dataclass
class Cursor:
    """The next undispatched batch, across epochs."""

    batches_per_epoch: int
    # The end (exclusive) of the segment being handed out: (epoch, batch); (e + 1, 0) ends after epoch e.
    end: tuple[int, int]
    epoch: int = 0
    batch: int = 0

    @property
    def position(self) -> tuple[int, int]:
        return (self.epoch, self.batch)

    def exhausted(self) -> bool:
        return self.position >= self.end

    def left_in_segment(self) -> int:
        """Batches still to hand out before the segment's end, across epochs."""
        end = self.end[0] * self.batches_per_epoch + self.end[1]
        return max(end - (self.epoch * self.batches_per_epoch + self.batch), 0)

    def left_in_epoch(self) -> int:
        if self.exhausted():
            return 0
        stop = self.end[1] if self.end[0] == self.epoch else self.batches_per_epoch
        return stop - self.batch

    def take(self, n: int, batch_size: int, cross_epochs: bool) -> tuple[EpochSlice, ...]:
        slices = []
        while n > 0 and not self.exhausted():
            k = min(n, self.left_in_epoch())
            slices.append(EpochSlice(self.epoch, self.batch * batch_size, k * batch_size))
            n -= k
            self.batch += k
            if self.batch == self.batches_per_epoch:
                self.epoch, self.batch = self.epoch + 1, 0
                if not cross_epochs:
                    break
        return tuple(slices)

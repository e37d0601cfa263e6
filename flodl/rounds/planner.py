"""Window planning for local SGD (cadence / async), as pure decisions.

The coordinator feeds events (a rank reached its count, a rank acknowledged a reduce) and carries out
the actions returned (dispatch batches, average now, finish). Averaging fires on counts, never on wall
time. Batches are handed out from one cursor over the epochs: batch i of epoch e is picks
`[i*b, (i+1)*b)` of that epoch's shared permutation, so no batch is trained twice or skipped.

- cadence: a window gives rank r exactly `counts[r]` batches; one window in flight; the last window of
  an epoch splits what is left in proportion to the counts (epoch barrier).
- async: rank r is kept supplied up to `counts[r] + overshoot` batches per window and may run into the
  next epoch; the reduce fires once every rank has done `counts[r]`.

Barrier epochs (checkpoints) cut the run into segments: the cursor stops at a segment's end, every rank
trains out its queue, and the segment's last reduce is exact (no EASGD blend), so every rank holds the
same consensus when the checkpoint is taken. The next segment opens once that reduce is acknowledged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flodl.rounds.split import proportional_split
from flodl.wire.messages import EpochSlice


@dataclass(frozen=True)
class Dispatch:
    rank: int
    slices: tuple[EpochSlice, ...]
    # The rank reports Reached once it has taken this many steps since the last reduce.
    target: int


@dataclass(frozen=True)
class Average:
    round: int
    # Epochs whose eval is this round's consensus (one eval, reported for each: every wanted epoch gets one).
    evaluate_epochs: tuple[int, ...]
    # The last reduce of a segment (or of the run): every rank adopts the consensus exactly (no EASGD blend).
    final: bool
    # Take a checkpoint after this epoch once the round is done (None: no checkpoint).
    checkpoint_epoch: int | None = None


Action = Dispatch | Average


@dataclass(frozen=True)
class WindowReport:
    rank: int
    steps: int
    # Time spent training this window (data + compute), excluding waits for control messages.
    busy_ms: float


@dataclass(frozen=True)
class AckReport:
    rank: int
    steps: int
    divergence: float
    round_ms: float
    # Batches still queued on the rank (async overshoot not yet trained).
    queued: int
    # The rank's window wall time not spent training (see elche.round_overhead_ms).
    idle_ms: float = 0.0


@dataclass
class Cursor:
    """The next undispatched batch, across epochs."""

    batches_per_epoch: int
    # The end (exclusive) of the segment being handed out.
    end: int
    epoch: int = 0
    batch: int = 0

    def exhausted(self) -> bool:
        return self.epoch >= self.end

    def left_in_epoch(self) -> int:
        return 0 if self.exhausted() else self.batches_per_epoch - self.batch

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


@dataclass
class LocalSgdPlanner:
    world_size: int
    batches_per_epoch: int
    batch_size: int
    epochs: int
    is_async: bool
    # Which epochs want an eval (eval_every and the last epoch).
    eval_epochs: frozenset[int]
    # Epochs after which every rank holds the consensus for a checkpoint.
    barrier_epochs: frozenset[int] = frozenset()
    # Where a resumed run starts.
    first_epoch: int = 0
    cursor: Cursor = field(init=False)
    round: int = 0
    targets: list[int] = field(init=False)
    queued: list[int] = field(init=False)
    reached: dict[int, WindowReport] = field(default_factory=dict)
    acks: dict[int, AckReport] = field(default_factory=dict)
    completed_epochs: set[int] = field(default_factory=set)
    evaluated_epochs: set[int] = field(default_factory=set)
    averaging: bool = False
    final_round: bool = False

    def __post_init__(self) -> None:
        self.cursor = Cursor(self.batches_per_epoch, self._segment_end(self.first_epoch), self.first_epoch)
        self.targets = [0] * self.world_size
        self.queued = [0] * self.world_size

    def open_window(self, counts: list[int], overshoot: int) -> list[Action]:
        """Hand out the next window's batches for the given per-rank counts."""
        if self.is_async:
            allocation = [counts[r] + overshoot - self.queued[r] for r in range(self.world_size)]
        else:
            allocation = list(counts)
            left = self.cursor.left_in_epoch()
            if sum(allocation) >= left:  # the epoch's last window: split the remainder
                allocation = proportional_split(left, counts)
        taken = []
        for rank, want in enumerate(allocation):
            slices = self.cursor.take(max(want, 0), self.batch_size, cross_epochs=self.is_async)
            given = sum(s.size for s in slices) // self.batch_size
            self.queued[rank] += given
            taken.append((slices, given))
        # Targets once every rank is served: a later rank's take may run the data out, and then every rank,
        # earlier ones too, must train all it holds before this round, so that it is the exact last one.
        exhausted = self.cursor.exhausted()
        actions: list[Action] = []
        for rank, (slices, given) in enumerate(taken):
            if exhausted:
                self.targets[rank] = self.queued[rank]
            else:  # async: the count; cadence: what it was given
                self.targets[rank] = min(counts[rank], self.queued[rank]) if self.is_async else given
            actions.append(Dispatch(rank, slices, self.targets[rank]))
        # Every rank reports Reached, even with a target of 0 (an epoch tail can leave a rank idle).
        self.reached = {}
        return actions

    def on_reached(self, report: WindowReport) -> list[Action]:
        self.reached[report.rank] = report
        return self._maybe_average()

    def on_epoch_complete(self, epoch: int) -> None:
        self.completed_epochs.add(epoch)

    def on_ack(self, ack: AckReport) -> bool:
        """Record one rank's reduce; True once every rank has acknowledged the round."""
        self.acks[ack.rank] = ack
        self.queued[ack.rank] = ack.queued
        if len(self.acks) < self.world_size:
            return False
        self.averaging = False
        return True

    @property
    def settled_end(self) -> int:
        """The first epoch not settled: every batch of the epochs before it has been trained. Async ranks can
        finish a later epoch before an earlier one; an epoch's eval waits for the epochs before it."""
        end = self.first_epoch
        while end in self.completed_epochs:
            end += 1
        return end

    @property
    def segment_done(self) -> bool:
        """The segment's last reduce is acknowledged: every rank holds the same consensus."""
        return self.final_round and not self.averaging

    @property
    def finished(self) -> bool:
        return self.segment_done and self.cursor.end == self.epochs

    @property
    def segment_end(self) -> int:
        return self.cursor.end

    def next_segment(self) -> None:
        """Open the segment after a completed one (the caller opens its first window)."""
        self.cursor.end = self._segment_end(self.cursor.end)
        self.final_round = False

    def stop(self) -> int:
        """End the run at the first epoch boundary the cursor has not passed (every batch handed out is still
        trained, and the last reduce is exact); return the last epoch."""
        end = self.cursor.epoch + (1 if self.cursor.batch else 0)
        self.epochs = end
        self.cursor.end = min(self.cursor.end, end)
        self.barrier_epochs = frozenset(e for e in self.barrier_epochs if e < end)
        return end - 1

    def _segment_end(self, start: int) -> int:
        return min([e + 1 for e in self.barrier_epochs if e >= start] + [self.epochs])

    def state(self) -> dict[str, Any]:
        """What a resumed planner needs beyond its settings (taken between segments)."""
        return {"round": self.round, "evaluated_epochs": sorted(self.evaluated_epochs)}

    def restore(self, state: dict[str, Any]) -> None:
        self.round = int(state["round"])
        self.evaluated_epochs = set(state["evaluated_epochs"])
        self.completed_epochs = set(range(self.first_epoch))

    def window_acks(self) -> list[AckReport]:
        return [self.acks[r] for r in range(self.world_size)]

    def window_reports(self) -> list[WindowReport]:
        return [self.reached[r] for r in range(self.world_size)]

    def _maybe_average(self) -> list[Action]:
        if self.averaging or len(self.reached) < self.world_size:
            return []
        self.averaging = True
        self.round += 1
        self.acks = {}
        self.final_round = self.cursor.exhausted() and all(
            self.queued[r] <= self.targets[r] for r in range(self.world_size)
        )
        due = sorted(e for e in self.eval_epochs - self.evaluated_epochs if e < self.settled_end)
        if self.final_round:
            due = sorted(
                e for e in self.eval_epochs if e not in self.evaluated_epochs and e < self.cursor.end
            )
        self.evaluated_epochs.update(due)
        barrier = self.final_round and self.cursor.end - 1 in self.barrier_epochs
        return [Average(self.round, tuple(due), self.final_round, self.cursor.end - 1 if barrier else None)]
